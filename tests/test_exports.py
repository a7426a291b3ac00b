"""Captured outputs exported to NumPy or DLPack hold their step's values (runtime/exports.py).

An array or a capsule keeps the memory's address, not the tensor, so no move of the tensor's
storage after the export reaches it: before, each one made from a returned output or a loan read
what the next replay wrote there (wrong by 1.11 kept, 1.67 fed back as an input), with a warning
saying the values were kept. Each case runs under ``capture="emulate"`` and asserts replays.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.utils.dlpack
from torch import nn

import fxsplit
from fxsplit import counters
from fxsplit.runtime.output_lifetime import can_swap

pytestmark = [
    pytest.mark.usefixtures("fresh_capture_state"),
    pytest.mark.skipif(not can_swap(), reason="this torch hands outputs out as clones"),
]

D = 8


class _Mlp(nn.Module):
    """``Linear(D, D)``, tanh, ``Linear(D, D)``: one captured piece; input ``[rows, D]``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.requires_grad_(False)

    def forward(self, x):
        return self.b(self.a(x).tanh())


def _x(step):
    return torch.randn(3, D, generator=torch.Generator().manual_seed(step))


EXPORTS = {
    "numpy": lambda t: t.numpy(),
    "asarray": np.asarray,
    "np.from_dlpack": np.from_dlpack,
    "to_dlpack": lambda t: torch.from_dlpack(torch.utils.dlpack.to_dlpack(t)),
    "torch.to_dlpack": lambda t: torch.from_dlpack(torch.to_dlpack(t)),
    "__dlpack__": lambda t: torch.from_dlpack(t.__dlpack__()),
}


def _compiled(model):
    backend = fxsplit.Backend(capture="emulate", eager_regions=[])
    return torch.compile(model, backend=backend, dynamic=True)


@pytest.mark.parametrize("export", EXPORTS.values(), ids=EXPORTS)
def test_an_export_of_each_steps_output_holds_that_steps_values(export):
    """``arrays.append(model(x).numpy())`` every step, the tensors dropped: each export moved
    its output out of the pool, so no later replay writes it; nothing is warned (nothing stale
    is held)."""
    model = _Mlp()
    compiled = _compiled(_Mlp())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [export(compiled(_x(step))) for step in range(6)]
        want = [model(_x(step)) for step in range(6)]
    assert counters.snapshot()["replays"] >= 3
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(torch.as_tensor(g), w), step


def test_an_exported_output_fed_back_after_another_call_reads_its_own_step():
    """``a = model(x).numpy(); model(x2); model(torch.from_numpy(a))``: the array was made
    before the second call's replay, which would have written its memory."""
    model, compiled = _Mlp(), _compiled(_Mlp())
    with torch.no_grad():
        for step in range(3):
            compiled(_x(step))  # warm-up, capture, a replay
        array = compiled(_x(10)).numpy()
        compiled(_x(11))
        got = compiled(torch.from_numpy(array))
        want = model(model(_x(10)))
    assert counters.snapshot()["replays"] >= 3
    assert torch.equal(got, want)


def test_an_exported_output_shares_memory_with_its_tensor():
    """The export stays a view of the tensor, as in eager: a write through the array is seen by
    the tensor, and the next call does not overwrite either."""
    compiled = _compiled(_Mlp())
    with torch.no_grad():
        for step in range(3):
            compiled(_x(step))
        out = compiled(_x(3))
        array = out.numpy()
        array[0, 0] = 7.0
        kept = out.clone()
        compiled(_x(4))
    assert out[0, 0].item() == 7.0
    assert torch.equal(out, kept) and torch.equal(torch.from_numpy(array), kept)


ARRAYS: list[np.ndarray] = []


@torch.library.custom_op("fxsplit_exports::keep_array", mutates_args=())
def keep_array(h: torch.Tensor) -> torch.Tensor:
    """Keeps a NumPy view of its argument past the call (a drafter caching the hidden state on
    the host side); returns ``h * 2``."""
    ARRAYS.append(h.numpy())
    return h * 2


@keep_array.register_fake
def _(h):
    return torch.empty_like(h)


class _KeepsArray(_Mlp):
    """``_Mlp`` with ``keep_array`` between its layers, in an eager piece (a splitting op)."""

    def forward(self, x):
        return self.b(torch.ops.fxsplit_exports.keep_array(self.a(x).tanh()))


def test_an_eager_op_keeping_a_numpy_view_of_a_lent_output_reads_its_step():
    """The op is lent piece_0's output; its array, made within the call, keeps that step's
    values although piece_0 replays every later step over the same memory."""
    model = _KeepsArray()
    compiled = torch.compile(
        _KeepsArray(),
        backend=fxsplit.Backend(
            capture="emulate", eager_regions=[], splitting_ops=["fxsplit_exports::keep_array"]
        ),
        dynamic=True,
    )
    ARRAYS.clear()
    with torch.no_grad():
        for step in range(6):
            model(_x(step))
        want = [a.copy() for a in ARRAYS]
        ARRAYS.clear()
        for step in range(6):
            compiled(_x(step))
    got, ARRAYS[:] = list(ARRAYS), []
    assert counters.snapshot()["replays"] >= 2 * 3
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_numpy_export_inside_a_capture_is_still_an_illegal_host_read():
    """The wrapper ``Tensor.numpy`` becomes once a pool opens is what a torch-function mode
    sees: the emulator's capture still names it as a host read."""
    from fxsplit.runtime.emulator import CaptureError, EmulatedGraph

    _compiled(_Mlp())(_x(0))  # a pool opens: the wrappers are in place
    with pytest.raises(CaptureError, match="numpy"):
        EmulatedGraph().capture(lambda t: (t * 2, t.numpy()), torch.randn(4))
