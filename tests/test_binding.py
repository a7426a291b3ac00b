"""How captured pieces bind their inputs (``fxsplit/runtime/binding.py``): views of parameters
and buffers bound by address, one static buffer per caller tensor shared by every capture key and
piece, and strict binding checked the same way with capture on and off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxsplit

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

D = 8


class _LayerCache(nn.Module):
    """Each call writes a layer's slice of a cache buffer the caller hands in as a view, and reads
    the whole buffer (so the buffer is a graph input too, sharing storage with that view)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 4, D))
        self.w = nn.Parameter(torch.randn(D, D), requires_grad=False)

    def forward(self, x, slot):
        slot.copy_(torch.tanh(x @ self.w))  # the piece writes the caller's view of the buffer
        with fxsplit.region(fxsplit.ATTENTION):
            h = slot.sin() + self.cache.sum(0)
        return h * 2


def _replays(backend):
    return sum(
        c.get("replays", 0) for g in backend.stats.values() for p in g.values() for c in p.values()
    )


def test_a_runner_input_viewing_a_buffer_the_piece_writes_is_bound_by_address_and_replays():
    model, eager = _LayerCache(), _LayerCache()
    eager.load_state_dict(model.state_dict())
    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for step in range(5):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
            got = compiled(x, model.cache[0])
            want = eager(x, eager.cache[0])
            assert torch.equal(got, want), step
            assert torch.equal(model.cache, eager.cache), step
    assert _replays(backend) == 2 * 3  # two captured pieces
    assert not any(p.get("refused") for g in backend.stats.values() for p in g.values()), (
        backend.stats
    )


def test_a_moved_view_of_a_buffer_runs_uncaptured_for_that_call():
    model, eager = _LayerCache(), _LayerCache()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=fxsplit.Backend(capture="emulate"))
    with torch.no_grad(), pytest.warns(UserWarning, match="view of a parameter or buffer"):
        for step in range(5):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
            layer = 1 if step == 4 else 0  # another layer's slice: another address
            assert torch.equal(compiled(x, model.cache[layer]), eager(x, eager.cache[layer]))
            assert torch.equal(model.cache, eager.cache), step


def test_a_cache_handed_in_as_a_plain_argument_is_held_once_across_capture_keys():
    """Under copy binding a KV cache handed in as an argument is copied into one static buffer
    that every capture key of every piece shares, not one per key."""
    cache = torch.randn(64, 32, D)  # 64 KiB

    def f(x, kv):
        h = torch.einsum("bd,ntd->bn", x, kv).sin()
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        return h @ kv[:, 0]

    backend = fxsplit.Backend(capture="emulate", input_binding="copy")
    compiled = torch.compile(f, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (2, 3, 4, 5) * 3:
            x = torch.randn(n, D)
            assert torch.equal(compiled(x, cache), f(x, cache)), n
    runtime = backend.runtimes[0]
    held = {id(b.static) for b in runtime._buffers.values() if b.static.numel() == cache.numel()}
    assert len(held) == 1
    assert _replays(backend) > 0
    # copied once (the first capture), never again: the same tensor with the same version
    copies = sum(p.stats.copies_by_input.get("l_kv_", 0) for p in runtime.pieces)
    assert copies == 0, copies


def test_two_inputs_that_were_one_tensor_at_capture_are_refused_when_they_differ():
    """Bound to one shared buffer at capture (the same caller view twice), two different tensors
    later must not be copied into it one over the other. Dynamo guards on such aliasing; a plain
    torch.fx graph handed to the backend does not."""

    def f(a, b):
        return (a.sin() + b.cos()) * 2

    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def g(a, b):
        return (f(a, b),)

    gm = torch.fx.symbolic_trace(g)
    x = torch.randn(3, D)
    FakeTensorProp(gm).propagate(x, x)
    for node in gm.graph.nodes:  # the traced values, as Dynamo records them
        node.meta["example_value"] = node.meta.get("val")
    backend = fxsplit.Backend(capture="emulate", eager_regions=[], input_binding="copy")
    run = backend(gm, [x, x])
    with torch.no_grad(), pytest.warns(UserWarning, match="one tensor at capture"):
        for _ in range(3):
            assert torch.equal(run(x, x)[0], f(x, x))
        y = torch.randn(3, D)
        assert torch.equal(run(x, y)[0], f(x, y))
    assert _replays(backend) > 0
