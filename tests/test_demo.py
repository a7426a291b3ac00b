"""``fxsplit demo``: its tables read at 80 columns, a missing transformers skips a section
instead of failing the run, bad ``--tp`` and ``--model`` values are answered with the allowed
ones, and the decode with Inductor pieces stays within tolerance while its compiled pieces
replay."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("rich")

from rich.console import Console
from rich.table import Table

import fxsplit
from fxsplit.models import deepseek_v4
from fxsplit.tools import demo, demo_speed
from fxsplit.tools.dump import graph_title, plan_table
from tests.columns import Recording, cut_words
from tests.timeouts import scaled


def test_cut_words_finds_a_word_folded_across_lines():
    table = Table()
    table.add_column("regions", overflow="fold")
    table.add_row("sparse_indexer, attention")
    console = Recording(14)
    console.print(table)
    cut = cut_words(console)
    assert cut and "".join(cut) in "sparse_indexer,", console.text


def test_plan_tables_fit_80_columns_without_cutting_a_word():
    plans = fxsplit.explain(deepseek_v4.build(), *deepseek_v4.example()[1], runner="v1")
    console = Recording(80)
    for plan in plans:
        console.print(plan_table(plan, f"DeepSeek-V4 {graph_title(plan)}"))
    assert max(len(line) for line in console.text.splitlines()) <= 80
    assert not cut_words(console) and "…" not in console.text
    assert "sparse_indexer" in console.text and "region:sparse_indexer" in console.text


def test_demo_at_80_columns_labels_every_plan_and_cuts_no_word(monkeypatch):
    """The whole demo on the CPU (fewer decode steps and prefill lengths) on an 80-column
    terminal, as ``fxsplit demo --device cpu`` runs it, the decode table last."""
    monkeypatch.setattr(demo, "STEPS", (4, 4, 3, 4))
    monkeypatch.setattr(demo, "PREFILL_LENGTHS", (5, 8))
    monkeypatch.setitem(demo_speed.STEPS, "cpu", 2)
    console = Recording(80)
    assert demo.run(console=console, device="cpu") == 0
    text = console.text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not cut_words(console)
    for word, meaning in demo.LEGEND:  # one line per counter
        assert f"  {word:<13}{meaning}\n" in text
    # which graph, which step or length, which runner is the default
    assert "\ngraph_0 (step 0), runner v1: 5 pieces (3 captured, 2 eager)\n" in text
    assert "DeepSeek-V4 decode, runner v2 (its default); metadata: persistent buffers" in text
    assert "\nplan 1: graph_0 (seq_len 5), runner v1: 13 pieces (7 captured, 6 eager)\n" in text
    assert "\nplan 2: graph_0 (seq_len 8), runner v1: 15 pieces (8 captured, 7 eager)\n" in text
    assert "transformers DeepseekV4ForCausalLM prefill, runner v2 (its default)" in text
    titles = [line for line in text.splitlines() if re.match(r"(plan \d+: )?graph_\d+ \(", line)]
    assert len(titles) >= 6 and len(set(titles)) == len(titles), titles  # one title per plan
    # v2 captures attention input preparation: its region reads as captured, not as eager
    assert "│ attn_prep (captured) │" in text
    # copies named in the model's terms: its argument, the module that made the value
    words = " ".join(text.split())
    copied = "input_ids 1, layers.0.attn output 1, layers.1.attn output 1"
    assert f"input copies of all steps, by value: {copied}" in words
    assert "other copies: copies of input_ids, layers.0.attn output, layers.1.attn output" in words
    # a CPU machine is told why the demo emulates capture
    if not torch.cuda.is_available():
        assert (
            "torch sees no CUDA or ROCm device: the default capture='auto' would capture" in words
        )
    assert [line for line in text.splitlines() if line != line.rstrip()] == []  # no padding
    # the decode table ends it: every model, every variant but CUDA's, each row ok
    table = text.split("Decode on the CPU: eager against fxsplit\n")[1]
    rows = re.findall(r"^│(DeepSeek-V4|Llama) *│ ([\w -]+?) *│.*│ (yes|NO|-) *│$", table, re.M)
    assert [(m, v) for m, v, _ in rows] == [
        (m, v) for m in demo_speed.MODELS for v in ("eager", "fxsplit v1", "fxsplit v2")
    ]
    assert [ok for _, v, ok in rows if v != "eager"] == ["yes"] * 4
    assert text.endswith("all comparisons passed\n")


@pytest.fixture
def header_only(monkeypatch):
    """The demo's sections stubbed out (passing): only its header and closing line run."""
    monkeypatch.setattr(demo, "_deepseek", lambda console, runner, compile_pieces, device: True)
    monkeypatch.setattr(demo, "_narrow_vs_wide", lambda console, compile_pieces, device: True)
    monkeypatch.setattr(demo, "_speed", lambda console, compile_pieces, device: True)
    monkeypatch.setattr(demo.hf_deepseek_v4, "available", lambda: False)


