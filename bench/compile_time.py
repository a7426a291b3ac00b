"""Time to first output of the DeepSeek-V4 reference model under each backend, by depth.

Every measurement runs in a fresh Python process (this script, ``--child`` mode), so no
in-process cache (Dynamo's, Inductor's, fxsplit's) carries over. A child builds the model with
``--layers`` decoder layers on CPU, then times, under ``torch.no_grad()``, from before
``torch.compile(model, ..., dynamic=True)`` (or before loading a precompiled model) to the
first output returned, then times a second call on the same inputs (a precompiled graph's
compiled pieces load at their second call: what the first call did not pay shows there), and
reads fxsplit's counters after it. Variants:

- ``eager``: ``backend="eager"`` (Dynamo's trace, no compiler): the baseline.
- ``fxsplit-eager``: fxsplit, pieces as generated Python (``compile_pieces="eager"``).
- ``fxsplit-cold``: fxsplit with Inductor pieces, an empty fxsplit ``cache_dir`` and an empty
  Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a fresh folder).
- ``fxsplit-warm``: the same, in a new process, with the cold run's two cache folders and no
  precompiled model: Dynamo traces, fxsplit splits and loads every piece from its cache.
- ``fxsplit-precompile``: ``torch.compile(model.forward, backend="fxsplit", fullgraph=True)
  .aot_compile(...)`` on the warm caches, saved to a file (PyTorch's precompile; the time
  includes the save).
- ``fxsplit-load``: a new process loads that file (``torch.compiler.load_compiled_function``)
  and runs it: no trace, no compile.
- ``inductor``: ``backend="inductor"`` with an empty Inductor cache.

fxsplit runs with ``capture="emulate"`` and runner v2. With ``--repeat N`` each variant runs N
times (fresh caches each time) and the fastest counts: the eager baseline is noisy on a shared
machine. Compile cost = a variant's time to first output minus ``eager``'s at the same depth.
Prints one table and checks the targets: fxsplit cold compile cost at the deepest depth <= 1.3x
its cost at the shallowest; fxsplit cold time to first output at the deepest depth <= 0.3x
``inductor``'s; a warm start (``fxsplit-load``) at most 1.1x ``eager``'s time to first output
at every depth (``fxsplit-warm`` shown beside it).

Usage: python bench/compile_time.py [--layers 1 4 16] [--variants ...] [--repeat 1]
       [--timeout 900] [--json out.json] [--phases]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

VARIANTS = (
    "eager",
    "fxsplit-eager",
    "fxsplit-cold",
    "fxsplit-warm",
    "fxsplit-precompile",
    "fxsplit-load",
    "inductor",
)
# Variants sharing the cold run's caches (and the precompiled file), in this order.
SHARED = ("fxsplit-cold", "fxsplit-warm", "fxsplit-precompile", "fxsplit-load")
BATCH = 4


# (module, attribute, label) of the steps --phases times, in the order they run.
PHASES = (
    ("torch.fx._graph_pickler", "GraphPickler.loads", "graph unpickled"),
    ("fxsplit.backend", "split", "split"),
    ("fxsplit.passes.piece_key", "key", "piece keys"),
    ("torch._inductor.standalone_compile", "CompiledArtifact.load", "artifacts loaded"),
    ("torch._inductor", "standalone_compile", "Inductor compiles"),
)


def _time_phases() -> dict[str, float]:
    """Wrap the steps of :data:`PHASES` to add up their seconds into the returned dict."""
    import functools
    import importlib

    seconds: dict[str, float] = {}
    for module_name, path, label in PHASES:
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, _original=original, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_label] = seconds.get(_label, 0.0) + time.perf_counter() - start

        setattr(owner, name, staticmethod(timed) if parents else timed)
    return seconds


def child(variant: str, layers: int, cache_dir: str, phases: bool = False) -> dict:
    """Compile and run one step in this process; returns the figures as a dict."""
    import torch

    import fxsplit
    import fxsplit.backend
    from fxsplit.models import deepseek_v4

    timed = _time_phases() if phases else {}

    config = deepseek_v4.DeepseekV4Config(num_layers=layers)
    model = deepseek_v4.build(config)
    runner = deepseek_v4.DecodeRunner(config, BATCH, persistent=True)
    inputs = runner.step(BATCH)
    options = {
        "runner": "v2",
        "capture": "emulate",
        "compile_pieces": "eager" if variant == "fxsplit-eager" else "inductor",
        "cache_dir": cache_dir,
    }
    precompiled = os.path.join(cache_dir, "deepseek_v4.pt2")
    with torch.no_grad():
        start = time.perf_counter()
        if variant in ("eager", "inductor"):
            run = torch.compile(model, backend=variant, dynamic=True)
        elif variant == "fxsplit-precompile":
            forward = torch.compile(
                model.forward, backend="fxsplit", fullgraph=True, dynamic=True, options=options
            )
            compiled = forward.aot_compile((tuple(inputs), {}))
            compiled.save_compiled_function(precompiled)
            run = functools.partial(compiled, model)
        elif variant == "fxsplit-load":
            with open(precompiled, "rb") as f:
                compiled = torch.compiler.load_compiled_function(f, f_globals=vars(deepseek_v4))
            run = functools.partial(compiled, model)
        else:
            run = torch.compile(model, backend="fxsplit", dynamic=True, options=options)
        run(*inputs)
        seconds = time.perf_counter() - start
        # A precompiled graph's pieces load at their second call (fxsplit.passes.inductor:
        # Deferred): the second call shows what the first one left.
        start = time.perf_counter()
        run(*inputs)
        second = time.perf_counter() - start
    counts = fxsplit.counters.snapshot()
    # What became of each distinct captured piece: compiled, loaded ("disk"), or kept as
    # generated Python ("eager", e.g. Inductor failed on it).
    outcomes = Counter(
        record.outcome
        for split in fxsplit.backend.fxsplit_backend.compiled
        for record in split.compiled_pieces or ()
    )
    return {
        "variant": variant,
        "layers": layers,
        "seconds": seconds,
        "second": second,
        "pieces_compiled": counts["pieces_compiled"],
        "piece_cache_hits": counts["piece_cache_hits"],
        "captured_pieces": counts["captured_pieces"],
        "outcomes": dict(outcomes),
        "torch": torch.__version__,
        "phases": {k: round(v, 2) for k, v in timed.items()},
    }


def _spawn(
    variant: str, layers: int, cache_dir: str, inductor_dir: str, timeout: float, phases: bool
) -> dict:
    """Run one child; its figures, or ``{"error": ...}`` when it failed or ran over."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir)
    command = [sys.executable, __file__, "--child", variant, "--layers", str(layers)]
    command += ["--phases"] if phases else []
    command += ["--cache-dir", cache_dir]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def measure(
    depths: list[int], variants, repeat: int, timeout: float, scratch: str, phases: bool = False
) -> dict:
    """``{depth: {variant: figures}}``: per variant the figures of its fastest of ``repeat``
    child processes (each repeat runs every variant once, in turn, so load that changes
    during the run weighs on all of them), with every run's seconds under ``"runs"``."""
    results: dict[int, dict[str, dict]] = {}
    for layers in depths:
        row: dict[str, dict] = {}
        for _ in range(repeat):
            # Fresh fxsplit and Inductor caches per repeat, shared by cold and warm only.
            shared = (
                tempfile.mkdtemp(prefix=f"fxsplit-{layers}-", dir=scratch),
                tempfile.mkdtemp(prefix=f"inductor-{layers}-", dir=scratch),
            )
            for variant in variants:
                if variant in SHARED:
                    dirs = shared
                else:
                    dirs = (
                        tempfile.mkdtemp(prefix="fxsplit-", dir=scratch),
                        tempfile.mkdtemp(prefix="inductor-", dir=scratch),
                    )
                figures = _spawn(variant, layers, *dirs, timeout, phases)
                print(f"  {layers:2d} layers {variant:18s} {_cell(figures)}", flush=True)
                best = row.get(variant)
                runs = [*(best or {}).get("runs", []), figures.get("seconds")]
                if best is None or figures.get("seconds", float("inf")) < best.get(
                    "seconds", float("inf")
                ):
                    best = figures
                row[variant] = {**best, "runs": runs}
        results[layers] = row
    return results


