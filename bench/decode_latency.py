"""Decode latency of the DeepSeek-V4 model: eager, fxsplit piecewise capture, reduce-overhead.

``torch.compile(mode="reduce-overhead")`` is Inductor with whole-graph CUDA graphs.

Each variant gets its own model copy and a persistent-buffer runner ("v2": the same input
tensors every step, as an engine feeds a captured model), is warmed up (and captured), then
timed over ``--steps`` decode steps per batch size; prints a table and writes JSON.

Usage: python bench/decode_latency.py [--device cuda] [--batches 1 8 32] [--steps 50]
       [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
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


def measure(device: str, batches, steps: int, layers: int) -> dict:
    """``{variant: {batch: ms per step}}`` plus run details."""
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
    results: dict[str, dict[int, float]] = {name: {} for name in variants}
    with torch.no_grad():
        for name, make in variants.items():
            torch._dynamo.reset()
            model = make(deepseek_v4.clone_model(base))
            for batch in batches:
                feed = deepseek_v4.DecodeRunner(
                    config, max(batches), persistent=True, device=device
                )
                for _ in range(3):  # sequences of a few tokens
                    feed.step(batch)
                inputs = feed.step(batch)
                results[name][batch] = _time_steps(model, inputs, steps, device)
    return {
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
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = measure(args.device, args.batches, args.steps, args.layers)
    print(f"{result['device']}, torch {result['torch']}, {args.layers} layers, ms per decode step")
    names = list(result["ms_per_step"])
    print("batch " + " ".join(f"{n:>16}" for n in names))
    for batch in args.batches:
        row = " ".join(f"{result['ms_per_step'][n][batch]:16.3f}" for n in names)
        print(f"{batch:5d} {row}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
