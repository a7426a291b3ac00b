"""Python floats in compiled pieces (docs/compiled_pieces.md, "Floats"): Dynamo lifts float
attributes (a norm's ``eps``, a scale) to symbolic floats, which Inductor cannot compile as
such; fxsplit bakes those constant for the frame into the compiled pieces with a guard on their
values, so Dynamo never retraces the frame for them (with or without
``torch._dynamo.config.specialize_float``). Float arguments: ``tests/test_inductor.py``."""

from __future__ import annotations

import pytest
import torch

import fxsplit
from tests.replays import assert_replayed

pytestmark = pytest.mark.usefixtures("fresh_capture_state")


class _Layer(torch.nn.Module):
    def __init__(self, eps: float, scale: float):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.eps = eps
        self.scale = scale

    def forward(self, x):
        h = self.proj(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return x + h


class _Floats(torch.nn.Module):
    """Three layers, each with two float attributes of its own: six symbolic floats."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            _Layer(eps, scale) for eps, scale in ((1e-5, 0.5), (1e-6, 0.25), (1e-4, 2.0))
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Restarts:
    """A backend wrapping ``backend``: counts its calls and the retraces it asked Dynamo for."""

    def __init__(self, backend: fxsplit.Backend):
        self.backend = backend
        self.calls = 0
        self.restarts = 0

    def __call__(self, gm, example_inputs, **kwargs):
        self.calls += 1
        try:
            return self.backend(gm, example_inputs, **kwargs)
        except torch._dynamo.exc.TensorifyScalarRestartAnalysis:
            self.restarts += 1
            raise


@pytest.mark.parametrize("specialize_float", [False, True])
def test_float_attributes_cost_no_retrace(specialize_float, tmp_path):
    retraces = 0
    model = _Floats()
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(tmp_path), capture="emulate")
    spy = _Restarts(backend)
    compiled = torch.compile(model, backend=spy, dynamic=True)
    with torch._dynamo.config.patch(specialize_float=specialize_float), torch.no_grad():
        for n in (3, 4, 3, 3):
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert spy.restarts == retraces and spy.calls == retraces + 1
    assert len(backend.plans) == 1
    outcomes = [r.outcome for r in backend.compiled[0].compiled_pieces]
    assert outcomes and all(o in ("compiled", "disk", "memory") for o in outcomes), outcomes
    assert_replayed(backend)
