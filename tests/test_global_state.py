"""Global state inside a graph, handled as one kind: blocks Dynamo lowers to enter/exit pairs are
re-entered per piece; setters without a pair keep what they govern eager (``state:<name>``)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxsplit
from fxsplit import counters

pytestmark = pytest.mark.usefixtures("fresh_capture_state")


@torch.library.custom_op("fxsplit_state::fresh", mutates_args=())
def fresh(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 + 1


@fresh.register_fake
def _(x):
    return torch.empty_like(x)


def _backend(**options):
    return fxsplit.Backend(capture="emulate", splitting_ops=["fxsplit_state::fresh"], **options)


def test_inference_mode_block_spanning_pieces():
    def f(x):
        with torch.inference_mode():
            h = torch.ops.fxsplit_state.fresh(x * 2) + 1
            inside = torch.is_inference_mode_enabled()
        return h.sin(), inside

    model = torch.compile(f, backend=_backend())
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(2, 3)
            (got, inside), (expected, _) = model(x), f(x)
            assert torch.equal(got, expected) and inside, step
            assert not torch.is_inference_mode_enabled()
    assert counters.snapshot()["replays"] > 0


def test_autocast_block_spanning_pieces_still_re_entered():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.ops.fxsplit_state.fresh(x @ w)
            y = h @ w
        return y.float()

    model = torch.compile(f, backend=_backend())
    with torch.no_grad():
        for step in range(4):
            x, w = torch.randn(4, 8), torch.randn(8, 8)
            got, expected = model(x, w), f(x, w)
            assert got.dtype == expected.dtype and torch.equal(got, expected), step
    assert counters.snapshot()["replays"] > 0


def test_sdpa_kernel_keeps_what_it_governs_eager_in_one_piece():
    def f(q):
        h = q * 2
        with sdpa_kernel(SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(h, h, h) * 3
        return o + 1

    backend = fxsplit.Backend(capture="emulate")  # the sdpa preset: attention
    model = torch.compile(f, backend=backend)
    with torch.no_grad():
        for step in range(4):
            q = torch.randn(1, 2, 4, 8)
            assert torch.equal(model(q), f(q)), step
    plan = backend.plans[0]
    governed = [p for p in plan.pieces if any(r.startswith("state:") for r in p.reasons)]
    assert len(governed) == 1 and governed[0].kind == "eager", plan.format()
    assert "state:_sdpa_kernel" in governed[0].reasons
    assert [p.kind for p in plan.pieces].count("captured") >= 1
    assert counters.snapshot()["replays"] > 0


@pytest.mark.parametrize("warmup_runs", [0, 1, 2])
def test_a_piece_that_changes_global_state_is_never_captured(warmup_runs):
    """A setter called once in a graph (the state it sets holds on past a graph break, where
    a later graph restores it): a replay runs none of a captured piece's Python, so the
    default dtype would stay unset for everything after it (``arange(4) * 0.1`` in float32
    where eager gives float64). A piece whose run changed the state Dynamo guards on (here
    each graph's only piece: one sets, the other restores) runs uncaptured from then on,
    counted and warned once. The state is checked after warm-up runs and after the capture
    run alike: with ``warmup_runs=0`` the capture run is the first the piece has."""

    def f(x):
        h = x.relu() * 2
        torch.set_default_dtype(torch.float64)
        wide = torch.arange(4) * 0.1 + 1e-9
        h = h + 1
        torch._dynamo.graph_break()
        later = torch.arange(4) * 0.1 + 1e-9
        torch.set_default_dtype(torch.float32)
        return h * 3, wide, later

    backend = fxsplit.Backend(capture="emulate", eager_regions=[], warmup_runs=warmup_runs)
    model = torch.compile(f, backend=backend)
    with (
        torch.no_grad(),
        pytest.warns(fxsplit.FxsplitRuntimeWarning, match=r"changes global state \(default_dtype"),
    ):
        for step in range(warmup_runs + 4):
            x = torch.randn(2, 8)
            got, want = model(x), f(x)
            assert all(a.dtype == b.dtype for a, b in zip(got, want, strict=True)), step
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step
    assert torch.get_default_dtype() == torch.float32
    pieces = [p for runtime in backend.runtimes for p in runtime.pieces]
    assert len(backend.runtimes) == 2 and pieces
    assert all(p.failed and "default_dtype" in p.failed for p in pieces), [p.failed for p in pieces]
    assert all(sum(p.stats.refusals.values()) >= 2 for p in pieces)
    assert counters.snapshot()["replays"] == 0
