"""Compiled pieces on their capture step run once: their capture legality is checked on fake
tensors, so an op with side effects (random numbers, a collective, a counter) is not executed twice,
and the capture step's numbers are eager's."""

from __future__ import annotations

import pytest
import torch

import fxsplit

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

CALLS = [0]


@torch.library.custom_op("fxsplit_cc::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    """Draws random numbers and counts its executions."""
    CALLS[0] += 1
    return x + torch.rand_like(x)


@noisy.register_fake
def _(x):
    return torch.empty_like(x)


def _f(x):
    h = torch.ops.fxsplit_cc.noisy(x.sin()) * 2
    with fxsplit.region(fxsplit.ATTENTION):
        h = h.cos()
    return h + 1


def test_a_compiled_piece_runs_once_per_call_and_its_capture_step_draws_eagers_numbers(tmp_path):
    backend = fxsplit.Backend(
        capture="emulate", compile_pieces="inductor", cache_dir=str(tmp_path), warmup_runs=1
    )
    model = torch.compile(_f, backend=backend, dynamic=False)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for step in range(5):
            torch.manual_seed(step)
            want = _f(x)
            torch.manual_seed(step)
            before = CALLS[0]
            got = model(x)
            assert CALLS[0] - before == 1, step  # one execution, the capture step's included
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    outcomes = {r.outcome for r in backend.compiled[0].compiled_pieces}
    assert outcomes - {"eager"}, outcomes  # a piece really ran compiled
    stats = backend.stats["graph_0"]
    assert sum(c.get("captures", 0) for p in stats.values() for c in p.values()) >= 1
    assert sum(c.get("replays", 0) for p in stats.values() for c in p.values()) >= 1