@pytest.mark.usefixtures("header_only")
def test_demo_without_transformers_skips_that_section_and_exits_0(capsys):
    assert demo.run() == 0
    out = capsys.readouterr().out
    assert "skipped the transformers section" in out and "pip install" in out
    assert "FAILED" not in out
    assert [line for line in out.splitlines() if line != line.rstrip()] == []  # no padding


@pytest.mark.usefixtures("header_only")
def test_demo_says_where_the_dump_folders_go(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FXSPLIT_DUMP_DIR", "dumps")
    assert demo.run() == 0
    out = " ".join(capsys.readouterr().out.split())  # wrapped at the console's width
    assert f"dump folders: one per compiled graph, in {tmp_path / 'dumps'}, in a folder" in out
    monkeypatch.delenv("FXSPLIT_DUMP_DIR")
    assert demo.run() == 0
    assert "dump folders" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("compile_pieces", "said"),
    [
        (
            "inductor",
            "max diff: the largest difference from eager, allowed up to 0.0001 (Inductor ",
        ),
        ("eager", "max diff: the largest difference from eager, which must be 0 (the split "),
    ],
)
def test_demo_states_once_the_difference_from_eager_it_allows(compile_pieces, said, monkeypatch):
    """Inductor pieces may differ from eager within COMPILED_TOLERANCE and are marked ok: the
    demo says so once, as the --tp demo does, instead of leaving non-zero diffs unexplained."""
    monkeypatch.setattr(demo, "_deepseek", lambda console, runner, compile_pieces, device: True)
    monkeypatch.setattr(demo, "_narrow_vs_wide", lambda console, compile_pieces, device: True)
    monkeypatch.setattr(demo, "_speed", lambda console, compile_pieces, device: True)
    monkeypatch.setattr(demo.hf_deepseek_v4, "available", lambda: False)
    console = Recording(80)
    assert demo.run(compile_pieces=compile_pieces, console=console, device="cpu") == 0
    text = console.text
    assert text.count("max diff: ") == 1 and said in text.replace("\n", " ")
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not cut_words(console)
    lines = text.split("max diff: ")[1].split("\n")[:2]  # the line wraps once at 80 columns
    assert lines[1].startswith("    ") and [s for s in lines if s != s.rstrip()] == []


def test_demo_tp_below_one_is_a_usage_error(capsys):
    from fxsplit.tools import cli

    assert cli.main(["demo", "--tp", "0"]) == 2
    assert "--tp 0: needs N >= 1" in capsys.readouterr().err
    assert cli.main(["demo", "--tp", "2", "--model", "LlamaForCausalLM"]) == 2
    assert "--tp runs the DeepSeek-V4 reference model only" in capsys.readouterr().err
    assert cli.main(["demo", "--tp", "1", "--compile-pieces", "inductor"]) == 2
    assert "drop --compile-pieces inductor" in capsys.readouterr().err


