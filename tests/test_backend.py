"""The backend as torch.compile users meet it: string lookup, plans, explain, reset."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import fxsplit
from fxsplit.models import deepseek_v4
from tests.timeouts import scaled
from tests.warned import warned_at

pytestmark = pytest.mark.usefixtures("fresh_capture_state")


def test_string_backend_in_fresh_process_without_importing_fxsplit():
    code = textwrap.dedent(
        """
        import sys, torch
        def f(x):
            return x.sin() + 1
        out = torch.compile(f, backend="fxsplit")(torch.ones(3))
        assert torch.equal(out, torch.ones(3).sin() + 1)
        assert "fxsplit" in sys.modules
        import fxsplit
        print(len(fxsplit.plans()))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(300)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_string_backend_collects_plans_until_reset():
    torch.compile(lambda x: x.cos() * 2, backend="fxsplit")(torch.ones(2))
    assert [p.graph_id for p in fxsplit.plans()] == ["graph_0"]
    torch._dynamo.reset()
    assert fxsplit.plans() == []


def test_backend_object_keeps_its_own_plans():
    a, b = fxsplit.Backend(), fxsplit.Backend(runner="v2")
    torch.compile(lambda x: x + 1, backend=a)(torch.ones(2))
    assert len(a.plans) == 1 and b.plans == [] and fxsplit.plans() == []


def test_options_reach_the_string_backend():
    def f(x):
        with fxsplit.region("mine"):
            x = x.sin()
        return x.cos()

    torch.compile(f, backend="fxsplit", options={"eager_regions": ["mine"]})(torch.ones(2))
    assert [p.kind for p in fxsplit.plans()[0].pieces] == ["eager", "captured"]


def test_recompile_appends_a_plan():
    backend = fxsplit.Backend()
    f = torch.compile(lambda x: x * 2, backend=backend, dynamic=False)
    f(torch.ones(2))
    f(torch.ones(3))
    assert [p.graph_id for p in backend.plans] == ["graph_0", "graph_1"]


def test_explain_returns_plans_of_every_graph_after_graph_breaks():
    def f(x, scale=1.0):
        x = x.sin()
        print("graph break")
        with fxsplit.region(fxsplit.ATTENTION):
            x = x.softmax(-1)
        return x * scale

    plans = fxsplit.explain(f, torch.randn(2, 3), kwargs={"scale": 2.0})
    assert len(plans) == 2
    assert [p.kind for p in plans[1].pieces] == ["eager", "captured"]
    assert plans[1].pieces[0].reasons == ("region:attention",)


def test_deepseek_v4_equals_eager_over_steps_for_both_runners():
    for runner, persistent in (("v1", False), ("v2", True)):
        torch._dynamo.reset()
        model = deepseek_v4.build()
        reference = deepseek_v4.clone_model(model)
        steps = [3, 4, 2, 5, 4]
        compiled = torch.compile(model, backend=fxsplit.Backend(runner=runner), dynamic=True)
        got = deepseek_v4.run_decode(
            compiled, deepseek_v4.DecodeRunner(model.config, 8, persistent=persistent), steps
        )
        want = deepseek_v4.run_decode(
            reference, deepseek_v4.DecodeRunner(model.config, 8, persistent=persistent), steps
        )
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_backend_repr_shows_non_default_options():
    backend = fxsplit.Backend(runner="v2", capture="emulate")
    assert repr(backend) == "fxsplit.Backend(runner='v2', capture='emulate')"
    assert repr(fxsplit.Backend()) == "fxsplit.Backend()"


