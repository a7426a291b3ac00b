"""Model state kept between calls (buffers the model rebinds, weights swapped between calls),
each call compared bit for bit with the same model run eagerly."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxsplit

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

D = 4


class _Rebinding(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, D)
        self.register_buffer("t", torch.zeros(D))
        self.requires_grad_(False)

    def forward(self, x):
        h = self.lin(x) + self.t
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        self.t = self.t + h.sum(0)
        return h * 3


def _x(step):
    return torch.randn(3, D, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_weights_reloaded_the_step_after_a_buffer_was_found_rebound_are_followed(runner):
    """Step 1 finds ``t`` rebound and recaptures at once (no warm-up); step 2 reloads the weights
    with load_state_dict(assign=True). The rebinding forgot the weights' addresses, so step 2
    took their move for the first look and replayed the graph captured on the old weights."""
    eager = _Rebinding()
    net = copy.deepcopy(eager)
    backend = fxsplit.Backend(capture="emulate", warmup_runs=0, runner=runner, input_binding="copy")
    model = torch.compile(net, backend=backend, dynamic=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", fxsplit.FxsplitWarning)
        for step in range(5):
            if step == 2:
                g = torch.Generator().manual_seed(7)
                new = {"lin.weight": torch.randn(D, D, generator=g)}
                new["lin.bias"] = torch.randn(D, generator=g)
                for m in (eager, net):
                    m.load_state_dict(copy.deepcopy(new), strict=False, assign=True)
            x = _x(step)
            want, got = eager(x), model(x)
            assert torch.equal(got, want), (step, (got - want).abs().max().item())
            assert torch.equal(net.t, eager.t), step
    assert fxsplit.counters.snapshot()["replays"] > 0
