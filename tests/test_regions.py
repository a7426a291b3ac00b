"""Tests of region marking: ``fxsplit.region`` under torch.compile and in eager code."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import fxsplit
from fxsplit import regions
from fxsplit.regions import node_regions, region_key
from tests.warned import warned_at

_names = itertools.count()


def unique(prefix: str) -> str:
    """A region name no other test uses (the graph-break warning is once per name)."""
    name = f"{prefix}_{next(_names)}"
    regions._warned_eager.discard((name, False))
    regions._warned_eager.discard((name, True))
    return name


pytestmark = pytest.mark.usefixtures("fresh_capture_state")


class Recorder:
    """A backend that keeps every graph Dynamo hands it and runs it as is."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def customs(self, index: int = 0) -> dict[str, dict]:
        return {
            n.name: dict(n.meta.get("custom") or {})
            for n in self.graphs[index].graph.nodes
            if n.op not in ("placeholder", "output")
        }


def _compile(fn, recorder, **kwargs):
    return torch.compile(fn, backend=recorder, **kwargs)


def fxsplit_warnings(record) -> list[warnings.WarningMessage]:
    return [w for w in record if "fxsplit" in str(w.message)]


def test_region_key():
    assert region_key("attention") == "fxsplit.region:attention"


def test_node_regions():
    assert node_regions(None) == ()
    assert node_regions({}) == ()
    custom = {"fxsplit.region:a": True, "other": 1, "fxsplit.region:b": True}
    assert node_regions(custom) == ("a", "b")


def test_context_manager_sets_custom_meta():
    def f(x):
        a = x + 1
        with fxsplit.region("attention"):
            b = a.sin()
        return b * 2

    rec = Recorder()
    x = torch.randn(3)
    assert torch.equal(_compile(f, rec, fullgraph=True)(x), f(x))
    customs = rec.customs()
    assert customs["b"] == {"fxsplit.region:attention": True}
    assert customs["a"] == {}
    others = [k for name, c in customs.items() if name != "b" for k in c]
    assert not others


def test_decorator_sets_custom_meta():
    @fxsplit.region("deco")
    def inner(x):
        return x.sin()

    def f(x):
        return inner(x + 1) * 2

    rec = Recorder()
    x = torch.randn(3)
    assert torch.equal(_compile(f, rec, fullgraph=True)(x), f(x))
    marked = [name for name, c in rec.customs().items() if c.get("fxsplit.region:deco")]
    assert marked == ["sin"]


def test_nesting_keeps_both_names():
    def f(x):
        with fxsplit.region("outer"):
            a = x.cos()
            with fxsplit.region("inner"):
                b = a + 1
            c = b * 2
        return c - 1

    rec = Recorder()
    x = torch.randn(3)
    assert torch.equal(_compile(f, rec, fullgraph=True)(x), f(x))
    nodes = {name: node_regions(c) for name, c in rec.customs().items()}
    assert nodes["a"] == ("outer",)
    assert nodes["b"] == ("outer", "inner")
    assert nodes["c"] == ("outer",)
    assert nodes["sub"] == ()


def test_same_name_nested_twice():
    def f(x):
        with fxsplit.region("attention"):
            a = x.cos()
            with fxsplit.region("attention"):
                b = a + 1
            c = b * 2
        return c

    rec = Recorder()
    x = torch.randn(3)
    assert torch.equal(_compile(f, rec, fullgraph=True)(x), f(x))
    nodes = {name: node_regions(c) for name, c in rec.customs().items()}
    assert nodes == {"a": ("attention",), "b": ("attention",), "c": ("attention",)}


def test_eager_use_changes_nothing_and_does_not_warn():
    name = unique("eager")

    @fxsplit.region(name)
    def g(x):
        return x * 3

    def f(x):
        with fxsplit.region(name):
            y = x.sin()
        return g(y)

    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = f(x)
    assert torch.equal(got, x.sin() * 3)
    assert not fxsplit_warnings(record)
    assert not {key for key in regions._warned_eager if key[0] == name}


def test_region_passes_exceptions_through():
    with pytest.raises(KeyError, match="boom"), fxsplit.region("attention"):
        raise KeyError("boom")


