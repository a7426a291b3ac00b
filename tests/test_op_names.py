"""Op names match how models write ops: a Python operator Dynamo records as ``operator.mul``
is ``aten::mul`` for ``splitting_ops``, resolved by dispatching it on fake tensors."""

from __future__ import annotations

import operator

import pytest
import torch

import fxsplit

CASES = {
    "aten::add": lambda x, y: (x + y).relu(),
    "aten::sub": lambda x, y: (x - y).relu(),
    "aten::mul": lambda x, y: (x * 0.5).relu(),
    "aten::div": lambda x, y: (x / y).relu(),
    "aten::floor_divide": lambda x, y: (x // 2).relu(),
    "aten::remainder": lambda x, y: (x % 2).relu(),
    "aten::matmul": lambda x, y: (x @ y.t()).relu(),
    "aten::pow": lambda x, y: (x**2).relu(),
    "aten::neg": lambda x, y: (-x).relu(),
    "aten::lt": lambda x, y: (x < y).float().relu(),
    "aten::ge": lambda x, y: (x >= y).float().relu(),
    "aten::eq": lambda x, y: (x == y).float().relu(),
    "aten::index": lambda x, y: x[y.argmax(0)].relu(),
    "aten::select": lambda x, y: x[1].relu() + y,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_python_operator_matches_its_aten_name(name):
    torch._dynamo.reset()
    fn = CASES[name]
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    plans = fxsplit.explain(fn, x, y, splitting_ops=[name])
    reasons = {r for plan in plans for p in plan.pieces for r in p.reasons}
    assert f"op:{name}" in reasons, [p.format() for p in plans]
    torch._dynamo.reset()


def test_operator_on_host_values_has_no_op_name():
    from fxsplit.facts.ops import op_names

    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    node = graph.call_function(operator.add, (a, 1))
    a.meta["example_value"] = 3
    assert op_names(node) is None


def test_dropout_in_eval_mode_draws_nothing():
    class Dropouts(torch.nn.Module):
        """A Dropout module and a functional dropout with ``training=False``."""

        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(x.sin()) + torch.nn.functional.dropout(x, 0.2, False)

    def random(net):
        plans = fxsplit.explain(net, torch.randn(2, 4), eager_regions=[])  # no region in it
        return [p.random for p in plans[0].pieces]

    net = Dropouts().eval()
    assert random(net) == [False]
    torch._dynamo.reset()
    assert random(net.train()) == [True]
