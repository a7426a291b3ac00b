"""``fxsplit demo``: the main job, end to end on CUDA (captured; the default where torch sees a
GPU) or on the CPU (capture emulated): ``--device`` chooses.

1. The serving-style DeepSeek-V4 model (:mod:`fxsplit.models.deepseek_v4`) compiled with
   ``backend=fxsplit.Backend(...)`` under runners v1 and v2, decoding with changing batch sizes
   and per-step metadata; prints each plan (with the step that compiled its graph) and, per
   step, the max abs difference against eager and the step's counters, then what the input
   copies copied.
2. Why v1 wants the wide eager region: under v1 (fresh metadata tensors each step) the narrow plan
   (attention input preparation captured) is correct only because ``input_binding="copy"``
   copies the metadata into static buffers every step; the wide plan copies no metadata.
3. Hugging Face transformers' own ``DeepseekV4ForCausalLM`` (tiny config, random weights),
   marked by nothing but fxsplit's built-in presets (:mod:`fxsplit.presets`: its indexer is
   ``sparse_indexer``, its rotary embeddings ``attn_prep``, so the v1 and v2 plans differ) under
   both runners, capture emulated (or CUDA), captured pieces on both sides of the indexer;
   prefill logits against eager for several sequence lengths, each plan labelled with the
   lengths it belongs to. Skipped, with the install command, where transformers is missing.
4. Decode, eager against fxsplit (v1, v2) and ``torch.compile(mode="reduce-overhead")`` (CUDA
   only), DeepSeek-V4 and transformers' Llama side by side: tokens compared, ms per token and
   the speed-up in one table (:mod:`fxsplit.tools.demo_speed`).

``fxsplit demo --model <Architecture>`` runs instead one transformers architecture of
:mod:`fxsplit.models.hf_architectures` (tiny config, prefill and decode steps with a KV cache)
under its default runner and the other one, and compares every step's logits with eager.

The default runner of each model (:func:`fxsplit.runners.default_runner`) is marked; one line
per counter says what it counts. With ``FXSPLIT_DUMP_DIR`` set, each section dumps its graphs in
a folder named after it (``deepseek_decode_v1``, ``v1_narrow_region``, ...), which it names.
Lists in table cells go one item per line and headers wrap at spaces, so no word is cut at 80
columns.

Every comparison must match exactly (the split and the replay change no number), or within
:data:`COMPILED_TOLERANCE` where pieces are compiled or run on CUDA (the demo says which, once;
the decode table allows Llama :data:`fxsplit.tools.demo_speed.ALLOWED` beside it);
the exit status is 1 if one does not.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import fxsplit
from fxsplit import capture_off
from fxsplit.config import Config
from fxsplit.counters import DEFINITIONS
from fxsplit.models import deepseek_v4, hf_architectures, hf_deepseek_v4
from fxsplit.passes.modules import module_path
from fxsplit.plan import SplitPlan
from fxsplit.tools import demo_speed
from fxsplit.tools.dump import plan_table, titled

STEPS = (4, 4, 3, 4, 5, 3, 2, 4, 6, 4)
PREFILL_LENGTHS = (5, 8, 13)
METADATA = ("positions", "slot_mapping", "block_table", "seq_lens")
DEEPSEEK = "DeepseekV4ForCausalLM"
# --model: captured pieces replay from the 4th decode step (the first decode graph is static,
# the next warms up, then captures)
DECODE_STEPS = 6

LEGEND = (
    ("graph_<n>", "the n-th graph Dynamo compiled; in brackets: its step or lengths"),
    ("plan <k>", "the k-th distinct prefill split (each length compiles afresh)"),
    ("captures", DEFINITIONS["captures"]),
    ("replays", DEFINITIONS["replays"]),
    ("uncaptured", DEFINITIONS["uncaptured_runs"]),
    ("input copies", DEFINITIONS["input_copies"]),
    ("warmup_runs", "0 for the prefill: its 1st call captures (default 1: the 2nd)"),
)
"""What the tables' words and counters mean, one line each (the counters' as
:data:`fxsplit.counters.DEFINITIONS` defines them)."""


DEVICES = ("cuda", "cpu")


def default_device() -> str:
    """``"cuda"`` where torch sees a CUDA or ROCm device, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _capture_mode(device: str) -> str:
    """The ``capture`` option the demo passes on ``device``: CUDA graphs on a GPU, the CPU
    capture emulator elsewhere."""
    return "cuda" if device == "cuda" else "emulate"