def _cell(figures: dict) -> str:
    if "error" in figures:
        return figures["error"]
    return f"{figures['seconds']:.2f} s"


def _cost(results: dict, layers: int, variant: str) -> float | None:
    """Compile cost: time to first output minus ``eager``'s at the same depth."""
    row = results[layers]
    if "seconds" not in row.get(variant, {}) or "seconds" not in row.get("eager", {}):
        return None
    return row[variant]["seconds"] - row["eager"]["seconds"]


def report(results: dict) -> list[str]:
    """The table and the target lines."""
    lines = [
        "time to first output (s) / compile cost = minus eager's (s) / the second call (s), "
        "pieces compiled+loaded after it"
    ]
    lines.append(f"{'layers':>6} {'variant':18s} {'first out':>9} {'cost':>7} {'2nd':>5}  pieces")
    for layers, row in results.items():
        for variant in VARIANTS:
            figures = row.get(variant)
            if figures is None:
                continue
            if "error" in figures:
                lines.append(f"{layers:6d} {variant:18s} {figures['error']}")
                continue
            cost = _cost(results, layers, variant)
            pieces = ""
            if variant in SHARED:
                pieces = f"{figures['pieces_compiled']} compiled, "
                pieces += f"{figures['piece_cache_hits']} loaded; distinct pieces: "
                pieces += ", ".join(f"{n} {k}" for k, n in sorted(figures["outcomes"].items()))
            runs = [f"{t:.1f}" for t in figures.get("runs", []) if t is not None]
            if len(runs) > 1:
                pieces += f" (runs: {', '.join(runs)} s)"
            cost_text = "      -" if cost is None else f"{cost:7.2f}"
            lines.append(
                f"{layers:6d} {variant:18s} {figures['seconds']:9.2f} {cost_text} "
                f"{figures['second']:5.2f}  {pieces}"
            )
    for layers, row in results.items():
        for variant, figures in row.items():
            if figures.get("phases"):
                steps = ", ".join(f"{k} {v:.2f}" for k, v in figures["phases"].items())
                lines.append(f"steps (s), {layers} layers {variant}: {steps}")
    lines += targets(results)
    return lines


