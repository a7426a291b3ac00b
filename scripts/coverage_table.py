"""Recompute docs/coverage.md's Hugging Face coverage table and write it between its markers.

Compiles every architecture of ``fxsplit.models.hf_architectures`` under runners v1 and v2 with
``backend="fxsplit"`` (capture emulated, prefill + 12 decode steps with a ``DynamicCache`` and
again with a ``StaticCache``, about 30 minutes on 2 CPU cores) and rewrites the section between
``fxsplit.tools.coverage.BEGIN`` and ``END``.
``--check`` only compares and exits 1 when the page is stale.

    python3 scripts/coverage_table.py [--check] [--page docs/coverage.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fxsplit.models import hf_architectures
from fxsplit.tools import coverage


def main() -> int:
    """Compute the table; write it into the page (or compare with ``--check``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parent.parent / "docs" / "coverage.md"
    parser.add_argument("--page", type=Path, default=default, help="page to rewrite")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args()
    results = []
    for architecture in hf_architectures.names():
        for runner in ("v1", "v2"):
            for cache in hf_architectures.CACHES:
                start = time.perf_counter()
                result = coverage.attempt(architecture, runner, cache)
                results.append(result)
                status = result.error or ("exact" if result.exact else f"differs {result.diffs}")
                replays, calls = result.replays
                took = time.perf_counter() - start
                print(
                    f"{architecture} {runner} {cache}: {status}, {replays}/{calls} replays "
                    f"({took:.1f} s)",
                    file=sys.stderr,
                )
    body = coverage.table(results)
    text = args.page.read_text(encoding="utf-8")
    if args.check:
        stale = coverage.section(text) != body
        print("the coverage table is stale" if stale else "the coverage table is current")
        return 1 if stale else 0
    args.page.write_text(coverage.replace_section(text, body), encoding="utf-8")
    print(f"wrote the coverage table into {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
