"""Structurally identical pieces (one per layer) share one code object and one analysis, and
each still captures its own graph: every piece replays, and every call equals eager bit for
bit."""

from __future__ import annotations

import torch

import fxsplit
from fxsplit.facts import aliasing
from tests.replays import assert_replayed
from tests.stack import Stack


def _compile(layers: int, **options):
    """``Stack(layers)`` compiled under the emulator: four calls, each equal to eager, and every
    captured piece replayed twice (a piece sharing another's code binds its own layer's
    weights)."""
    backend = fxsplit.Backend(capture="emulate", **options)
    model = Stack(layers)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
            assert torch.equal(compiled(x), model(x)), step
    assert_replayed(backend, at_least=2)
    return backend


def test_layers_share_code_and_the_plan_says_so():
    backend = _compile(4)
    plan, pieces = backend.plans[0], [p.module for p in backend.compiled[0].pieces]
    attention = [p for p in plan.pieces if "attention" in p.regions]
    assert len(attention) == 4
    assert [p.same_as for p in attention] == [None, *[attention[0].name] * 3]
    by_name = {p.name: p for p in pieces}
    assert len({id(by_name[p.name].forward) for p in attention}) == 1
    assert plan.sharing()[attention[0].name] == [p.name for p in attention]
    # readable per-piece code keeps the graph's node names; the shared code is canonical
    first, second = (by_name[p.name] for p in attention[:2])
    assert first.code != second.code and first.shared_code == second.shared_code


def test_aliasing_analysis_runs_once_per_distinct_piece(monkeypatch):
    calls = []
    analyse = aliasing.analyse
    monkeypatch.setattr(aliasing, "analyse", lambda *a, **k: calls.append(1) or analyse(*a, **k))
    backend = _compile(6)
    distinct = {p.same_as or p.name for p in backend.plans[0].captured}
    assert len(calls) == len(distinct) < len(backend.plans[0].captured)


def test_pieces_that_differ_in_a_constant_do_not_share():
    def f(x):
        a = x * 0.5
        with fxsplit.region(fxsplit.ATTENTION):
            a = a.softmax(-1)
        b = a * 0.25
        with fxsplit.region(fxsplit.ATTENTION):
            b = b.softmax(-1)
        return b

    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(f, backend=backend)
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
            assert torch.equal(compiled(x), f(x)), step
    assert_replayed(backend, at_least=2)
    plan = backend.plans[0]
    assert [p.kind for p in plan.pieces] == ["captured", "eager", "captured", "eager"]
    assert plan.sharing() == {"piece_1": ["piece_1", "piece_3"]}  # the softmaxes only
