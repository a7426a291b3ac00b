"""Device rules of the split, checked on CPU with fake CUDA tensors: work a CUDA graph would
freeze or reject (host tensors, host-to-device copies) runs eagerly, and a piece spanning two
devices is never captured. The emulator cannot see devices, so the split must.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxsplit
from fxsplit.passes import mark, partition, split
from fxsplit.runtime.piece.capture import never_captured as _never_captured


def _traced(fn, *make_inputs):
    """``fn`` traced by torch.fx with Dynamo-like ``example_value`` meta on fake tensors."""
    gm = torch.fx.symbolic_trace(fn)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [make() for make in make_inputs]
    FakeTensorProp(gm, mode).propagate(*inputs)
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.get("val")
    return gm


def _reasons(gm):
    policy = mark.Policy.build(fxsplit.runners.get("v1"))
    marks = mark.mark(gm.graph, policy)
    return {n.name: r for n, r in marks.reasons.items()}


def test_host_to_device_copy_in_a_cuda_graph_runs_eagerly():
    def f(x, idx):
        return x * 2 + idx.to(x.device).float()

    gm = _traced(f, lambda: torch.ones(3, 2, device="cuda"), lambda: torch.arange(2))
    reasons = _reasons(gm)
    copies = [r for name, r in reasons.items() if name.startswith("to")]
    assert copies and all(any("(host tensor)" in x for x in r) for r in copies), reasons
    assert "mul" not in reasons  # device work stays captured


def test_cpu_work_and_cpu_scalar_tensors_in_a_cuda_graph_run_eagerly():
    def f(x, scale):
        s = scale * 3  # CPU work: a CUDA graph would run it once, at capture
        return x * s

    gm = _traced(f, lambda: torch.ones(3, 4, device="cuda"), lambda: torch.tensor(2.0))
    reasons = _reasons(gm)
    assert set(reasons) == {"mul", "mul_1"}, reasons
    assert all(r == ("unsafe:aten::mul (host tensor)",) for r in reasons.values())


def test_cpu_graph_has_no_host_rule():
    def f(x, scale):
        return x * (scale * 3)

    gm = _traced(f, lambda: torch.ones(3, 4), lambda: torch.tensor(2.0))
    assert _reasons(gm) == {}


def test_piece_spanning_two_cuda_devices_is_never_captured():
    def f(x, y):
        return (x * 2).sum() + (y * 3).sum().to(x.device)

    gm = _traced(f, lambda: torch.ones(3, device="cuda:0"), lambda: torch.ones(3, device="cuda:1"))
    result = split(gm, mark.Policy.build(fxsplit.runners.get("v1")))
    captured = [p for p in result.plan.pieces if p.kind == partition.CAPTURED]
    assert captured and captured[0].devices == ("cuda:0", "cuda:1")
    reason = _never_captured([], fxsplit.facts.aliasing.PieceAliasing(), captured[0].devices)
    assert reason is not None and "cuda:0, cuda:1" in reason
    assert _never_captured([], fxsplit.facts.aliasing.PieceAliasing(), ("cuda:0",)) is None
