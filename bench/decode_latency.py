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

Each (variant, batch) part gets the variant's own model copy, a fresh Dynamo (so a part compiles
what it runs) and a persistent-buffer runner ("v2": the same input tensors every step, as an
engine feeds a captured model), is warmed up (and captured), then timed over ``--steps`` decode
steps. Parts run batch by batch, smallest first, every variant at one batch before the next
batch, so the targets (read at the smallest batch) are measured first. Each part prints its line
as soon as it is measured, so a run cut short keeps what it measured.

Time: ``--budget S`` is the whole run's, counted from the process start (imports included): the
last 10 s are kept for the table and JSON, each part runs at most ``--part-timeout`` seconds cut
to what is left of the rest (SIGALRM, never while a CUDA graph is being captured), and no part
starts with under 5 s left. A part over its limit (say, a cold Inductor compile that does not
fit) is reported and the variant's later batches still run; a part that fails is reported and
the variant's later batches are skipped (the failure would repeat). SIGINT or SIGTERM ends the
run early with the rest reported as not measured. Whatever happens, it prints a table, the ratios of
the fxsplit variants, and the GPU targets (fxsplit with Inductor pieces >= 3x eager and within
10 % of the whole-model CUDA graph at the smallest batch), and writes JSON. ``--dry-run`` prints
the plan in its worst case (every part running to its limit) and checks that it ends within the
budget, measuring nothing.

Usage: python bench/decode_latency.py [--device cuda] [--batches 1 8 32] [--steps 50]
       [--layers 4] [--variants ...] [--part-timeout 120] [--budget S] [--dry-run]
       [--cache-dir D] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import textwrap
import time
from collections.abc import Callable

STARTED = time.monotonic()  # the budget counts from here: torch's import is in it

import torch  # noqa: E402

import fxsplit  # noqa: E402
from fxsplit.models import deepseek_v4  # noqa: E402

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


RESERVE = 10.0  # seconds at the end of a budget kept for the table and JSON
MIN_PART = 5.0  # no part starts with less time than this left


class PartTimeout(BaseException):
    """A (variant, batch) part ran over its time limit. A BaseException, as KeyboardInterrupt
    is: the code it interrupts (Dynamo, fxsplit's capture) must not take it for an error of its
    own, wrap it, or carry on without the part's capture."""


