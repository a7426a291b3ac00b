"""``fxsplit demo``: its tables read at 80 columns, and a missing transformers skips a section
instead of failing the run."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("rich")

from rich.console import Console

import fxsplit
from fxsplit.models import deepseek_v4
from fxsplit.tools import demo
from fxsplit.tools.dump import graph_title, plan_table


def test_plan_tables_fit_80_columns_without_cutting_the_regions():
    plans = fxsplit.explain(deepseek_v4.build(), *deepseek_v4.example()[1], runner="v1")
    out = io.StringIO()
    console = Console(file=out, width=80)
    for plan in plans:
        console.print(plan_table(plan, f"DeepSeek-V4 {graph_title(plan)}"))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text  # folded, never truncated
    assert "sparse_indexer" in text.replace("\n", "").replace(" ", "").replace("│", "")


def test_demo_without_transformers_skips_that_section_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_deepseek", lambda console, runner, compile_pieces: True)
    monkeypatch.setattr(demo, "_narrow_vs_wide", lambda console, compile_pieces: True)
    monkeypatch.setattr(demo.hf_deepseek_v4, "available", lambda: False)
    assert demo.run() == 0
    out = capsys.readouterr().out
    assert "skipped the transformers section" in out and "pip install" in out
    assert "FAILED" not in out


def test_demo_tp_below_one_is_a_usage_error(capsys):
    from fxsplit.tools import cli

    assert cli.main(["demo", "--tp", "0"]) == 2
    assert "--tp 0: needs N >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_demo_decode_with_inductor_pieces_is_within_tolerance(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("FXSPLIT_CACHE_DIR", str(tmp_path))
    out = io.StringIO()
    assert demo._deepseek(Console(file=out, width=80), runner, "inductor")
    assert "NO" not in out.getvalue()
    assert fxsplit.counters.snapshot()["replays"] > 0


def test_demo_model_unknown_architecture_exits_2_listing_the_known_ones(capsys):
    from fxsplit.tools.cli import main

    assert main(["demo", "--model", "Nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown architecture 'Nope'" in err and "Qwen2MoeForCausalLM" in err


def test_demo_model_not_shipped_names_the_stand_in(capsys):
    from fxsplit.tools.cli import main

    assert main(["demo", "--model", "LongcatFlashNgramForCausalLM"]) == 2
    assert "use LongcatFlashForCausalLM" in capsys.readouterr().err


def test_demo_model_runs_both_runners_default_first_and_fits_80_columns(monkeypatch, capsys):
    from fxsplit.tools import coverage

    plans = fxsplit.explain(deepseek_v4.build(), *deepseek_v4.example()[1], runner="v2")
    ran = []

    def check(architecture, runner, capture, device, compile_pieces):
        ran.append((architecture, runner, capture))
        steps = (coverage.StepCounts(0, 0, 3), coverage.StepCounts(3, 0, 0))
        steps += (coverage.StepCounts(0, 3, 0),)
        diffs = (0.0, 0.0, 0.0)
        return coverage.Result(architecture, runner, tuple(plans), diffs, 1.0, steps=steps)

    monkeypatch.setattr(demo.coverage, "check", check)
    monkeypatch.setenv("COLUMNS", "80")
    assert demo.run("Qwen2MoeForCausalLM") == 0
    assert [r for _, r, _ in ran] == ["v2", "v1"]  # its default runner first
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "decode 2" in out and "all comparisons passed" in out
    assert "replays" in out and "captures" in out
