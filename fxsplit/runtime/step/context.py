"""What a captured piece reads of its graph at run time (a :class:`GraphContext`), and nothing
more: the graph's capture options, its pool and session, this step's capture gate, and the
memory the graph's pieces share (their outputs in the pool, fxsplit's own input buffers, the
parameters read by address). The :class:`~fxsplit.runtime.step.graph_runtime.GraphRuntime` that owns
the pieces fills it; a piece never reaches the runtime itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fxsplit.runtime.inputs.static_buffers import OwnBuffers

if TYPE_CHECKING:
    from fxsplit.runtime.inputs.static_inputs import StaticInputs
    from fxsplit.runtime.memory.pool import MemoryPool
    from fxsplit.runtime.step.session import CaptureSession
    from fxsplit.split_result import Split

__all__ = ["GraphContext"]


@dataclass(eq=False)
class GraphContext:
    """One graph's run-time facts its captured pieces share.

    Attributes:
        graph_id: the graph's name in plans, messages and stats.
        mode: ``"cuda"``, ``"emulate"`` or ``"check"`` (capture off, strict binding checked).
        binding: the ``input_binding`` option (:func:`fxsplit.runtime.inputs.binding.bind`).
        warmup_runs / max_captured_keys / on_capture_error / verify: the options of those names.
        capture_sizes: the ``capture_sizes`` option as a set, or None.
        pool: the :class:`~fxsplit.runtime.memory.pool.MemoryPool` (None when checking).
        session: the backend's :class:`~fxsplit.runtime.step.session.CaptureSession`.
        split: the graph's :class:`~fxsplit.split_result.Split` (the replay watch explains a piece
            that never replays in terms of its traced graph).
        statics: the graph's :class:`~fxsplit.runtime.inputs.static_inputs.StaticInputs`.
        capture_step: this call may capture and replay (set by the runtime every call).
        calls: the graph's calls so far, this one included.
        repeat: how many calls of the graph came before this one in the step (more than none
            only inside another graph's call, which never starts a step): its pieces' entries
            are keyed apart (:class:`~fxsplit.runtime.piece.stats.Repeat`).
        epoch: changes wherever a caller's tensor may have been written where its version
            counter does not see it: each call of the graph, and after each eager piece that
            may write and each uncaptured run of a piece (what :class:`~fxsplit.runtime.
            static_buffers.OwnBuffer` copied counts only within one epoch; a write-back forgets
            the copies of the memory it wrote, :meth:`~fxsplit.runtime.inputs.static_buffers.
            OwnBuffers.forget_over`).
        static_outputs: ``id`` -> the captured pieces' outputs in fxsplit's memory.
        buffers: fxsplit's own buffers for the caller's tensors.
    """

    graph_id: str
    mode: str
    binding: str
    warmup_runs: int
    max_captured_keys: int
    on_capture_error: str
    verify: bool
    capture_sizes: frozenset | None
    pool: MemoryPool | None
    session: CaptureSession
    split: Split
    statics: StaticInputs
    capture_step: bool = False
    calls: int = 0
    repeat: int = 0
    epoch: int = 0
    static_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    buffers: OwnBuffers = field(default_factory=OwnBuffers)

    def is_frozen_memory(self, value: torch.Tensor) -> bool:
        """Whether ``value`` lives in a parameter's or buffer's storage of the graph."""
        return self.statics.is_frozen_memory(value)
