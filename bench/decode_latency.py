"""Decode latency of the DeepSeek-V4 model: eager, fxsplit piecewise capture, reduce-overhead.

``torch.compile(mode="reduce-overhead")`` is Inductor with whole-graph CUDA graphs.

Each variant gets its own model copy and a persistent-buffer runner ("v2": the same input
tensors every step, as an engine feeds a captured model), is warmed up (and captured), then
timed over ``--steps`` decode steps per batch size; prints a table and writes JSON.

Each (variant, batch) part runs under ``--part-timeout`` seconds (SIGALRM): a part that runs
over (``reduce-overhead`` compiles once per batch size with ``dynamic=False``) is reported as
skipped, and the variant's later batches are skipped too, so the whole run fits a lease.

Usage: python bench/decode_latency.py [--device cuda] [--batches 1 8 32] [--steps 50]
       [--layers 4] [--part-timeout 120] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import time

import torch

import fxsplit
from fxsplit.models import deepseek_v4


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_steps(fn, inputs, steps: int, device: str) -> float:
    """Milliseconds per call of ``fn(*inputs)``, after 3 untimed calls."""
    for _ in range(3):
        fn(*inputs)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn(*inputs)
    _sync(device)
    return (time.perf_counter() - start) / steps * 1e3


class PartTimeout(Exception):
    """A (variant, batch) part ran over its time limit."""


@contextlib.contextmanager
def _time_limit(seconds: int):
    def expire(signum, frame):
        raise PartTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _timed_out(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was raised from, a PartTimeout (Dynamo wraps exceptions that
    interrupt its compilation)."""
    while error is not None:
        if isinstance(error, PartTimeout):
            return True
        error = error.__cause__ or error.__context__
    return False


def measure(device: str, batches, steps: int, layers: int, part_timeout: int = 120) -> dict:
    """``{variant: {batch: ms per step, or None where skipped}}`` plus run details and the
    list of skipped parts."""
    config = deepseek_v4.DeepseekV4Config(num_layers=layers)
    base = deepseek_v4.build(config).to(device)
    capture = "cuda" if device == "cuda" else "emulate"
    variants = {
        "eager": lambda m: m,
        "fxsplit_v2": lambda m: torch.compile(
            m, backend=fxsplit.Backend(runner="v2", capture=capture), dynamic=False
        ),
    }
    if device == "cuda":
        variants["reduce_overhead"] = lambda m: torch.compile(
            m, mode="reduce-overhead", dynamic=False
        )
    results: dict[str, dict[int, float | None]] = {name: {} for name in variants}
    skipped: list[str] = []
    with torch.no_grad():
        for name, make in variants.items():
            torch._dynamo.reset()
            model = make(deepseek_v4.clone_model(base))
            timed_out = False
            for batch in batches:
                if timed_out:
                    results[name][batch] = None
                    skipped.append(f"{name} batch {batch}: skipped after an earlier timeout")
                    continue
                feed = deepseek_v4.DecodeRunner(
                    config, max(batches), persistent=True, device=device
                )
                for _ in range(3):  # sequences of a few tokens
                    feed.step(batch)
                inputs = feed.step(batch)
                try:
                    with _time_limit(part_timeout):
                        results[name][batch] = _time_steps(model, inputs, steps, device)
                except Exception as error:
                    if not _timed_out(error):
                        raise
                    results[name][batch] = None
                    timed_out = True
                    skipped.append(f"{name} batch {batch}: over {part_timeout} s")
    return {
        "skipped": skipped,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": layers,
        "steps": steps,
        "ms_per_step": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--part-timeout", type=int, default=120, help="seconds per part")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = measure(args.device, args.batches, args.steps, args.layers, args.part_timeout)
    print(f"{result['device']}, torch {result['torch']}, {args.layers} layers, ms per decode step")
    names = list(result["ms_per_step"])
    print("batch " + " ".join(f"{n:>16}" for n in names))
    for batch in args.batches:
        cells = (result["ms_per_step"][n][batch] for n in names)
        row = " ".join("         skipped" if c is None else f"{c:16.3f}" for c in cells)
        print(f"{batch:5d} {row}")
    for line in result["skipped"]:
        print(f"skipped: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
