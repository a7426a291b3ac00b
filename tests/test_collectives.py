"""Functional collectives in the split, without a process group: a collective and its wait
always land in one piece (:mod:`fxsplit.passes.normalise`, :mod:`fxsplit.passes.mark`).

Replays with collectives need ranks: see ``tests/test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

from fxsplit import collectives, distributed
from fxsplit.facts.ops import op_name
from fxsplit.passes import split
from fxsplit.passes.mark import Policy
from fxsplit.runners import Runner

pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops, "_c10d_functional")
    or not hasattr(torch.ops._c10d_functional, "all_reduce"),
    reason="this torch has no functional collectives",
)


def _graph_with_eager_op_between_collective_and_wait() -> GraphModule:
    """``y = all_reduce(x @ w); z = topk(x); out = wait(y) + z``: topk (a splitting op) sits
    between the collective and its wait, as hand-written graphs may have it."""
    c10d = torch.ops._c10d_functional
    g = Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    reduced = g.call_function(c10d.all_reduce, (mm, "sum", "0"))
    top = g.call_function(torch.ops.aten.topk.default, (x, 2))
    values = g.call_function(torch.ops.aten.sum.default, (g.call_function(_first, (top,)),))
    waited = g.call_function(c10d.wait_tensor, (reduced,))
    g.output(g.call_function(torch.ops.aten.add.Tensor, (waited, values)))
    return GraphModule(torch.nn.Module(), g)


def _first(pair):
    return pair[0]


def _pieces(gm: GraphModule, policy: Policy) -> dict[str, object]:
    """``{short op name: piece}`` after the split (``"all_reduce"``, ``"topk"``)."""
    names = {n.name: op_name(n).split("::")[1].split(".")[0] for n in gm.graph.nodes if op_name(n)}
    plan = split(gm, policy).plan
    return {names[node]: p for p in plan.pieces for node in p.nodes if node in names}


def test_collective_and_wait_share_a_piece_when_an_eager_op_sat_between_them():
    gm = _graph_with_eager_op_between_collective_and_wait()
    policy = Policy.build(
        Runner("t", frozenset(), persistent_inputs=False), splitting_ops=["aten::topk"]
    )
    piece_of = _pieces(gm, policy)
    assert piece_of["all_reduce"] is piece_of["wait_tensor"]
    assert piece_of["all_reduce"].kind == "captured"
    assert piece_of["topk"].kind == "eager"


def test_wait_of_an_eager_collective_is_eager_with_it():
    gm = _graph_with_eager_op_between_collective_and_wait()
    policy = Policy.build(
        Runner("t", frozenset(), persistent_inputs=False),
        splitting_ops=["_c10d_functional::all_reduce"],
    )
    piece_of = _pieces(gm, policy)
    assert piece_of["all_reduce"] is piece_of["wait_tensor"]
    assert piece_of["wait_tensor"].kind == "eager"


def test_collective_facts_come_from_the_namespace_and_the_schema():
    c10d = torch.ops._c10d_functional
    assert collectives.is_collective(c10d.all_reduce)
    assert collectives.is_collective(c10d.all_gather_into_tensor.default)
    assert not collectives.is_collective(c10d.wait_tensor.default)
    assert not collectives.is_collective(torch.ops.aten.add.Tensor)
    gm = _graph_with_eager_op_between_collective_and_wait()
    node = next(n for n in gm.graph.nodes if collectives.is_collective_node(n))
    assert collectives.group_name(node) == "0"


def test_split_fingerprint_is_the_same_for_the_same_split_and_names_the_differing_piece():
    def plan_and_graph(ops):
        gm = _graph_with_eager_op_between_collective_and_wait()
        policy = Policy.build(Runner("t", frozenset(), persistent_inputs=False), splitting_ops=ops)
        result = split(gm, policy)
        return distributed.fingerprint(result.plan, result.graph_module)

    same = plan_and_graph(["aten::topk"])
    assert same == plan_and_graph(["aten::topk"])  # no object addresses in it
    other = plan_and_graph(["aten::topk", "aten::mm"])
    assert other != same
    first = next(i for i, (a, b) in enumerate(zip(same, other, strict=False)) if a != b)
    assert same[first].name == "piece_0"
    assert same[first].kind == "captured" and other[first].kind == "eager"
