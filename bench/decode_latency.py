"""Decode latency of DeepSeek-V4: eager, fxsplit, a whole-model CUDA graph, reduce-overhead.

Variants (``--variants``; those needing CUDA are left out on other devices):

- ``eager``: the model in eager PyTorch.
- ``fxsplit_eager``: fxsplit, runner v2, captured pieces as generated Python
  (``compile_pieces="eager"``).
- ``fxsplit_inductor``: the same with every distinct captured piece compiled by Inductor
  (``compile_pieces="inductor"``).
- ``cuda_graph`` (CUDA only): the whole eager model captured in one ``torch.cuda.CUDAGraph``
  per batch size on static inputs, the ceiling piecewise capture aims at. It replays the
  metadata work an engine's runner v2 keeps in persistent buffers, so it is valid here only
  because the benchmark's inputs are those buffers.
- ``reduce_overhead`` (CUDA only): ``torch.compile(mode="reduce-overhead")``, Inductor with
  whole-graph CUDA graphs.

fxsplit captures with CUDA graphs on CUDA and with the emulator on CPU (``capture="emulate"``:
there the gain is host work skipped, not kernel launches). Compiled variants use
``dynamic=False``, one graph per batch size, as ``reduce-overhead`` does.

Each variant gets its own model copy and a persistent-buffer runner ("v2": the same input
tensors every step, as an engine feeds a captured model), is warmed up (and captured), then
timed over ``--steps`` decode steps per batch size. Each (variant, batch) part prints its line
as soon as it is measured, so a run cut short keeps what it measured; a part that fails or runs
over ``--part-timeout`` seconds (SIGALRM) is reported as skipped with the reason, as are the
variant's later batches, and parts that would start after ``--budget`` seconds are skipped, so
the whole run fits a lease. Prints a table, the ratios of the fxsplit variants, and the GPU
targets (fxsplit with Inductor pieces >= 3x eager and within 10 % of the whole-model CUDA graph
at the smallest batch), and writes JSON.

Usage: python bench/decode_latency.py [--device cuda] [--batches 1 8 32] [--steps 50]
       [--layers 4] [--variants ...] [--part-timeout 120] [--budget S] [--cache-dir D]
       [--threads N] [--json out.json]
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

VARIANTS = ("eager", "fxsplit_eager", "fxsplit_inductor", "cuda_graph", "reduce_overhead")
CUDA_ONLY = ("cuda_graph", "reduce_overhead")


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


def _whole_graph(model, inputs):
    """A callable replaying one CUDA graph of ``model(*inputs)`` captured on those static
    inputs (warmed up on a side stream first, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(*inputs)
    return lambda *args: graph.replay()


def _compiled(name: str, model, device: str, cache_dir: str | None):
    """The callable timed for variant ``name``; None for ``cuda_graph``, which is captured per
    batch on that batch's inputs."""
    if name == "eager":
        return model
    if name == "cuda_graph":
        return None
    if name == "reduce_overhead":
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    backend = fxsplit.Backend(
        runner="v2",
        capture="cuda" if device == "cuda" else "emulate",
        compile_pieces="inductor" if name == "fxsplit_inductor" else "eager",
        cache_dir=cache_dir,
    )
    return torch.compile(model, backend=backend, dynamic=False)


def measure(
    device: str,
    batches,
    steps: int,
    layers: int,
    part_timeout: int = 120,
    variants=VARIANTS,
    budget: float | None = None,
    cache_dir: str | None = None,
) -> dict:
    """``{variant: {batch: ms per step, or None where skipped}}`` plus run details and the
    list of skipped parts (each with its reason)."""
    start = time.perf_counter()
    config = deepseek_v4.DeepseekV4Config(num_layers=layers)
    base = deepseek_v4.build(config).to(device)
    names = [n for n in variants if device == "cuda" or n not in CUDA_ONLY]
    results: dict[str, dict[int, float | None]] = {name: {} for name in names}
    skipped: list[str] = []
    with torch.no_grad():
        for name in names:
            torch._dynamo.reset()
            model = deepseek_v4.clone_model(base)
            fn = _compiled(name, model, device, cache_dir)
            gave_up = None
            for batch in batches:
                if budget is not None and time.perf_counter() - start > budget:
                    gave_up = gave_up or f"over the {budget:.0f} s budget"
                if gave_up:
                    results[name][batch] = None
                    skipped.append(f"{name} batch {batch}: skipped ({gave_up})")
                    continue
                feed = deepseek_v4.DecodeRunner(
                    config, max(batches), persistent=True, device=device
                )
                for _ in range(3):  # sequences of a few tokens
                    feed.step(batch)
                inputs = feed.step(batch)
                try:
                    with _time_limit(part_timeout):
                        timed = fn if fn is not None else _whole_graph(model, inputs)
                        results[name][batch] = _time_steps(timed, inputs, steps, device)
                except Exception as error:  # a failed part is reported; the others still run
                    results[name][batch] = None
                    if _timed_out(error):
                        gave_up = f"{name} batch {batch} ran over {part_timeout} s"
                    else:
                        first = next(iter(str(error).splitlines()), "")
                        gave_up = f"{name} batch {batch} failed: {type(error).__name__}: {first}"
                    skipped.append(gave_up)
                    continue
                print(f"  {name} batch {batch}: {results[name][batch]:.3f} ms", flush=True)
    return {
        "skipped": skipped,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": layers,
        "steps": steps,
        "ms_per_step": results,
    }


def _ratio(ms: dict, slower: str, faster: str, batch: int) -> float | None:
    """``ms[slower] / ms[faster]`` at ``batch`` (how many times faster), None if unmeasured."""
    a, b = ms.get(slower, {}).get(batch), ms.get(faster, {}).get(batch)
    return a / b if a and b else None


def summary(result: dict, batches) -> list[str]:
    """The table, the fxsplit ratios and the GPU target lines."""
    ms = result["ms_per_step"]
    names = list(ms)
    lines = [f"{result['device']}, torch {result['torch']}, {result['layers']} layers"]
    lines.append("ms per decode step")
    lines.append("batch " + " ".join(f"{n:>16}" for n in names))
    for batch in batches:
        cells = (ms[n][batch] for n in names)
        row = " ".join("         skipped" if c is None else f"{c:16.3f}" for c in cells)
        lines.append(f"{batch:5d} {row}")
    for batch in batches:
        ratio = _ratio(ms, "fxsplit_eager", "fxsplit_inductor", batch)
        if ratio is not None:
            lines.append(
                f"batch {batch}: fxsplit Inductor pieces {ratio:.2f}x as fast as eager pieces"
            )
    if "cuda_graph" in ms:
        low = min(batches)
        speedup = _ratio(ms, "eager", "fxsplit_inductor", low)
        if speedup is not None:
            verdict = "met" if speedup >= 3 else "NOT met"
            lines.append(
                f"target: fxsplit Inductor pieces >= 3x eager at batch {low}: {speedup:.2f}x, "
                f"{verdict}"
            )
        versus = _ratio(ms, "fxsplit_inductor", "cuda_graph", low)
        if versus is not None:
            verdict = "met" if versus <= 1.1 else "NOT met"
            lines.append(
                f"target: fxsplit Inductor pieces within 10% of the whole-model CUDA graph at "
                f"batch {low}: {versus:.2f}x its time, {verdict}"
            )
    lines += [f"skipped: {line}" for line in result["skipped"]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--part-timeout", type=int, default=120, help="seconds per part")
    parser.add_argument("--budget", type=float, default=None, help="start no part after S s")
    parser.add_argument("--cache-dir", default=None, help="fxsplit's compiled-piece cache")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(
        args.device,
        args.batches,
        args.steps,
        args.layers,
        args.part_timeout,
        args.variants,
        args.budget,
        args.cache_dir,
    )
    print("\n".join(summary(result, args.batches)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