def _dumps(section: str) -> dict[str, str]:
    """``{"dump_dir": <dump root>/<section>}`` where dumps are asked for (``FXSPLIT_DUMP_DIR``),
    so that each section's graphs are dumped in a folder named after it; else ``{}``."""
    root = Config().dump_folder
    return {"dump_dir": str(Path(root) / section)} if root else {}


# Inductor fuses and reorders fp32 reductions, and CUDA may pick other kernels than eager.
COMPILED_TOLERANCE = 1e-4
_ORDINALS = {1: "1st", 2: "2nd", 3: "3rd"}


def _compiles(compile_pieces: str, device: str) -> bool:
    return compile_pieces == "inductor" or (compile_pieces == "auto" and device == "cuda")


def _allowed(device: str, compiled: bool) -> float:
    """The largest difference from eager a comparison allows: none where pieces run the graph's
    own ops on the CPU (bit for bit), :data:`COMPILED_TOLERANCE` otherwise."""
    return 0.0 if device == "cpu" and not compiled else COMPILED_TOLERANCE


def _close(diff: float, device: str, compiled: bool) -> bool:
    return diff <= _allowed(device, compiled)


def _equal(got: torch.Tensor, want: torch.Tensor, compiled: bool) -> tuple[bool, float]:
    diff = (got.float() - want.float()).abs().max().item()
    return _close(diff, got.device.type, compiled), diff


def _runner_label(runner: str, architecture: str) -> str:
    default = fxsplit.runners.default_runner(architecture)
    return f"runner {runner}" + (" (its default)" if runner == default else "")


def _plan_title(plan: SplitPlan, when: str) -> str:
    """``"graph_0 (step 0), runner v1: 5 pieces (3 captured, 2 eager)"``."""
    n = len(plan.pieces)
    return (
        f"{plan.graph_id} ({when}), runner {plan.runner}: {n} piece{'s' if n != 1 else ''} "
        f"({len(plan.captured)} captured, {len(plan.eager)} eager)"
    )


def _counter_columns(table: Table) -> None:
    # Headers wrap at their spaces; numbers never wrap.
    for column in ("captures", "replays", "uncaptured", "input copies"):
        table.add_column(column, justify="right")


def _counter_cells(delta: dict[str, int]) -> tuple[str, ...]:
    return tuple(str(delta[k]) for k in ("captures", "replays", "uncaptured_runs", "input_copies"))


@dataclass
class _Decode:
    """One decode run: the backend, per step ``(batch, ok, diff, counter deltas)``, and the
    step at which each graph was compiled (``{graph_id: step}``)."""

    backend: fxsplit.Backend
    rows: list[tuple[int, bool, float, dict[str, int]]]
    compiled_at: dict[str, int]


def _decode(
    runner: str, compile_pieces: str, device: str, section: str, eager_regions=None, steps=None
) -> _Decode:
    """Compile the reference DeepSeek-V4 model on ``device`` and decode ``steps`` (batch sizes;
    the demo's :data:`STEPS` when None); dumps go to the folder of ``section``."""
    steps = STEPS if steps is None else steps
    torch._dynamo.reset()
    persistent = fxsplit.runners.get(runner).persistent_inputs
    model = deepseek_v4.build().to(device)
    reference = deepseek_v4.clone_model(model)
    options = {"runner": runner, "capture": _capture_mode(device), "compile_pieces": compile_pieces}
    options.update(_dumps(section))
    if eager_regions is not None:
        options["eager_regions"] = eager_regions
    backend = fxsplit.Backend(**options)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    feed = deepseek_v4.DecodeRunner(model.config, max(steps), persistent=persistent, device=device)
    feed_ref = deepseek_v4.DecodeRunner(
        model.config, max(steps), persistent=persistent, device=device
    )
    run = _Decode(backend, [], {})
    with torch.no_grad():
        for step, batch in enumerate(steps):
            before = fxsplit.counters.snapshot()
            got = compiled(*feed.step(batch))
            after = fxsplit.counters.snapshot()
            want = reference(*feed_ref.step(batch))
            ok, diff = _equal(got, want, _compiles(compile_pieces, device))
            run.rows.append((batch, ok, diff, {k: after[k] - before[k] for k in after}))
            for plan in backend.plans:
                run.compiled_at.setdefault(plan.graph_id, step)
    return run