@dataclasses.dataclass
class Budget:
    """The time of a run: ``total`` seconds counted from ``start`` (a ``clock()`` reading at the
    process start, so imports count), of which the last ``reserve`` seconds are kept for the
    table and JSON. Each part runs at most ``part_timeout`` seconds, cut to what is left before
    the reserve; none starts with under ``min(MIN_PART, part_timeout)`` seconds left.
    ``total=None``: no budget, every part gets ``part_timeout``. Seconds throughout.
    """

    part_timeout: float
    total: float | None = None
    start: float = STARTED
    reserve: float = RESERVE
    clock: Callable[[], float] = time.monotonic

    def elapsed(self) -> float:
        """Seconds since ``start``."""
        return self.clock() - self.start

    def limit(self) -> float | None:
        """Seconds the next part may run, or None when it must not start."""
        if self.total is None:
            return self.part_timeout
        left = self.total - self.reserve - self.elapsed()
        if left < min(MIN_PART, self.part_timeout):
            return None
        return min(self.part_timeout, left)


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise PartTimeout in the block after ``seconds`` (SIGALRM). Never inside a CUDA graph
    capture (an exception there would leave the stream capturing and every later part failing)
    nor inside an import (a module left half-initialised fails every later import of it, as
    networkx's registry does): the alarm waits for either to end (checked every 0.1 s)."""

    def expire(signum, frame):
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing or _importing(frame):
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            return
        raise PartTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import statement's machinery."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _timed_out(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was raised from, a PartTimeout (a library that turns it into an
    error of its own keeps it as the cause)."""
    while error is not None:
        if isinstance(error, PartTimeout):
            return True
        error = error.__cause__ or error.__context__
    return False


def plan(variants, batches, device: str) -> list[tuple[str, int]]:
    """The (variant, batch) parts in the order they run: every variant at the smallest batch
    (where the targets are read), then every variant at the next batch, and so on. Variants
    needing CUDA are left out on other devices."""
    names = [n for n in variants if device == "cuda" or n not in CUDA_ONLY]
    return [(name, batch) for batch in sorted(batches) for name in names]


def run_parts(
    parts: list[tuple[str, int]], budget: Budget, run_part: Callable[[str, int, float], float]
) -> tuple[dict[str, dict[int, float | None]], list[str]]:
    """Run ``parts`` in order under ``budget``; ``run_part(variant, batch, seconds)`` returns
    milliseconds per step and raises PartTimeout (or an error raised from one) when it runs
    over ``seconds``.

    A part over its limit is reported and the variant's later batches still run; a part that
    fails otherwise is reported and the variant's later parts are skipped; a part the budget
    has no time left for is skipped. KeyboardInterrupt (SIGINT, or SIGTERM turned into it by
    :func:`main`) ends the run: the parts not measured yet are reported with the stop.

    Returns:
        ``{variant: {batch: ms per step, or None where not measured}}`` and one line per part
        not measured, with its reason, in run order.
    """
    results: dict[str, dict[int, float | None]] = {}
    for name, batch in parts:
        results.setdefault(name, {})[batch] = None
    notes: dict[tuple[str, int], str] = {}
    failed: dict[str, str] = {}
    try:
        for name, batch in parts:
            reason = failed.get(name)
            seconds = budget.limit() if reason is None else None
            if reason is None and seconds is None:
                reason = f"over the {budget.total:g} s budget at {budget.elapsed():.0f} s"
            if reason is not None:
                notes[name, batch] = f"{name} batch {batch}: skipped ({reason})"
                continue
            try:
                ms = run_part(name, batch, seconds)
            except (PartTimeout, Exception) as error:  # reported; the other parts still run
                if _timed_out(error):
                    notes[name, batch] = (
                        f"{name} batch {batch}: ran over its {round(seconds, 1):g} s limit"
                    )
                else:
                    first = next(iter(str(error).splitlines()), "")
                    failed[name] = f"after batch {batch} failed"
                    notes[name, batch] = (
                        f"{name} batch {batch} failed: {type(error).__name__}: {first}"
                    )
                continue
            results[name][batch] = ms
            print(f"  {name} batch {batch}: {ms:.3f} ms", flush=True)
    except KeyboardInterrupt:
        stop = f"the run stopped by SIGINT or SIGTERM at {budget.elapsed():.0f} s"
        for name, batch in parts:
            if results[name][batch] is None and (name, batch) not in notes:
                notes[name, batch] = f"{name} batch {batch}: not measured ({stop})"
    return results, [notes[part] for part in parts if part in notes]


def dry_run(parts: list[tuple[str, int]], budget: Budget) -> tuple[list[str], bool]:
    """The plan of ``parts`` under ``budget`` in its worst case, every part running to its limit,
    on a simulated clock from ``budget.elapsed()`` now. Returns the plan's lines and whether the
    table and JSON are written within the budget."""
    start = now = budget.elapsed()
    simulated = dataclasses.replace(budget, start=0.0, clock=lambda: now)
    lines = []
    started = set()

    def run_to_the_limit(name: str, batch: int, seconds: float) -> float:
        nonlocal now
        lines.append(f"  {now:5.0f} - {now + seconds:3.0f} s  {name} batch {batch}")
        started.add((name, batch))
        now += seconds
        raise PartTimeout

    run_parts(parts, simulated, run_to_the_limit)
    rest = [f"{name} batch {batch}" for name, batch in parts if (name, batch) not in started]
    if rest:
        lines += textwrap.wrap(
            ", ".join(rest), 96, initial_indent="  not started: ", subsequent_indent="    "
        )
    end = f"parts end by {now:.0f} s"
    if budget.total is None:
        head = f"{len(parts)} parts, at most {budget.part_timeout:g} s each, no budget"
        fits = True
    else:
        head = (
            f"{len(parts)} parts, at most {budget.part_timeout:g} s each; budget "
            f"{budget.total:g} s from the process start\n(the last {budget.reserve:g} s kept for "
            f"the table and JSON)"
        )
        fits = now + budget.reserve <= budget.total
        end += (
            f", the table and JSON by {now + budget.reserve:.0f} s "
            f"{'<=' if fits else '>'} {budget.total:g} s: {'fits' if fits else 'OVER the budget'}"
        )
    when = f"from {start:.0f} s (the time so far)"
    return [head, f"worst case, every part running to its limit, {when}:", *lines, end], fits


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
    budget: Budget,
    variants=VARIANTS,
    cache_dir: str | None = None,
) -> dict:
    """Time every part of :func:`plan` under ``budget`` (see :func:`run_parts`). Returns
    ``{"ms_per_step": {variant: {batch: ms per step, or None where not measured}}, "skipped":
    [reason per part not measured], "elapsed_s": seconds from the process start}`` plus the
    run's details."""
    config = deepseek_v4.DeepseekV4Config(num_layers=layers)
    models: dict[str, torch.nn.Module] = {}

    def run_part(name: str, batch: int, seconds: float) -> float:
        with _time_limit(seconds):
            if not models:  # built inside the first part's limit
                models["base"] = deepseek_v4.build(config).to(device)
            if name not in models:
                models[name] = deepseek_v4.clone_model(models["base"])
            torch._dynamo.reset()  # one graph per batch (dynamic=False) either way
            feed = deepseek_v4.DecodeRunner(config, max(batches), persistent=True, device=device)
            for _ in range(3):  # sequences of a few tokens
                feed.step(batch)
            inputs = feed.step(batch)
            fn = _compiled(name, models[name], device, cache_dir)
            timed = fn if fn is not None else _whole_graph(models[name], inputs)
            return _time_steps(timed, inputs, steps, device)

    with torch.no_grad():
        results, skipped = run_parts(plan(variants, batches, device), budget, run_part)
    return {
        "skipped": skipped,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": layers,
        "steps": steps,
        "budget_s": budget.total,
        "part_timeout_s": budget.part_timeout,
        "elapsed_s": round(budget.elapsed(), 1),
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
        row = " ".join("not measured".rjust(16) if c is None else f"{c:16.3f}" for c in cells)
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
    lines += [f"not measured: {line}" for line in result["skipped"]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--part-timeout", type=float, default=120, help="seconds per part")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole run from the process start, the last {RESERVE:g} for the "
        "table and JSON",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the worst-case plan, measure nothing"
    )
    parser.add_argument("--cache-dir", default=None, help="fxsplit's compiled-piece cache")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.part_timeout <= 0:
        parser.error(f"--part-timeout {args.part_timeout:g}: must be over 0 seconds")
    if args.budget is not None and args.budget <= RESERVE:
        parser.error(
            f"--budget {args.budget:g}: must be over the {RESERVE:g} s kept for the table and JSON"
        )
    budget = Budget(args.part_timeout, args.budget)
    if args.dry_run:
        lines, fits = dry_run(plan(args.variants, args.batches, args.device), budget)
        print("\n".join(lines))
        raise SystemExit(0 if fits else 1)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA or ROCm device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    # SIGTERM ends the run as SIGINT does: what was measured is still written.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = measure(
        args.device,
        args.batches,
        args.steps,
        args.layers,
        budget,
        args.variants,
        args.cache_dir,
    )
    for stop in (signal.SIGINT, signal.SIGTERM):  # the table and JSON are written whole
        signal.signal(stop, signal.SIG_IGN)
    print("\n".join(summary(result, args.batches)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
