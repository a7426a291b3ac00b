"""The shared memory pool's ordering rule, on the emulator's pool (which reuses memory as the
caching allocator does): graphs replay in capture order within a step, or are recaptured first.

Each trigger of an out-of-order replay is run twice: with fxsplit's rule (numbers equal eager,
and the piece was recaptured: its ``reorders`` counter) and with the rule switched off
(``MemoryPool.in_order`` always true), where the emulator must show the wrong number a CUDA pool
would give, so the test cannot pass by accident.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxsplit
from fxsplit.runtime import captured as captured_module
from fxsplit.runtime.binding import Refused as _Refused
from fxsplit.runtime.graph_runtime import GraphRuntime
from fxsplit.runtime.pool import MemoryPool
from tests.nets import KeyFree

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

D = 16  # KeyFree's width: a (D, D) float32 block is 1 KiB


def _run(model_fn, calls, ordered: bool, late=None, **options):
    """Run ``calls`` (argument tuples) through eager and compiled copies; returns the steps whose
    outputs differed, and the backend. ``late`` makes piece_0 capture one step later than it
    would: ``"refused"`` (its first capture is refused), ``"warmup"`` (one more warm-up, as a
    compiled piece gets on CUDA)."""
    eager, net = model_fn(), model_fn()
    backend = fxsplit.Backend(capture="emulate", warmup_runs=0, **options)
    compiled = torch.compile(net, backend=backend, dynamic=True)
    wrong = []
    patch = pytest.MonkeyPatch()
    if not ordered:
        patch.setattr(MemoryPool, "in_order", lambda self, order: True)
    if late == "refused":
        capture = captured_module.capture
        refused = set()

        def refuse_once(piece, key, inputs):
            if piece.name == "piece_0" and piece.name not in refused:
                refused.add(piece.name)
                raise _Refused("refused once (test)")
            return capture(piece, key, inputs)

        patch.setattr(captured_module, "capture", refuse_once)
    elif late == "warmup":
        install = GraphRuntime._install

        def one_more_warmup(self):
            pieces = install(self)
            pieces[0].min_warmups += 1
            return pieces

        patch.setattr(GraphRuntime, "_install", one_more_warmup)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step, args in enumerate(calls):
                want = eager(*[a.clone() for a in args])
                got = compiled(*[a.clone() for a in args])
                if not all(torch.equal(w, g) for w, g in zip(want, got, strict=True)):
                    wrong.append(step)
    finally:
        patch.undo()
    return wrong, backend


def _count(backend, name):
    return sum(
        c.get(name, 0) for g in backend.stats.values() for p in g.values() for c in p.values()
    )


def _x(rows, seed):
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(seed))


def test_a_piece_keyed_without_the_token_count_is_recaptured_after_a_new_size():
    calls = [(_x(b, s),) for s, b in enumerate([4, 4, 8, 8, 4, 8, 4])]
    wrong, backend = _run(KeyFree, calls, ordered=True)
    assert wrong == [] and _count(backend, "reorders") >= 1 and _count(backend, "replays") > 0
    wrong, _ = _run(KeyFree, calls, ordered=False)
    assert wrong, "the emulated pool no longer reproduces the out-of-order overwrite"


@pytest.mark.parametrize("late", ["refused", "warmup"])
def test_a_piece_captured_a_step_after_the_pieces_after_it_is_recaptured_in_order(late):
    """piece_0 captures at step 2, piece_2 at step 1: piece_0's output may sit in piece_2's
    scratch. Triggers: a capture refused once (its inputs' layout), and the extra warm-up of a
    compiled piece (Triton compiles on its first launch) under ``warmup_runs=0``."""
    calls = [(_x(4, s),) for s in range(6)]
    wrong, backend = _run(KeyFree, calls, ordered=True, late=late)
    assert wrong == [] and _count(backend, "reorders") >= 1 and _count(backend, "replays") > 0
    wrong, _ = _run(KeyFree, calls, ordered=False, late=late)
    assert wrong, "the emulated pool no longer reproduces the out-of-order overwrite"