def _copied(backend: fxsplit.Backend) -> dict[str, int]:
    """Input copies per copied value over every replay: ``{name: copies}``, named in the
    model's terms: the caller's argument (``input_ids``), or the module whose code made the
    value an earlier piece hands on (``layers.0.attn output``)."""
    copies: dict[str, int] = {}
    for runtime, split in zip(backend.runtimes, backend.compiled, strict=False):
        nodes = {n.name: n for n in split.graph_module.graph.nodes}
        for piece in runtime.pieces:
            for name, n in piece.stats.copies_by_input.items():
                label = _value_label(nodes.get(name), name)
                copies[label] = copies.get(label, 0) + n
    return copies


def _value_label(node, name: str) -> str:
    """A graph value as the model's code names it (see :func:`_copied`); the node's own name
    where the graph says nothing more."""
    if node is None:
        return name
    if node.op == "placeholder":
        # Dynamo names the argument x "l_x_" (and a keyword argument "l_kwargs_x_")
        return name.removeprefix("l_").removeprefix("kwargs_").rstrip("_")
    stack = node.meta.get("nn_module_stack")
    if stack:
        dynamo_path, _ = list(stack.values())[-1]
        return f"{module_path(dynamo_path) or 'model'} output"
    return name


def _metadata_copies(backend: fxsplit.Backend) -> int:
    return sum(n for name, n in _copied(backend).items() if name in METADATA)


def _copies_line(backend: fxsplit.Backend) -> str:
    copied = _copied(backend)
    names = ", ".join(f"{name} {n}" for name, n in copied.items()) or "none"
    return f"input copies of all steps, by value: {names}"


def _deepseek(console: Console, runner: str, compile_pieces: str, device: str) -> bool:
    persistent = fxsplit.runners.get(runner).persistent_inputs
    metadata = "persistent buffers" if persistent else "fresh tensors each step"
    label = _runner_label(runner, DEEPSEEK)
    section = f"deepseek_decode_{runner}"
    run = _decode(runner, compile_pieces, device, section)
    console.print(f"DeepSeek-V4 reference model, decode, {label}", highlight=False)
    _dump_line(console, section)
    for plan in run.backend.plans:
        console.print(plan_table(plan, _plan_title(plan, f"step {run.compiled_at[plan.graph_id]}")))
    title = f"DeepSeek-V4 decode, {label}; metadata: {metadata}"
    table = Table()
    for column in ("step", "batch", "max diff"):
        table.add_column(column, justify="right")
    _counter_columns(table)
    table.add_column("ok")
    ok = True
    for step, (batch, good, diff, delta) in enumerate(run.rows):
        ok &= good
        table.add_row(
            str(step), str(batch), f"{diff:.3g}", *_counter_cells(delta), "yes" if good else "NO"
        )
    console.print(titled(title, table))
    _print_wrapped(console, _copies_line(run.backend))
    _compile_summary(console, _records(run.backend))
    return ok


def _records(backend: fxsplit.Backend) -> list:
    return [r for split in backend.compiled for r in split.compiled_pieces or ()]


def _compile_summary(console: Console, records: list) -> None:
    """The distinct pieces compiled, loaded or left as Python, and the seconds; then one line
    per piece left as Python saying why (the same reason once)."""
    from fxsplit.passes import inductor

    lines = [f"compiled pieces: {inductor.summary(records)}"] if records else []
    lines += dict.fromkeys(
        f"  {', '.join(r.pieces)} left as Python: {r.reason}"
        for r in records
        if r.outcome == inductor.EAGER
    )
    for line in lines:
        _print_wrapped(console, line)


