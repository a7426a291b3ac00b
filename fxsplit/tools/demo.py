"""``fxsplit demo``: the main job, end to end on CPU (capture emulated) or CUDA (captured).

1. The serving-style DeepSeek-V4 model (:mod:`fxsplit.models.deepseek_v4`) compiled with
   ``backend="fxsplit"`` under runners v1 and v2, decoding with changing batch sizes and per-step
   metadata; prints each plan and, per step, the max abs difference against eager and the
   captures, replays and input copies of that step.
2. Why v1 wants the wide eager region: under v1 (fresh metadata tensors each step) the narrow plan
   (attention input preparation captured) is correct only because ``input_binding="copy"``
   copies the metadata into static buffers every step; the wide plan copies no metadata.
3. Hugging Face transformers' own ``DeepseekV4ForCausalLM`` (tiny config, random weights),
   marked by nothing but fxsplit's built-in presets (:mod:`fxsplit.presets`: its indexer is
   ``sparse_indexer``, its rotary embeddings ``attn_prep``, so the v1 and v2 plans differ) under
   both runners, capture emulated (or CUDA), captured pieces on both sides of the indexer;
   prefill logits against eager for several sequence lengths. Skipped, with the install
   command, where transformers is missing.

``fxsplit demo --model <Architecture>`` runs instead one transformers architecture of
:mod:`fxsplit.models.hf_architectures` (tiny config, prefill and decode steps with a KV cache)
under its default runner and the other one, and compares every step's logits with eager.

Tables fold long cells instead of cutting them, so the output reads at 80 columns.

Every comparison must match exactly (the split and the replay change no number); the exit
status is 1 if one does not.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

import fxsplit
from fxsplit.models import deepseek_v4, hf_architectures, hf_deepseek_v4
from fxsplit.tools import coverage
from fxsplit.tools.dump import graph_title, plan_table

STEPS = (4, 4, 3, 4, 5, 3, 2, 4, 6, 4)
PREFILL_LENGTHS = (5, 8, 13)
METADATA = ("positions", "slot_mapping", "block_table", "seq_lens")


def _capture_mode() -> tuple[str, str]:
    return ("cuda", "cuda") if torch.cuda.is_available() else ("emulate", "cpu")


# Inductor fuses and reorders fp32 reductions, and CUDA may pick other kernels than eager.
COMPILED_TOLERANCE = 1e-4


def _compiles(compile_pieces: str, device: str) -> bool:
    return compile_pieces == "inductor" or (compile_pieces == "auto" and device == "cuda")


def _close(diff: float, device: str, compiled: bool) -> bool:
    # Bitwise where pieces run the graph's own ops on the CPU.
    exact = device == "cpu" and not compiled
    return diff == 0.0 if exact else diff <= COMPILED_TOLERANCE


def _equal(got: torch.Tensor, want: torch.Tensor, compiled: bool) -> tuple[bool, float]:
    diff = (got.float() - want.float()).abs().max().item()
    return _close(diff, got.device.type, compiled), diff


def _metadata_copies(backend: fxsplit.Backend) -> int:
    return sum(
        n
        for runtime in backend.runtimes
        for piece in runtime.pieces
        for name, n in piece.stats.copies_by_input.items()
        if any(m in name for m in METADATA)
    )


def _decode(runner: str, compile_pieces: str, eager_regions=None, steps=STEPS):
    """Compile and decode; returns the backend and (batch, ok, diff, counter deltas) per step."""
    mode, device = _capture_mode()
    torch._dynamo.reset()
    persistent = fxsplit.runners.get(runner).persistent_inputs
    model = deepseek_v4.build().to(device)
    reference = deepseek_v4.clone_model(model)
    options = {"runner": runner, "capture": mode, "compile_pieces": compile_pieces}
    if eager_regions is not None:
        options["eager_regions"] = eager_regions
    backend = fxsplit.Backend(**options)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    feed = deepseek_v4.DecodeRunner(model.config, max(steps), persistent=persistent, device=device)
    feed_ref = deepseek_v4.DecodeRunner(
        model.config, max(steps), persistent=persistent, device=device
    )
    rows = []
    with torch.no_grad():
        for batch in steps:
            before = fxsplit.counters.snapshot()
            got = compiled(*feed.step(batch))
            after = fxsplit.counters.snapshot()
            want = reference(*feed_ref.step(batch))
            ok, diff = _equal(got, want, _compiles(compile_pieces, device))
            rows.append((batch, ok, diff, {k: after[k] - before[k] for k in after}))
    return backend, rows


def _deepseek(console: Console, runner: str, compile_pieces: str) -> bool:
    persistent = fxsplit.runners.get(runner).persistent_inputs
    metadata = "persistent buffers" if persistent else "fresh tensors each step"
    table = Table(title=f"DeepSeek-V4 decode, runner {runner} (metadata: {metadata})")
    columns = ("step", "batch", "max diff", "captures", "replays", "uncaptured", "input copies")
    for column in columns:
        table.add_column(column, justify="right", overflow="fold")
    table.add_column("ok")
    ok = True
    backend, rows = _decode(runner, compile_pieces)
    for step, (batch, good, diff, delta) in enumerate(rows):
        ok &= good
        table.add_row(
            str(step),
            str(batch),
            f"{diff:.3g}",
            str(delta["captures"]),
            str(delta["replays"]),
            str(delta["uncaptured_runs"]),
            str(delta["input_copies"]),
            "yes" if good else "NO",
        )
    for plan in backend.plans:
        console.print(plan_table(plan, f"DeepSeek-V4 {graph_title(plan)}"))
    console.print(table)
    return ok


def _narrow_vs_wide(console: Console, compile_pieces: str) -> bool:
    table = Table(title="Runner v1 (fresh metadata each step): why the wide eager region")
    for column in ("plan", "eager regions", "equal to eager", "metadata copies", "input copies"):
        table.add_column(column, overflow="fold")
    ok = True
    rows = (("wide (default)", None), ("narrow (prep captured)", ["sparse_indexer", "attention"]))
    for label, regions in rows:
        good, copies = True, 0
        backend, rows = _decode("v1", compile_pieces, regions)
        for _, step_ok, _, delta in rows:
            good &= step_ok
            copies += delta["input_copies"]
        meta = _metadata_copies(backend)
        ok &= good and (meta == 0) == (regions is None)
        names = ", ".join(sorted(backend.plans[0].eager_regions))
        table.add_row(label, names, "yes" if good else "NO", str(meta), str(copies))
    console.print(table)
    return ok


def _hf(console: Console, runner: str, compile_pieces: str) -> bool:
    mode, device = _capture_mode()
    table = Table(title=f"transformers DeepseekV4ForCausalLM prefill, runner {runner}, {mode}")
    for column in ("seq_len", "pieces captured/eager", "max diff", "replays", "ok"):
        table.add_column(column, justify="right", overflow="fold")
    ok = True
    for seq_len in PREFILL_LENGTHS:
        torch._dynamo.reset()
        model, args = hf_deepseek_v4.example(seq_len=seq_len)
        model = model.to(device)
        args = tuple(a.to(device) for a in args)
        # transformers marks no region: the built-in presets find the indexer and the rotary
        # embeddings (attention input preparation: eager under v1, captured under v2).
        backend = fxsplit.Backend(
            runner=runner, capture=mode, warmup_runs=0, compile_pieces=compile_pieces
        )
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            want = model(*args)
            compiled(*args)  # captures
            before = fxsplit.counters.snapshot()["replays"]
            got = compiled(*args)  # replays
            replays = fxsplit.counters.snapshot()["replays"] - before
        good, diff = _equal(got, want, _compiles(compile_pieces, device))
        pieces = backend.plans[0].pieces
        sides = [p.kind for p in pieces]
        indexer = next(i for i, p in enumerate(pieces) if "sparse_indexer" in p.regions)
        good &= "captured" in sides[:indexer] and "captured" in sides[indexer + 1 :]
        ok &= good and replays > 0
        counts = f"{sides.count('captured')}/{sides.count('eager')}"
        table.add_row(str(seq_len), counts, f"{diff:.3g}", str(replays), "yes" if good else "NO")
    for plan in backend.plans:  # the plans of the longest prefill
        console.print(plan_table(plan, f"transformers DeepseekV4ForCausalLM {graph_title(plan)}"))
    console.print(table)
    return ok


def _model(console: Console, architecture: str, compile_pieces: str) -> bool:
    """One transformers architecture under its default runner and the other one."""
    mode, device = _capture_mode()
    listed = hf_architectures.ARCHITECTURES[architecture].stands_for or architecture
    first = fxsplit.runners.default_runner(listed)
    table = Table(title=f"{architecture}: prefill + decode with a KV cache, {mode}")
    columns = ("runner", "step", "tokens", "max diff", "captures", "replays", "uncaptured", "ok")
    for column in columns:
        table.add_column(column, justify="right", overflow="fold")
    ok = True
    for runner in (first, "v2" if first == "v1" else "v1"):
        result = coverage.check(
            architecture, runner, capture=mode, device=device, compile_pieces=compile_pieces
        )
        for plan in result.plans:
            console.print(plan_table(plan, f"{architecture} {graph_title(plan)}"))
        for step, (diff, counts) in enumerate(zip(result.diffs, result.steps, strict=True)):
            good = _close(diff, device, _compiles(compile_pieces, device))
            ok &= good
            tokens = hf_architectures.PREFILL_LEN if step == 0 else 1
            label = "prefill" if step == 0 else f"decode {step}"
            calls = (counts.captures, counts.replays, counts.uncaptured_runs)
            cells = (f"{diff:.3g}", *map(str, calls), "yes" if good else "NO")
            table.add_row(runner, label, str(tokens), *cells)
    console.print(table)
    return ok


def run(model: str | None = None, compile_pieces: str = "auto") -> int:
    """Run the demo, or with ``model`` (an architecture name of
    :mod:`fxsplit.models.hf_architectures`) that architecture only; returns the process exit
    status (0 when every comparison matched). ``compile_pieces`` is the option of that name
    (``"inductor"`` compiles the captured pieces; comparisons then allow
    :data:`COMPILED_TOLERANCE`).

    Raises:
        ValueError: an unknown architecture (the message lists the known ones).
        ImportError: ``model`` given and transformers missing or lacking it.
    """
    console = Console()
    mode, device = _capture_mode()
    pieces = "Inductor" if _compiles(compile_pieces, device) else "generated Python"
    console.print(f"capture: {mode} on {device}; pieces: {pieces}; torch {torch.__version__}")
    if model is not None:
        ok = _model(console, model, compile_pieces)
        console.print("[green]all comparisons passed[/]" if ok else "[red]a comparison FAILED[/]")
        return 0 if ok else 1
    console.print(
        "Per step: captures and replays of captured pieces, uncaptured runs (warm-up, sizes "
        "first seen), input copies (values copied into fxsplit's static buffers).",
        highlight=False,
    )
    ok = True
    for runner in ("v1", "v2"):
        ok &= _deepseek(console, runner, compile_pieces)
    ok &= _narrow_vs_wide(console, compile_pieces)
    if hf_deepseek_v4.available():
        for runner in ("v1", "v2"):
            ok &= _hf(console, runner, compile_pieces)
    else:
        console.print(
            "skipped the transformers section: it needs transformers >= 5.8.1 with "
            "DeepseekV4ForCausalLM (pip install 'transformers>=5.8.1')"
        )
    console.print("[green]all comparisons passed[/]" if ok else "[red]a comparison FAILED[/]")
    return 0 if ok else 1