def test_graph_break_inside_region_warns_once():
    name = unique("broken")

    def f(x):
        with fxsplit.region(name):
            a = x.cos()
            print("graph break")
            b = a + 1
        return b

    rec = Recorder()
    compiled = _compile(f, rec)
    x = torch.randn(3)
    with pytest.warns(fxsplit.FxsplitRuntimeWarning, match="graph break") as record:
        assert torch.equal(compiled(x), f(x))
    # once, at the region in the model code
    assert warned_at(record) == [("test_regions.py", "with fxsplit.region(name):")]
    assert issubclass(record[0].category, RuntimeWarning) and repr(name) in str(record[0].message)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert torch.equal(compiled(x), f(x))
    assert not fxsplit_warnings(record)


@torch._dynamo.config.patch(recompile_limit=2)  # not monkeypatch: pytest 9.2 deletes it after
def test_region_run_eagerly_past_the_recompile_limit_names_that_cause():
    name = unique("limited")

    def f(x, step):
        with fxsplit.region(name):
            a = x.cos() * step  # a Python int: one graph per value
        return a + 1

    compiled = _compile(f, Recorder(), dynamic=False)
    x = torch.randn(3)
    with pytest.warns(fxsplit.FxsplitRuntimeWarning, match="recompile limit") as record:
        for step in range(4):
            assert torch.equal(compiled(x, step), f(x, step))
    assert warned_at(record) == [("test_regions.py", "with fxsplit.region(name):")]
    message = str(record[0].message)
    assert "recompile limit" in message and "'f'" in message and "graph break" not in message


def test_no_warning_without_graph_break():
    name = unique("clean")

    def f(x):
        with fxsplit.region(name):
            a = x.cos()
        return a + 1

    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = _compile(f, Recorder())
        for _ in range(2):
            assert torch.equal(compiled(x), f(x))
    assert not fxsplit_warnings(record)


def test_fullgraph_with_fxsplit_backend():
    def f(x):
        with fxsplit.region("attention"):
            a = x.cos()
        return a + 1

    backend = fxsplit.Backend()
    x = torch.randn(3)
    assert torch.equal(torch.compile(f, backend=backend, fullgraph=True)(x), f(x))
    assert [p.kind for p in backend.plans[0].pieces] == ["eager", "captured"]


@pytest.mark.parametrize(("name", "error"), [(3, TypeError), (None, TypeError), ("", ValueError)])
def test_bad_names_raise(name, error):
    with pytest.raises(error), fxsplit.region(name):
        pass


@pytest.mark.parametrize(("name", "error"), [(3, TypeError), ("", ValueError)])
def test_bad_names_raise_as_decorator(name, error):
    @fxsplit.region(name)
    def f():
        return 1

    with pytest.raises(error):
        f()


def test_eager_modules_and_module_regions_match_the_root_module_class():
    class Whole(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu() + x

    x = torch.randn(2, 4)
    plans = fxsplit.explain(Whole(), x, eager_modules=["Whole"])
    assert [p.kind for p in plans[0].pieces] == ["eager"], plans[0].format()
    assert "module:Whole" in plans[0].pieces[0].reasons
    torch._dynamo.reset()
    plans = fxsplit.explain(Whole(), x, module_regions={"Whole": fxsplit.ATTENTION})
    assert [p.kind for p in plans[0].pieces] == ["eager"], plans[0].format()
    torch._dynamo.reset()


def test_regions_run_eagerly_from_two_threads_leave_no_mark_on_later_traces():
    """Outside a trace a region marks nothing: ``annotate`` keeps its marks in one global dict,
    which two threads entering and leaving regions at once left holding a region (every node
    of every later trace then belonged to it)."""
    import threading

    from torch.fx.traceback import current_meta

    inside, left = threading.Event(), threading.Event()

    def first():
        with fxsplit.region(fxsplit.ATTENTION):
            inside.set()
            left.wait(30)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(30)
    with fxsplit.region(fxsplit.ATTN_PREP):
        left.set()
        thread.join(30)
    assert not [k for k in current_meta.get("custom", {}) if k.startswith("fxsplit.region:")]