@pytest.mark.usefixtures("fresh_capture_state")
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_demo_decode_with_inductor_pieces_is_within_tolerance(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("FXSPLIT_CACHE_DIR", str(tmp_path))
    out = io.StringIO()
    warned = _Records()
    inductor_log = logging.getLogger("torch._inductor")
    inductor_log.addHandler(warned)
    try:
        assert demo._deepseek(Console(file=out, width=80), runner, "inductor", "cpu")
    finally:
        inductor_log.removeHandler(warned)
    assert "NO" not in out.getvalue()
    snapshot = fxsplit.counters.snapshot()
    assert snapshot["replays"] > 0
    assert snapshot["pieces_compiled"] + snapshot["piece_cache_hits"] > 0
    assert "compiled pieces: 3 distinct: " in out.getvalue()
    # Inductor could pickle every key (no cyclic SymFloat in it), so it cached every piece
    assert not [m for m in warned.messages if "Failed to pickle cache key" in m]


def test_compile_summary_names_why_pieces_stayed_python_and_cuts_no_word_at_80_columns():
    """The summary line of a warm run is longer than 80 columns, and a piece left as generated
    Python says why (before: only the count, the reason was in the INFO log alone)."""
    from fxsplit.passes.inductor import DISK, EAGER, MEMORY, CompiledPiece

    reason = "outputs q_nope and q_pe share storage"
    records = [
        CompiledPiece(("piece_0",), EAGER, reason=reason),
        CompiledPiece(("piece_1", "piece_3"), DISK, 0.4),
        CompiledPiece(("piece_4",), MEMORY, 0.1),
    ]
    console = Recording(80)
    demo._compile_summary(console, records)
    text = console.text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not cut_words(console)
    assert [line for line in text.splitlines() if line != line.rstrip()] == []  # no padding
    assert text.startswith("compiled pieces: 3 distinct: 0 compiled, 2 loaded (1 disk, 1 memory)")
    assert f"  piece_0 left as Python: {reason}\n" in text


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_demo_model_unknown_architecture_exits_2_listing_the_known_ones(capsys):
    from fxsplit.tools.cli import main

    assert main(["demo", "--model", "Nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown architecture 'Nope'" in err and "Qwen2MoeForCausalLM" in err


@pytest.mark.parametrize(
    ("name", "close"),
    [
        ("llama", "'LlamaForCausalLM'"),
        ("LlamaForCausalLm", "'LlamaForCausalLM'"),
        ("mistral", "'MistralForCausalLM'"),
        ("qwen", "'Qwen2ForCausalLM' or 'Qwen3ForCausalLM' or 'Qwen2MoeForCausalLM'"),
    ],
)
def test_demo_model_close_to_a_known_architecture_suggests_it(name, close, capsys):
    from fxsplit.tools.cli import main

    assert main(["demo", "--model", name]) == 2
    err = capsys.readouterr().err
    assert f"unknown architecture {name!r}; known architectures: " in err
    assert "Qwen2MoeForCausalLM, " in err  # still lists every known one
    assert err.endswith(f"; did you mean {close}?\n")


def test_demo_model_far_from_every_known_architecture_suggests_none(capsys):
    from fxsplit.tools.cli import main

    assert main(["demo", "--model", "Nope"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_demo_model_not_shipped_names_the_stand_in(capsys):
    from fxsplit.tools.cli import main

    assert main(["demo", "--model", "LongcatFlashNgramForCausalLM"]) == 2
    assert "use LongcatFlashForCausalLM" in capsys.readouterr().err


def test_demo_model_runs_both_runners_default_first_and_cuts_no_word(monkeypatch):
    plans = fxsplit.explain(deepseek_v4.build(), *deepseek_v4.example()[1], runner="v2")
    counts = {"captures": 0, "replays": 3, "uncaptured_runs": 0, "input_copies": 2}
    ran = []

    def model_run(architecture, runner, compile_pieces, device):
        ran.append((architecture, runner))
        rows = [(label, 0.0, counts) for label in ("prefill", "decode 1", "decode 2")]
        return demo._ModelRun(plans, {"graph_0": "prefill"}, rows)

    monkeypatch.setattr(demo, "_model_run", model_run)
    console = Recording(80)
    assert demo.run("Qwen2MoeForCausalLM", console=console, device="cpu") == 0
    assert [r for _, r in ran] == ["v2", "v1"]  # its default runner first
    text = console.text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not cut_words(console)
    assert "Qwen2MoeForCausalLM, runner v2 (its default), capture emulate" in text
    assert "graph_0 (prefill), runner v2: 5 pieces (3 captured, 2 eager)" in text
    assert "runner v1: prefill 5 tokens, then 1 per decode step" in text
    assert "decode 2" in text and "all comparisons passed" in text


def test_demo_model_decodes_until_every_captured_piece_replays_under_v2():
    """transformers' loop hands a fresh input_ids every step: the demo binds by copy, so v2
    replays instead of raising BindingError, and it decodes long enough to show replays."""
    run = demo._model_run("LlamaForCausalLM", "v2", "eager", "cpu")
    labels = [label for label, _, _ in run.rows]
    assert labels[0] == "prefill" and labels[-1] == f"decode {demo.DECODE_STEPS}"
    assert all(diff == 0 for _, diff, _ in run.rows)
    last = run.rows[-1][2]
    assert last["replays"] > 0 and last["captures"] == last["uncaptured_runs"] == 0


def test_tp_table_at_80_columns_cuts_no_word():
    from fxsplit.tools import tp_demo

    plans = fxsplit.explain(deepseek_v4.build(), *deepseek_v4.example()[1], runner="v1")
    rows = [
        {"runner": r, "step": i, "batch": 4, "diff": 2.4e-7, "exact": True, "captures": 3,
         "replays": 0 if i == 0 else 3}
        for r in tp_demo.RUNNERS
        for i in range(2)
    ]  # fmt: skip
    results = [{"rows": rows, "split_plans": {"v1": plans}}] * 4
    console = Recording(80)
    console.print(tp_demo.render(results, 4))
    text = console.text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert not cut_words(console) and "…" not in text
    assert "2.4e-07" in text and "v2: DeepSeek-V4's default_runner" in text


def test_tp_demo_names_an_error_every_rank_raised_once(monkeypatch, capsys):
    from fxsplit.tools import tp_demo

    message = "ValueError: tensor-parallel size 3 does not divide num_heads (4)"
    monkeypatch.setattr(tp_demo, "spawn", lambda *args, **kwargs: [message] * 3)
    assert tp_demo.run(3) == 1
    out = capsys.readouterr().out
    assert out.count("does not divide") == 1 and "ranks 0, 1, 2: ValueError" in out


@pytest.mark.parametrize(
    ("world_size", "processes"), [(1, "1 CPU process,"), (2, "2 CPU processes,")]
)
def test_tp_demo_counts_its_processes_and_explains_only_its_own_columns(
    world_size, processes, monkeypatch, capsys
):
    """The tp table has captures and replays per rank but no uncaptured runs or input copies,
    and its plans are titled without a step in brackets: its legend says only what it shows."""
    from fxsplit.tools import tp_demo

    monkeypatch.setattr(tp_demo, "spawn", lambda *args, **kwargs: ["ValueError: stop"] * world_size)
    assert tp_demo.run(world_size) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"tensor parallel: {processes} gloo, capture emulated; torch ")
    legend = out.split("How to read the tables:\n")[1].split("\n")
    words = [line.split()[0] for line in legend if line.startswith("  ")]
    assert words == ["graph_<n>", "captures", "replays"]
    assert "  graph_<n>    the n-th graph Dynamo compiled\n" in out  # no step in brackets
    meanings = dict(demo.LEGEND)
    assert f"  captures     {meanings['captures']}\n" in out
    assert f"  replays      {meanings['replays']}\n" in out


@pytest.mark.parametrize(("compiles", "calls"), [(False, ("1st", "2nd")), (True, ("2nd", "3rd"))])
def test_prefill_table_names_the_calls_that_capture_and_replay(compiles, calls):
    """With Inductor pieces a compiled piece runs once before its capture: the captures are
    counted on the 2nd call and the replays on the 3rd."""
    headers = [str(c.header) for c in demo._prefill_table(compiles).columns]
    assert f"captures, {calls[0]} call" in headers
    assert f"replays, {calls[1]} call" in headers


def test_the_decode_table_on_the_cpu_matches_eager_and_times_replays_only():
    """``fxsplit demo --device cpu``'s decode table: both models under eager and both runners
    (reduce-overhead needs CUDA), every predicted token eager's, DeepSeek-V4 bit for bit,
    Llama within what transformers' compiled path differs by; the timed steps all replay; no
    warning; torch's thread count as it was."""
    threads = torch.get_num_threads()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = demo_speed.measure("cpu", "emulate", "eager", steps=2)
    assert [str(w.message) for w in caught] == []
    assert torch.get_num_threads() == threads
    assert [(r.model, r.variant) for r in rows] == [
        (m, v) for m in demo_speed.MODELS for v in ("eager", "fxsplit v1", "fxsplit v2")
    ]
    # steps compared: the warm-up steps, the timed ones, and Llama's prompt
    steps = {"DeepSeek-V4": demo_speed.WARMUP_STEPS + 2, "Llama": demo_speed.WARMUP_STEPS + 3}
    for r in rows:
        assert r.steps == steps[r.model] and r.same_tokens == r.steps, r
        assert r.ms > 0 and r.not_replayed == 0, r
    diffs = {(r.model, r.variant): r.diff for r in rows if r.diff is not None}
    assert diffs[("DeepSeek-V4", "fxsplit v1")] == diffs[("DeepSeek-V4", "fxsplit v2")] == 0
    assert max(diffs.values()) <= demo_speed.ALLOWED["Llama"]


def _row(model, variant, ms, diff=None, not_replayed=0):
    return demo_speed.Row(model, variant, ms, 7, 8, diff, not_replayed)


def test_the_decode_table_judges_fxsplits_rows_only_and_says_the_speed_up():
    rows = [
        _row("DeepSeek-V4", "eager", 3.0),
        _row("DeepSeek-V4", "fxsplit v1", 1.0, 0.0),
        _row("DeepSeek-V4", "fxsplit v2", 1.5, 1e-6),
        _row("DeepSeek-V4", "reduce-overhead", 0.75, 0.5),
        _row("Llama", "eager", 2.0),
        _row("Llama", "fxsplit v2", 4.0, 1e-6, not_replayed=3),
    ]
    cells = demo_speed.table_rows(rows, allowed=0.0)
    assert [c for c, _ in cells] == [
        ("DeepSeek-V4", "eager", "-", "-", "3.00", "1.00x", "-"),
        ("DeepSeek-V4", "fxsplit v1", "7/8", "0", "1.00", "3.00x", "yes"),
        ("DeepSeek-V4", "fxsplit v2", "7/8", "1e-06", "1.50", "2.00x", "NO"),  # over 0
        ("DeepSeek-V4", "reduce-overhead", "7/8", "0.5", "0.75", "4.00x", "-"),  # not judged
        ("Llama", "eager", "-", "-", "2.00", "1.00x", "-"),
        ("Llama", "fxsplit v2", "7/8", "1e-06", "4.00", "0.50x", "yes"),  # within ALLOWED
    ]
    assert [good for _, good in cells] == [True, True, False, True, True, True]
    cpu = demo_speed.notes(rows, "cpu", 8, allowed=0.0)
    assert cpu[0].startswith("batch 1, one token per step; ms per token: the mean of 8 decode")
    assert any(line.startswith("Llama: fxsplit may differ from eager by 1e-05") for line in cpu)
    assert any(line.startswith("on a CPU fxsplit emulates capture") for line in cpu)
    assert cpu[-1].startswith("Llama, fxsplit v2: 3 runs of captured pieces in the timed steps")
    cuda = demo_speed.notes(rows[:4], "cuda", 64, allowed=demo.COMPILED_TOLERANCE)
    assert len(cuda) == 1  # how it was timed; nothing about the CPU or a larger allowance


def test_each_section_dumps_into_a_folder_named_after_it(monkeypatch, tmp_path):
    """Three sections compile DeepSeek-V4 under v1, whose folders were all
    ``DeepseekV4Model_v1_graph_0`` side by side, with nothing naming the section."""
    monkeypatch.setenv("FXSPLIT_DUMP_DIR", str(tmp_path))
    monkeypatch.setattr(demo, "STEPS", (4, 4))
    console = Recording(80)
    assert demo._deepseek(console, "v1", "eager", "cpu")
    (folder,) = (tmp_path / "deepseek_decode_v1").iterdir()
    assert folder.name.endswith("_DeepseekV4Model_v1_graph_0")
    assert (folder / "plan.json").is_file()
    said = " ".join(console.text.split())
    assert f"dump folders: {tmp_path / 'deepseek_decode_v1'}" in said
    assert demo._dumps("v1_narrow_region") == {"dump_dir": str(tmp_path / "v1_narrow_region")}
    monkeypatch.delenv("FXSPLIT_DUMP_DIR")
    assert demo._dumps("v1_narrow_region") == {}


def test_demo_device_reaches_the_demo_and_defaults_to_cuda_where_torch_sees_it(monkeypatch):
    from fxsplit.tools import cli

    ran = []
    monkeypatch.setattr(demo, "run", lambda model, compile_pieces, device: ran.append(device) or 0)
    assert cli.main(["demo", "--device", "cpu"]) == 0 and ran == ["cpu"]
    assert cli.main(["demo"]) == 0
    assert ran[-1] == ("cuda" if torch.cuda.is_available() else "cpu")


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fxsplit.tools.cli", *argv],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=scaled(120),
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_on_cuda_without_a_gpu_says_so_and_the_fix():
    done = _cli("demo", "--device", "cuda")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "fxsplit demo: error: --device cuda: torch sees no CUDA or ROCm device here (a CPU build "
        "of torch, or no GPU); use --device cpu\n"
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--device", "gpu"], "argument --device: invalid choice: 'gpu' (choose from"),
        (["--tp", "2", "--device", "cuda"], "--tp runs on CPU processes (gloo); drop --device"),
    ],
)
def test_demo_bad_device_exits_2(argv, said):
    done = _cli("demo", *argv)
    assert done.returncode == 2 and said in done.stderr, done.stderr


def test_a_variant_that_fails_is_a_row_saying_so_and_the_table_goes_on(monkeypatch):
    """The first GPU run saw transformers' compiled forward with a StaticCache raise on torch
    2.11: one variant's error must not cost the user the rest of the table."""

    def decode(variant, device, steps, options):
        if variant == "fxsplit v2":
            raise RuntimeError("the capture failed\nwith more lines")
        return [torch.ones(1, 4)] * steps, 2.0, 0

    rows = demo_speed._model_rows("Llama", decode, "cpu", 3, "emulate", "eager", lambda s: {})
    assert [(r.variant, r.error) for r in rows] == [
        ("eager", None),
        ("fxsplit v1", None),
        ("fxsplit v2", "RuntimeError: the capture failed"),
    ]
    cells = demo_speed.table_rows(rows, allowed=0.0)
    assert cells[-1] == (("Llama", "fxsplit v2", "-", "-", "failed", "-", "NO"), False)
    assert "Llama, fxsplit v2 failed: RuntimeError: the capture failed" in demo_speed.notes(
        rows, "cpu", 3, 0.0
    )

    def eager_fails(variant, device, steps, options):
        raise ValueError("no baseline")

    with pytest.raises(ValueError, match="no baseline"):  # nothing to compare with
        demo_speed._model_rows("Llama", eager_fails, "cpu", 3, "emulate", "eager", lambda s: {})
