"""Run every causal-LM architecture of the installed transformers through fxsplit, tiny.

For each architecture of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: build it tiny (2 layers,
hidden 64, vocabulary 128; nothing downloaded), prefill and decode with a ``DynamicCache``
eagerly and compiled under runners v1 and v2 (capture emulated), and report equal / wrong /
crash and the share of captured-piece calls that replay from decode step 4 on
(:mod:`fxsplit.tools.zoo`). Architectures run in child processes, a batch each, under a memory
limit and a time limit per architecture: one that exhausts either is reported, not fatal.

    python3 scripts/hf_zoo.py [--only NAME ...] [--write docs/hf_zoo.md] [--json out.json]

The full run takes about an hour and a half on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import subprocess
import sys
import time
from pathlib import Path

MEMORY = 8 << 30  # bytes of address space per child
SECONDS = 600  # per architecture
BATCH = 12  # architectures per child process


def _worker(names: list[str]) -> None:
    """Child: run each architecture, one JSON line each on stdout."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    import warnings

    warnings.simplefilter("ignore")
    import transformers

    from fxsplit.tools import zoo

    transformers.logging.set_verbosity_error()
    for name in names:
        row = zoo.run(name)
        print(json.dumps(row.as_dict()), flush=True)


def _run_batch(names: list[str]) -> list[dict]:
    """Run ``names`` in a child; an architecture that kills it or runs out of time is recorded
    as such and the rest go to a new child."""
    done: list[dict] = []
    todo = list(names)
    while todo:
        child = subprocess.Popen(
            [sys.executable, __file__, "--worker", *todo],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        deadline = time.monotonic() + SECONDS
        while todo:
            ready, _, _ = select.select([child.stdout], [], [], max(deadline - time.monotonic(), 0))
            line = child.stdout.readline() if ready else ""
            if line:
                row = json.loads(line)
                done.append(row)
                print(f"{row['architecture']}: {_short(row)}", file=sys.stderr, flush=True)
                todo.remove(row["architecture"])
                deadline = time.monotonic() + SECONDS
                continue
            child.kill()
            child.wait()
            why = "timed out" if not ready else f"killed (exit {child.returncode}; memory?)"
            row = {"architecture": todo.pop(0), "runners": {}, "reason": why, "attention": ""}
            done.append(row)
            print(f"{row['architecture']}: {why}", file=sys.stderr, flush=True)
            break
        child.stdout.close()
        child.wait()
    return done


def _short(row: dict) -> str:
    if not row["runners"]:
        return row["reason"]
    return ", ".join(
        f"{r} {v['status']} {v['replays']}/{v['calls']}" for r, v in row["runners"].items()
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="these architectures only")
    parser.add_argument("--write", type=Path, help="write the Markdown table and counts here")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return 0
    from fxsplit.models import hf_zoo
    from fxsplit.tools import zoo

    names = args.only or hf_zoo.architectures()
    start = time.perf_counter()
    rows = []
    for i in range(0, len(names), BATCH):
        rows += _run_batch(names[i : i + BATCH])
    order = {n: i for i, n in enumerate(names)}
    rows = sorted((zoo.Row.from_dict(r) for r in rows), key=lambda r: order[r.architecture])
    minutes = (time.perf_counter() - start) / 60
    import torch
    import transformers

    head = (
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {minutes:.0f} min"
    )
    text = f"{zoo.summary(rows)}\n\n({head})\n\n{zoo.table(rows)}\n"
    print(text)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(
            "# The transformers zoo through fxsplit\n\nWritten by `python3 scripts/hf_zoo.py "
            f"--write {args.write}`.\n\n{text}",
            encoding="utf-8",
        )
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in rows], indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
