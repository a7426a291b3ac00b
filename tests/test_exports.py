"""Captured outputs exported to NumPy or DLPack (docs/capture.md, "Exports").

An array or a capsule keeps the memory's address, not the tensor: made from a returned output or
a loan, it shares the pool's memory as eager's array shares the tensor's, until that memory is
next written; a clone keeps its values. fxsplit patches nothing in torch to see exports: before,
it wrapped ``Tensor.numpy`` and the DLPack entry points while a pool was open, and unrelated
compiled code returning an array recursed in Dynamo, ``.numpy()`` of any tensor cost 3.3x, and
an eager op writing its loan through NumPy wrote memory the export had moved the loan away from
(wrong by up to 0.60). Each case runs under ``capture="emulate"`` and asserts replays.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.dlpack
from torch import nn

import fxsplit
from fxsplit import counters
from fxsplit.runtime.emulation.emulator import CaptureError, EmulatedGraph
from fxsplit.runtime.memory.output_lifetime import can_swap

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

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


def _compiled(model, **options):
    backend = fxsplit.Backend(capture="emulate", eager_regions=[], **options)
    return torch.compile(model, backend=backend, dynamic=True)


def test_a_pool_changes_nothing_in_torch():
    """Opening a pool leaves torch's export entry points as they are."""
    originals = (torch.Tensor.numpy, torch.Tensor.__dlpack__, torch.to_dlpack)
    compiled = _compiled(_Mlp())
    with torch.no_grad():
        for step in range(3):
            compiled(_x(step))
    assert counters.snapshot()["captures"] > 0
    assert (torch.Tensor.numpy, torch.Tensor.__dlpack__, torch.to_dlpack) == originals
    assert torch.utils.dlpack.to_dlpack is torch.to_dlpack


def test_unrelated_compiled_code_returning_an_array_runs_as_without_fxsplit():
    """Once a pool was open, a function compiled with ``backend="eager"`` that hands a traced
    NumPy array back died with RecursionError (Dynamo traced into fxsplit's wrapper)."""
    compiled = _compiled(_Mlp())
    with torch.no_grad():
        for step in range(3):
            compiled(_x(step))

    @torch.compile(backend="eager")
    def double(t):
        return (t * 2).numpy()

    x = torch.randn(4)
    assert np.array_equal(double(x), (x * 2).numpy())


@pytest.mark.parametrize("export", EXPORTS.values(), ids=EXPORTS)
def test_an_export_within_the_step_holds_the_steps_values(export):
    model, compiled = _Mlp(), _compiled(_Mlp())
    with torch.no_grad():
        for step in range(5):
            got = export(compiled(_x(step)))
            assert torch.equal(torch.as_tensor(got), model(_x(step))), step
    assert counters.snapshot()["replays"] >= 3


def test_an_export_of_a_clone_or_of_a_held_output_keeps_its_values():
    """A clone is memory of its own; so is a held output once a replay moved it out of the
    pool (where torch can move a storage: 2.11 invalidates it), and an array made of it
    afterwards keeps its values too."""
    model, compiled = _Mlp(), _compiled(_Mlp())
    with torch.no_grad():
        clones = [compiled(_x(step)).clone().numpy() for step in range(4)]
        held = [compiled(_x(step)) for step in range(4, 8)]
        compiled(_x(8))  # every held output has moved out of the pool now
        arrays = [out.numpy() for out in held] if can_swap() else []
        compiled(_x(9))
    assert counters.snapshot()["replays"] >= 5
    for step, array in enumerate([*clones, *arrays]):
        assert torch.equal(torch.from_numpy(array), model(_x(step))), step


@torch.library.custom_op("fxsplit_exports::double_through_numpy", mutates_args=("h",))
def double_through_numpy(h: torch.Tensor) -> None:
    """Doubles its argument in place through a NumPy view (as an engine's CPU kernel might)."""
    array = h.numpy()
    array *= 2


@double_through_numpy.register_fake
def _(h):
    return None


class _WritesThroughNumpy(_Mlp):
    """``_Mlp`` whose hidden state an eager op (a splitting op) doubles through NumPy."""

    def forward(self, x):
        h = self.a(x).tanh()
        torch.ops.fxsplit_exports.double_through_numpy(h)
        return self.b(h)


def test_an_eager_op_writing_its_loan_through_numpy_reaches_the_pieces_after_it():
    """The op is lent piece_0's output and writes it through a NumPy view within its call: the
    write lands in the pool's memory, which piece_2 reads (before, the export moved the loan
    out of the pool first and piece_2 read the unwritten values: wrong by up to 0.60)."""
    model = _WritesThroughNumpy()
    compiled = _compiled(
        _WritesThroughNumpy(), splitting_ops=["fxsplit_exports::double_through_numpy"]
    )
    with torch.no_grad():
        for step in range(6):
            assert torch.equal(compiled(_x(step)), model(_x(step))), step
    assert counters.snapshot()["replays"] >= 2 * 3


def test_a_numpy_export_inside_a_capture_is_an_illegal_host_read():
    with pytest.raises(CaptureError, match="numpy"):
        EmulatedGraph().capture(lambda t: (t * 2, t.numpy()), torch.randn(4))