def targets(results: dict) -> list[str]:
    """One line per target: the figures and whether it is met."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = []
    low, high = min(results), max(results)
    cold_low, cold_high = _cost(results, low, "fxsplit-cold"), _cost(results, high, "fxsplit-cold")
    if cold_low is not None and cold_high is not None and low != high:
        ratio = cold_high / cold_low if cold_low > 0 else float("inf")
        lines.append(
            f"target: fxsplit cold compile cost at {high} layers <= 1.3x at {low}: "
            f"{cold_high:.2f} s / {cold_low:.2f} s = {ratio:.2f}x, {verdict(ratio <= 1.3)}"
        )
    cold, full = results[high].get("fxsplit-cold", {}), results[high].get("inductor", {})
    if "seconds" in cold and "seconds" in full:
        ratio = cold["seconds"] / full["seconds"]
        lines.append(
            f"target: fxsplit cold first output at {high} layers <= 0.3x backend=inductor's: "
            f"{cold['seconds']:.2f} s / {full['seconds']:.2f} s = {ratio:.2f}x, "
            f"{verdict(ratio <= 0.3)}"
        )
    for layers, row in results.items():
        eager = row.get("eager", {}).get("seconds")
        if eager is None:
            continue
        shown = []
        for variant in ("fxsplit-load", "fxsplit-warm"):
            if "seconds" in row.get(variant, {}):
                shown.append(f"{variant} {row[variant]['seconds'] / eager:.2f}x")
        if "seconds" in row.get("fxsplit-load", {}):
            ratio = row["fxsplit-load"]["seconds"] / eager
            load = row["fxsplit-load"]
            both = (load["seconds"] + load["second"]) / (eager + row["eager"]["second"])
            lines.append(
                f"target: warm start (fxsplit-load) at {layers} layers <= 1.1x eager's first "
                f"output ({eager:.2f} s): {', '.join(shown)}, {verdict(ratio <= 1.1)} "
                f"({load['pieces_compiled']} pieces compiled; first two outputs {both:.2f}x "
                "eager's)"
            )
        elif shown:
            lines.append(f"warm start at {layers} layers vs eager's first output: {shown[0]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per variant; the fastest counts"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument(
        "--phases", action="store_true", help="also time the steps of each run (see PHASES)"
    )
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers[0], args.cache_dir, args.phases)))
        return
    for variant in SHARED[1:]:
        if variant in args.variants and "fxsplit-cold" not in args.variants:
            parser.error(f"{variant} needs fxsplit-cold (it starts from the cold run's caches)")
    if "fxsplit-load" in args.variants and "fxsplit-precompile" not in args.variants:
        parser.error("fxsplit-load needs fxsplit-precompile (it loads what that saved)")
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="fxsplit-compile-time-") as scratch:
        variants = [v for v in VARIANTS if v in args.variants]
        results = measure(args.layers, variants, args.repeat, args.timeout, scratch, args.phases)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} (1 min), {load[2]:.2f} (15 min)")
    if args.json:  # before the report, so a long run's figures survive any mistake in it
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=2)
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()
