"""Decode step of the DeepSeek-V4 model tensor-parallel over gloo ranks on CPU: eager vs fxsplit
with emulated capture (runner v2, the same input tensors every step, as an engine feeds a
captured model).

Each rank times ``--steps`` decode steps per batch size for both variants, after warm-up and
capture; per batch the slower rank's time counts (a tensor-parallel step ends when every rank
has finished). The emulator replays recorded aten ops and re-issues the collectives, so this
measures fxsplit's host overhead around the same work, not a CUDA-graph speed-up.

Usage: python bench/tp_decode.py [--tp 2] [--batches 1 4 8] [--steps 30] [--layers 2]
"""

from __future__ import annotations

import argparse
import time

import torch

import fxsplit
from fxsplit.models import deepseek_v4
from fxsplit.tools.tp_demo import spawn


def _ms_per_step(fn, inputs, steps: int) -> float:
    """Milliseconds per call of ``fn(*inputs)``, after 3 untimed calls (warm-up, capture)."""
    import torch.distributed as dist

    for _ in range(3):
        fn(*inputs)
    dist.barrier()  # every rank starts timing together
    start = time.perf_counter()
    for _ in range(steps):
        fn(*inputs)
    return (time.perf_counter() - start) / steps * 1e3


def measure(rank: int, world_size: int, batches, steps: int, layers: int) -> dict:
    """One rank (run by :func:`fxsplit.tools.tp_demo.spawn`): ``{variant: {batch: ms}}``."""
    import torch.distributed as dist

    config = deepseek_v4.DeepseekV4Config(num_layers=layers)
    base = deepseek_v4.build(config, group=dist.group.WORLD)
    variants = {
        "eager": lambda m: m,
        "fxsplit": lambda m: torch.compile(
            m, backend=fxsplit.Backend(runner="v2", capture="emulate"), dynamic=False
        ),
    }
    results: dict[str, dict[int, float]] = {}
    with torch.no_grad():
        for name, make in variants.items():
            torch._dynamo.reset()
            model = make(deepseek_v4.clone_model(base))
            results[name] = {}
            for batch in batches:
                feed = deepseek_v4.DecodeRunner(config, max(batches), persistent=True)
                for _ in range(3):  # sequences of a few tokens
                    feed.step(batch)
                results[name][batch] = _ms_per_step(model, feed.step(batch), steps)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    ranks = spawn(measure, args.tp, args.batches, args.steps, args.layers, timeout_s=600)
    errors = [r for r in ranks if isinstance(r, str)]
    if errors:
        raise SystemExit("\n".join(errors))
    print(
        f"cpu, gloo, tp={args.tp}, torch {torch.__version__}, {args.layers} layers, "
        f"ms per decode step (slowest rank)"
    )
    print(f"{'batch':>5} {'eager':>10} {'fxsplit':>10} {'fxsplit/eager':>14}")
    for batch in args.batches:
        eager = max(r["eager"][batch] for r in ranks)
        split = max(r["fxsplit"][batch] for r in ranks)
        print(f"{batch:5d} {eager:10.3f} {split:10.3f} {split / eager:14.2f}")


if __name__ == "__main__":
    main()
