"""Higher-order ops in captured pieces: captured where a CUDA graph would capture them, else
a CaptureError and an uncaptured piece; never a wrong number. The emulator replays the kernels
eager runs, so every value is compared bit for bit."""

from __future__ import annotations

import re

import pytest
import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._higher_order_ops.while_loop import while_loop
from torch._higher_order_ops.wrap import wrap

import fxsplit
from fxsplit.runtime.emulation.emulator import CaptureError, EmulatedGraph

pytestmark = pytest.mark.usefixtures("fresh_capture_state")


@torch.library.custom_op("fxsplit_hoptest::add_into", mutates_args=("out",))
def _add_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.add_(x)


@torch.compiler.nested_compile_region
def _block(x):
    return x.sin() * 3


def _host_cond(x):
    return torch.cond(x.shape[0] > 4, lambda t: t.sin() + 1, lambda t: t.cos() - 1, (x,))


def _tensor_cond(x):
    return torch.cond(x.sum() > 0, lambda t: t.sin() + 1, lambda t: t.cos() - 1, (x,))


def _while(x):
    _, y = while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, t * 2), (torch.tensor(0), x))
    return y + 1


def _subgraph(x):
    return _block(x) + _block(x + 1)


def _wrap(x):
    return wrap(lambda t: t.sin() * 2, x) + 1


def _run(fn, sizes, **compile_kwargs):
    compiled = torch.compile(
        fn, backend=fxsplit.Backend(capture="emulate", eager_regions=[]), **compile_kwargs
    )
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n)
            got, want = compiled(x), fn(x)
            assert torch.equal(got, want), (n, (got - want).abs().max().item())
    return fxsplit.counters.snapshot()


@pytest.mark.parametrize(
    "fn, kwargs",
    [
        (_host_cond, {"dynamic": True}),
        (_subgraph, {"fullgraph": True}),
        (_wrap, {"fullgraph": True}),
    ],
    ids=["cond_host_predicate", "invoke_subgraph", "wrap"],
)
def test_capturable_hops_are_captured_and_replayed(fn, kwargs):
    sizes = [8, 2] * 3 if fn is _host_cond else [8] * 4  # one capture key per branch
    counts = _run(fn, sizes, **kwargs)
    assert counts["captures"] == len(set(sizes))
    assert counts["replays"] == len(sizes) - 2 * len(set(sizes))


def test_a_branch_in_a_capture_key_reads_as_its_type_and_ordinal():
    """torch.cond's branch (a GraphModule) is a host value of the key, shown by its type and
    the order it was first shown in, never its code nor its address."""
    backend = fxsplit.Backend(capture="emulate", eager_regions=[])
    compiled = torch.compile(_host_cond, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (8, 2):
            compiled(torch.randn(n))
    keys = [k for pieces in backend.stats.values() for p in pieces.values() for k in p]
    branch = r"int \d+(, GraphModule #\d+)+, \d+"
    assert keys and all(re.fullmatch(branch, k) for k in keys), keys


@pytest.mark.parametrize("fn", [_tensor_cond, _while], ids=["cond_tensor_predicate", "while"])
def test_hops_that_read_a_tensor_on_the_host_run_uncaptured(fn):
    with pytest.warns(UserWarning, match=r"runs uncaptured: CaptureError: Tensor.__bool__"):
        counts = _run(fn, [8, 8, 8, 8], fullgraph=True)
    assert counts["captures"] == 0 and counts["replays"] == 0


def test_emulated_cond_replays_the_branch_frozen_at_capture():
    x = torch.randn(6)
    g = EmulatedGraph()
    out = g.capture(lambda t: torch.ops.higher_order.cond(True, _Sin(), _Cos(), (t,)), x)
    assert g.actions == (("higher_order::cond", "run+copy"),)
    x.copy_(torch.randn(6))
    g.replay()
    assert torch.equal(out[0], x.sin())


def test_emulated_auto_functionalized_replays_its_write():
    x, acc = torch.randn(5), torch.zeros(5)
    g = EmulatedGraph()
    out = g.capture(lambda t, a: auto_functionalized(_add_into._opoverload, x=t, out=a), x, acc)
    x.copy_(torch.randn(5))
    g.replay()
    assert torch.equal(out[1], x)  # the functional result of the write, recomputed
    assert torch.equal(acc, torch.zeros(5))  # auto_functionalized never writes inputs


def test_illegal_op_inside_a_hop_subgraph_is_a_capture_error():
    x, g = torch.randn(6), EmulatedGraph()
    with pytest.raises(CaptureError, match="nonzero"):
        g.capture(lambda t: torch.ops.higher_order.cond(True, _NonZero(), _NonZero(), (t,)), x)
    assert not g.captured


class _Sin(torch.nn.Module):
    def forward(self, t):
        return (t.sin(),)


class _Cos(torch.nn.Module):
    def forward(self, t):
        return (t.cos(),)


class _NonZero(torch.nn.Module):
    def forward(self, t):
        return (torch.nonzero(t).float().sum().reshape(1),)