def _print_wrapped(console: Console, line: str) -> None:
    """``line`` at the console's width, later lines indented; wrapped here: rich's own wrap
    leaves a space at each line's end."""
    wrapped = textwrap.fill(
        line,
        console.width,
        subsequent_indent="    ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    console.print(wrapped, highlight=False, soft_wrap=True)


def _tolerance_line(compile_pieces: str, device: str) -> str:
    """What the tables' ``max diff`` may be for their rows to be ok (see :func:`_close`)."""
    what = "max diff: the largest difference from eager"
    if device == "cpu" and not _compiles(compile_pieces, device):
        return (
            f"{what}, which must be 0 (the split and the replays change no number; the decode "
            "table's notes name a model transformers computes another way under torch.compile)"
        )
    why = (
        "Inductor fuses and reorders float32 sums"
        if _compiles(compile_pieces, device)
        else "CUDA may pick other kernels than eager"
    )
    return f"{what}, allowed up to {COMPILED_TOLERANCE:g} ({why})"


def _narrow_vs_wide(console: Console, compile_pieces: str, device: str) -> bool:
    title = "Runner v1 (fresh metadata each step): why the wide eager region"
    table = Table()
    for column in ("plan", "eager regions", "equal to eager", "metadata copies", "other copies"):
        table.add_column(column)
    ok = True
    others: dict[str, None] = {}
    wide, narrow = ("wide (v1's)", "v1_wide_region"), ("narrow", "v1_narrow_region")
    for (label, section), regions in ((wide, None), (narrow, ["sparse_indexer", "attention"])):
        run = _decode("v1", compile_pieces, device, section, regions)
        good = all(step_ok for _, step_ok, _, _ in run.rows)
        copies = sum(delta["input_copies"] for *_, delta in run.rows)
        meta = _metadata_copies(run.backend)
        ok &= good and (meta == 0) == (regions is None)
        names = "\n".join(sorted(run.backend.plans[0].eager_regions))
        table.add_row(label, names, "yes" if good else "NO", str(meta), str(copies - meta))
        others.update(dict.fromkeys(n for n in _copied(run.backend) if n not in METADATA))
    console.print(titled(title, table))
    for _, section in (wide, narrow):
        _dump_line(console, section)
    console.print(f"metadata copies: copies of {', '.join(METADATA)}", highlight=False)
    _print_wrapped(console, f"other copies: copies of {', '.join(others) or 'nothing'}")
    return ok


def _prefill_table(compiles: bool) -> Table:
    """The prefill table's columns: which call captures and which replays (a compiled piece
    runs once before its capture, so with Inductor pieces they are the 2nd and the 3rd)."""
    first = 2 if compiles else 1
    table = Table()
    table.add_column("seq_len", justify="right")
    table.add_column("captured/eager pieces", justify="right")
    table.add_column(f"captures, {_ORDINALS[first]} call", justify="right")
    table.add_column(f"replays, {_ORDINALS[first + 1]} call", justify="right")
    table.add_column("max diff", justify="right")
    table.add_column("ok")
    return table


def _hf(console: Console, runner: str, compile_pieces: str, device: str) -> bool:
    label = _runner_label(runner, DEEPSEEK)
    title = f"transformers {DEEPSEEK} prefill, {label}"
    table = _prefill_table(_compiles(compile_pieces, device))
    ok = True
    plans: dict[str, tuple[SplitPlan, list[int]]] = {}  # plan text -> (plan, its lengths)
    records = []
    for seq_len in PREFILL_LENGTHS:
        torch._dynamo.reset()
        model, args = hf_deepseek_v4.example(seq_len=seq_len)
        model = model.to(device)
        args = tuple(a.to(device) for a in args)
        # transformers marks no region: the built-in presets find the indexer and the rotary
        # embeddings (attention input preparation: eager under v1, captured under v2).
        backend = fxsplit.Backend(
            runner=runner,
            capture=_capture_mode(device),
            warmup_runs=0,
            compile_pieces=compile_pieces,
            **_dumps(f"transformers_prefill_{runner}/seq_len_{seq_len}"),
        )
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            want = model(*args)
            if _compiles(compile_pieces, device):
                compiled(
                    *args
                )  # a compiled piece runs once before its capture, whatever warmup_runs
            before = fxsplit.counters.snapshot()
            compiled(*args)  # captures
            middle = fxsplit.counters.snapshot()
            got = compiled(*args)  # replays
            after = fxsplit.counters.snapshot()
        records += _records(backend)
        good, diff = _equal(got, want, _compiles(compile_pieces, device))
        (plan,) = backend.plans
        plans.setdefault(plan.format(), (plan, []))[1].append(seq_len)
        sides = [p.kind for p in plan.pieces]
        indexer = next(i for i, p in enumerate(plan.pieces) if "sparse_indexer" in p.regions)
        good &= "captured" in sides[:indexer] and "captured" in sides[indexer + 1 :]
        replays = after["replays"] - middle["replays"]
        good &= replays > 0
        ok &= good
        table.add_row(
            str(seq_len),
            f"{sides.count('captured')}/{sides.count('eager')}",
            str(middle["captures"] - before["captures"]),
            str(replays),
            f"{diff:.3g}",
            "yes" if good else "NO",
        )
    console.print(f"transformers {DEEPSEEK}, prefill, {label}", highlight=False)
    _dump_line(console, f"transformers_prefill_{runner}/seq_len_<n>")
    for k, (plan, lengths) in enumerate(plans.values(), 1):
        when = f"seq_len {', '.join(map(str, lengths))}"
        console.print(plan_table(plan, f"plan {k}: {_plan_title(plan, when)}"))
    console.print(titled(title, table))
    _compile_summary(console, records)
    return ok


@dataclass
class _ModelRun:
    """One architecture under one runner: its plans, the step that compiled each graph, and
    per step ``(label, diff, counter deltas)``."""

    plans: list[SplitPlan]
    compiled_at: dict[str, str]
    rows: list[tuple[str, float, dict[str, int]]]


def _model_run(architecture: str, runner: str, compile_pieces: str, device: str) -> _ModelRun:
    """Prefill and decode ``architecture``'s tiny model with a ``DynamicCache`` on ``device``,
    compiled and eager, step by step."""
    from transformers import DynamicCache

    model = hf_architectures.build(architecture).to(device)
    ids = [t.to(device) for t in hf_architectures.token_ids(model, DECODE_STEPS)]
    want = hf_architectures.decode(model, model.config, ids)
    torch._dynamo.reset()
    # transformers' loop hands a fresh input_ids tensor every step: copied, under v2 too
    backend = fxsplit.Backend(
        runner=runner,
        capture=_capture_mode(device),
        compile_pieces=compile_pieces,
        input_binding="copy",
        **_dumps(f"{architecture}_{runner}"),
    )
    compiled = torch.compile(model, backend=backend)
    cache = DynamicCache(config=model.config)
    run = _ModelRun([], {}, [])
    with torch.no_grad():
        for step, tokens in enumerate(ids):
            label = "prefill" if step == 0 else f"decode {step}"
            before = fxsplit.counters.snapshot()
            got = compiled(input_ids=tokens, cache=cache, use_cache=True).logits
            after = fxsplit.counters.snapshot()
            diff = (got.float() - want[step].float()).abs().max().item()
            run.rows.append((label, diff, {k: after[k] - before[k] for k in after}))
            for plan in backend.plans:
                run.compiled_at.setdefault(plan.graph_id, label)
    run.plans = list(backend.plans)
    torch._dynamo.reset()
    return run


def _model(console: Console, architecture: str, compile_pieces: str, device: str) -> bool:
    """One transformers architecture under its default runner and the other one."""
    listed = hf_architectures.ARCHITECTURES[architecture].stands_for or architecture
    first = fxsplit.runners.default_runner(listed)
    ok = True
    for runner in (first, "v2" if first == "v1" else "v1"):
        run = _model_run(architecture, runner, compile_pieces, device)
        label = _runner_label(runner, listed)
        console.print(f"{architecture}, {label}, capture {_capture_mode(device)}", highlight=False)
        _dump_line(console, f"{architecture}_{runner}")
        for plan in run.plans:
            console.print(plan_table(plan, _plan_title(plan, run.compiled_at[plan.graph_id])))
        prefill = hf_architectures.PREFILL_LEN
        title = f"{label}: prefill {prefill} tokens, then 1 per decode step"
        table = Table()
        table.add_column("step")
        table.add_column("max diff", justify="right")
        _counter_columns(table)
        table.add_column("ok")
        for step, diff, delta in run.rows:
            good = _close(diff, device, _compiles(compile_pieces, device))
            ok &= good
            table.add_row(step, f"{diff:.3g}", *_counter_cells(delta), "yes" if good else "NO")
        console.print(titled(title, table))
    return ok


def _speed(console: Console, compile_pieces: str, device: str) -> bool:
    """The decode table (:mod:`fxsplit.tools.demo_speed`); True when fxsplit's rows match
    eager."""
    steps = demo_speed.STEPS[device]
    rows = demo_speed.measure(device, _capture_mode(device), compile_pieces, steps, _dumps)
    allowed = _allowed(device, _compiles(compile_pieces, device))
    table = Table(pad_edge=False)
    table.add_column("model", no_wrap=True)
    table.add_column("variant", no_wrap=True)
    for column in ("tokens as eager", "max diff", "ms per token", "speed-up"):
        table.add_column(column, justify="right")
    table.add_column("ok")
    ok = True
    for cells, good in demo_speed.table_rows(rows, allowed):
        table.add_row(*cells)
        ok &= good
    where = torch.cuda.get_device_name(0) if device == "cuda" else "the CPU"
    against = "fxsplit and reduce-overhead" if device == "cuda" else "fxsplit"
    console.print(titled(f"Decode on {where}: eager against {against}", table))
    for line in demo_speed.notes(rows, device, steps, allowed):
        _print_wrapped(console, line)
    _dump_line(console, "decode_<model>_<variant>")
    return ok


def _dump_line(console: Console, section: str) -> None:
    """Where ``section``'s graphs are dumped, where dumps are asked for."""
    folder = _dumps(section).get("dump_dir")
    if folder:
        _print_wrapped(console, f"dump folders: {Path(folder).resolve()}")


def print_legend(console: Console, legend: tuple[tuple[str, str], ...] = LEGEND) -> None:
    """Print ``legend`` (``(word, meaning)`` pairs; default :data:`LEGEND`), one line per
    word."""
    console.print("How to read the tables:", highlight=False)
    for word, meaning in legend:
        console.print(f"  {word:<13}{meaning}", highlight=False)


def run(
    model: str | None = None,
    compile_pieces: str = "auto",
    console: Console | None = None,
    device: str | None = None,
) -> int:
    """Run the demo, or with ``model`` (an architecture name of
    :mod:`fxsplit.models.hf_architectures`) that architecture only; returns the process exit
    status (0 when every comparison matched). ``compile_pieces`` is the option of that name
    (``"inductor"`` compiles the captured pieces; comparisons then allow
    :data:`COMPILED_TOLERANCE`). Runs on ``device`` (``"cuda"`` or ``"cpu"``; default
    :func:`default_device`) and prints to ``console`` (a terminal-sized one when None). The
    whole demo ends with the decode table of :mod:`fxsplit.tools.demo_speed`.

    Raises:
        ValueError: an unknown architecture (the message lists the known ones), or a device
            other than "cuda" and "cpu", or "cuda" where torch sees none.
        ImportError: ``model`` given and transformers missing or lacking it.
    """
    device = check_device(default_device() if device is None else device)
    console = console or Console()
    mode = _capture_mode(device)
    pieces = "Inductor" if _compiles(compile_pieces, device) else "generated Python"
    console.print(f"capture: {mode} on {device}; pieces: {pieces}; torch {torch.__version__}")
    why = capture_off.reason("auto", None if device == "cpu" else torch.device(device))
    if why is not None:
        _print_wrapped(
            console,
            f"{why}: the default capture='auto' would capture nothing here; this demo passes "
            f"capture='emulate', {capture_off.EMULATOR}",
        )
    # --model runs under the default warmup_runs: the prefill line is for the DeepSeek sections
    print_legend(console, LEGEND if model is None else LEGEND[:-1])
    _print_wrapped(console, _tolerance_line(compile_pieces, device))
    dumps = Config().dump_folder
    if dumps:
        _print_wrapped(
            console,
            f"dump folders: one per compiled graph, in {Path(dumps).resolve()}, in a folder per "
            "section (its path under the section's title)",
        )
    if model is not None:
        ok = _model(console, model, compile_pieces, device)
        console.print("[green]all comparisons passed[/]" if ok else "[red]a comparison FAILED[/]")
        return 0 if ok else 1
    ok = True
    for runner in ("v1", "v2"):
        ok &= _deepseek(console, runner, compile_pieces, device)
    ok &= _narrow_vs_wide(console, compile_pieces, device)
    if hf_deepseek_v4.available():
        for runner in ("v1", "v2"):
            ok &= _hf(console, runner, compile_pieces, device)
    else:
        _print_wrapped(
            console,
            "skipped the transformers section: it needs transformers >= 5.8.1 with "
            f"DeepseekV4ForCausalLM ({hf_deepseek_v4.INSTALL_HINT})",
        )
    ok &= _speed(console, compile_pieces, device)
    console.print("[green]all comparisons passed[/]" if ok else "[red]a comparison FAILED[/]")
    return 0 if ok else 1


def check_device(device: str) -> str:
    """``device`` if the demo can run there.

    Raises:
        ValueError: not one of :data:`DEVICES`, or "cuda" where torch sees no CUDA or ROCm
            device (the message names the fix).
    """
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda: torch sees no CUDA or ROCm device here (a CPU build of torch, or no "
            "GPU); use --device cpu"
        )
    return device
