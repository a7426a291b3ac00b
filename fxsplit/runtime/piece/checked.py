"""Capture off with ``input_binding="strict"``: a piece that checks what a capture would bind.

The call of a key that would capture fixes the addresses of the persistent inputs; later calls
of that key are checked as a replay would bind them, and the piece always runs uncaptured. So a
runner that moves a persistent tensor fails on a CPU machine as it would at a CUDA replay.
Nothing was going to be captured, so refusals are counted, never warned or raised.
"""

from __future__ import annotations

import torch

from fxsplit.runtime.inputs import binding
from fxsplit.runtime.inputs.binding import Bind
from fxsplit.runtime.memory import provenance
from fxsplit.runtime.piece.captured import CapturedPiece
from fxsplit.runtime.piece.entry import Check, Entry
from fxsplit.runtime.piece.stats import Repeat

__all__ = ["CheckedPiece"]


class CheckedPiece(CapturedPiece):
    """Stands in for a captured piece when capture is off and binding is strict; takes
    :class:`~fxsplit.runtime.piece.captured.CapturedPiece`'s arguments.

    Raises:
        fxsplit.BindingError: at a call, a persistent (strict) runner input moved since the
            call that fixed its address.
    """

    def __call__(self, *inputs):
        context = self.context
        if context.capture_step and self.failed is None:
            key = self.key(inputs)
            if context.repeat:  # a further call of its graph in the step: bound apart
                key = Repeat(context.repeat, key)
            entry = self.entries.get(key)
            if entry is not None:
                self._check(entry, inputs)
                return self._uncaptured(inputs, key)
        return super().__call__(*inputs)

    def _refuse(self, why: str) -> None:
        self.stats.refusals[why] += 1

    def _first(self, key, inputs, before):
        """Fix the addresses of the persistent inputs (what a capture would bind) in an entry
        with no graph, and run uncaptured."""
        context = self.context
        produced = provenance.RECORD.produced
        checks = []
        for i, (spec, value) in enumerate(zip(self.specs, inputs, strict=True)):
            if not isinstance(value, torch.Tensor):
                continue
            if spec.kind == binding.RUNNER and context.is_frozen_memory(value):
                continue  # a view of a parameter or buffer: bound by address, never an error
            if binding.bind(spec, "strict", produced(value)) is Bind.ADDRESS:
                checks.append(Check(i, value, value.data_ptr(), Bind.ADDRESS, None))
        self.entries[key] = Entry(key, None, (), None, tuple(checks), (), self.stats.key(key), ())
        return self._uncaptured(inputs, key)
