"""Start time of the ``fxsplit`` command: ``--version`` and every ``<command> --help``.

Each command runs ``--repeat`` times in a fresh process (``python -m fxsplit.tools.cli``, so the
figure does not depend on how the console script was installed); prints the best and the median
wall time per command, whether the process imported torch or transformers (from ``-X
importtime``), and the target: every command under 1 s without importing either.

Usage: python bench/cli_start.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = (
    ["--version"],
    ["--help"],
    ["demo", "--help"],
    ["dump", "--help"],
    ["diff", "--help"],
    ["cache", "--help"],
)
TARGET_S = 1.0
HEAVY = ("torch", "transformers")


def _run(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "fxsplit.tools.cli", *argv],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def _heavy_imports(argv: list[str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fxsplit.tools.cli", *argv],
        check=True,
        capture_output=True,
        text=True,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    return [name for name in HEAVY if name in imported]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'command':<22} {'best s':>7} {'median s':>9}  heavy imports")
    met = True
    for argv in COMMANDS:
        times = [_run(argv) for _ in range(args.repeat)]
        heavy = _heavy_imports(argv)
        met &= max(times) < TARGET_S and not heavy
        print(
            f"fxsplit {' '.join(argv):<14} {min(times):>7.3f} {statistics.median(times):>9.3f}  "
            f"{', '.join(heavy) or '-'}"
        )
    print(f"target: every command under {TARGET_S:g} s, no torch/transformers import: ", end="")
    print("met" if met else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