def test_cli_version_and_subcommand_descriptions(capsys):
    from fxsplit.tools import cli

    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("fxsplit ")
    for command in ("demo", "dump", "diff"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        usage, _, rest = capsys.readouterr().out.partition("\n\n")
        assert usage.startswith(f"usage: fxsplit {command}"), command
        assert rest.split("\n")[0].strip() and not rest.startswith("options"), command


@pytest.mark.parametrize("columns", ["60", "80"])
def test_cli_help_never_breaks_an_option_name_across_lines(monkeypatch, capsys, columns):
    from fxsplit.tools import cli

    monkeypatch.setenv("COLUMNS", columns)
    for argv in (["--help"], ["cache", "--help"], ["demo", "--help"], ["dump", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        out = capsys.readouterr().out
        assert not re.search(r"--[a-z]+(-[a-z]+)*-\n", out), (argv, out)


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["demo", "--help"], ["cache", "-h"]])
def test_cli_answers_version_and_help_without_importing_torch(argv):
    """Their start time is measured by bench/cli_start.py; this pins why it is short."""
    code = textwrap.dedent(f"""
        import sys
        from fxsplit.tools import cli
        try:
            cli.main({argv!r})
        except SystemExit:
            pass
        heavy = sorted(m for m in ("torch", "transformers", "rich") if m in sys.modules)
        print("imported:", heavy)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "imported: []", done.stdout


def test_warns_once_when_a_runner_wants_regions_but_nothing_marks_any():
    def f(x):  # a softmax, but no attention (that would be found by its shape)
        return (x.sin() * 2).softmax(-1) + x

    backend = fxsplit.Backend()
    with pytest.warns(fxsplit.FxsplitWarning, match="is in any region") as seen:
        for fn in (f, lambda x: f(x) + 1):
            compiled = torch.compile(fn, backend=backend)
            compiled(torch.randn(3, 4))
            compiled(torch.randn(3, 4))  # judged when a graph runs again
    # once, at the call that ran a compiled graph the second time
    line = "compiled(torch.randn(3, 4))  # judged when a graph runs again"
    assert warned_at(seen) == [("test_backend.py", line)]


def test_regions_only_after_a_graph_break_do_not_warn():
    def f(x):
        h = x.sin()
        torch._dynamo.graph_break()
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return h * 2

    compiled = torch.compile(f, backend=fxsplit.Backend())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(3):
            compiled(torch.randn(3, 4))


@pytest.mark.parametrize("where", ["model", "module_regions"])
def test_misspelt_region_marking_nodes_warns(where):
    class MisspeltRegion(torch.nn.Module):
        """Linear(4, 4) then softmax, in a region named "atention" when ``where`` is "model"."""

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            if where == "model":
                with fxsplit.region("atention"):
                    return self.proj(x).softmax(-1)
            return self.proj(x).softmax(-1)

    options = {"module_regions": {"Linear": "atention"}} if where == "module_regions" else {}
    compiled = torch.compile(MisspeltRegion(), backend=fxsplit.Backend(**options))
    with pytest.warns(fxsplit.FxsplitWarning, match="'atention'.*did you mean") as seen:
        compiled(torch.randn(3, 4))
        compiled(torch.randn(3, 4))
    assert warned_at(seen) == [("test_backend.py", "compiled(torch.randn(3, 4))")]


def test_misspelt_region_name_warns_once_with_close_matches():
    def f(x):
        with fxsplit.region(fxsplit.ATTENTION):
            h = x.softmax(-1)
        return h * 2

    backend = fxsplit.Backend(eager_regions=["attenion"])
    with pytest.warns(fxsplit.FxsplitWarning, match="'attenion'.*did you mean 'attention'") as seen:
        compiled = torch.compile(f, backend=backend)
        compiled(torch.randn(3, 4))
        compiled(torch.randn(3, 4))
    assert warned_at(seen) == [("test_backend.py", "compiled(torch.randn(3, 4))")]
    custom = fxsplit.Backend(eager_regions=["my_local_region"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*is in any region")
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=custom)
        compiled(torch.randn(3, 4))
        compiled(torch.randn(3, 4))  # not close to any: no warning


def test_explain_leaves_nothing_in_dynamo_caches():
    class M(torch.nn.Module):
        def forward(self, x):
            y = x.sin()
            torch._dynamo.graph_break()
            return y.cos()

    model, x = M(), torch.randn(4)
    for _ in range(20):  # past Dynamo's recompile limit (8) if each left an entry
        assert len(fxsplit.explain(model, x, eager_regions=[])) == 2
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=count)(x)
    assert len(graphs) == 2


def test_capture_up_front_shows_no_progress_bar_in_a_pipe(capsys):
    backend = fxsplit.Backend(capture="emulate", eager_regions=[])
    compiled = torch.compile(lambda x: x.cos() + 1, backend=backend)
    backend.capture(compiled, {size: (torch.randn(size, 3),) for size in (2, 4)})
    assert "fxsplit capture" not in capsys.readouterr().err  # stderr is no terminal here


def test_capture_up_front_runs_without_tqdm(monkeypatch):
    """A bare GPU box has torch, pytest and numpy only: ``Backend.capture`` goes without its
    progress bar there and still captures every size, each then replayed."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes ``import tqdm`` raise ImportError
    fxsplit.counters.reset()
    backend = fxsplit.Backend(capture="emulate", eager_regions=[])
    compiled = torch.compile(lambda x: x.sin() * 2 + 1, backend=backend)
    inputs = {size: (torch.randn(size, 3),) for size in (2, 4, 8)}
    backend.capture(compiled, inputs)
    assert fxsplit.counters.snapshot()["captures"] == 3
    before = fxsplit.counters.snapshot()["replays"]
    with torch.no_grad():  # as captured: grad mode is part of Dynamo's guards
        for (x,) in inputs.values():
            assert torch.equal(compiled(x), x.sin() * 2 + 1)
    assert fxsplit.counters.snapshot()["replays"] - before == 3


def test_readme_first_run_script_runs_and_replays():
    """The README's "A first run" script, run as a user would (a fresh process)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## A first run", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'captures': 2, 'replays': 4" in done.stdout, done.stdout
    assert "'input_copies': 4," in done.stdout, done.stdout
