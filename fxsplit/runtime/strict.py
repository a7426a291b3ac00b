"""Strict binding with capture off: the same runner bug fails the same way on CPU and GPU.

With capture on, ``input_binding="strict"`` binds each runner input of a captured piece to the
caller's tensor at capture and raises :class:`~fxsplit.runtime.binding.BindingError` when a later
call of the same capture key hands another tensor. With capture off (the string backend on a CPU
machine) nothing is captured, so a runner that hands fresh tensors would pass CPU CI and fail on
the first GPU. :class:`StrictInputs` applies the same rule to the graph's runner inputs: the
first call per input shape (after ``warmup_runs`` calls) fixes their addresses; a later call of
that shape that hands another tensor raises. Values fxsplit produced (earlier outputs) and the
arguments of frames Dynamo resumed after a graph break are exempt, as with capture on.
"""

from __future__ import annotations

import torch

from fxsplit.runtime.binding import BindingError, is_static_input


class StrictInputs:
    """Wraps a split graph's callable; checks runner-input addresses per input shape.

    Args:
        forward: the stitched module's ``forward``.
        placeholders: the graph's placeholder nodes, in call order.
        graph_id: the graph's name in messages.
        warmup_runs: calls per shape before addresses are fixed (as capture would).
        session: the backend's :class:`~fxsplit.runtime.graph_runtime.CaptureSession` (what
            fxsplit produced; this graph's outputs are recorded there too).

    Raises (when called):
        BindingError: a runner input moved since its shape's addresses were fixed.
    """

    def __init__(self, forward, placeholders, graph_id: str, warmup_runs: int, session):
        self._forward = forward
        self._graph_id = graph_id
        self._warmup_runs = warmup_runs
        self._session = session
        self._inputs = [
            (i, node.name, _source(node))
            for i, node in enumerate(placeholders)
            if isinstance(node.meta.get("example_value"), torch.Tensor)
            and not is_static_input(node)
        ]
        self._seen: dict[tuple, int] = {}
        self._fixed: dict[tuple, tuple[int, ...]] = {}

    def __call__(self, *args):
        key = tuple(tuple(args[i].shape) for i, _, _ in self._inputs)
        ptrs = tuple(args[i].data_ptr() for i, _, _ in self._inputs)
        fixed = self._fixed.get(key)
        if fixed is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            if seen > self._warmup_runs:
                self._fixed[key] = ptrs
        elif fixed != ptrs:
            for (i, name, source), was, now in zip(self._inputs, fixed, ptrs, strict=True):
                if was != now and not self._session.produced(args[i]):
                    raise BindingError(
                        f"{self._graph_id}: input {name!r} from {source} is at 0x{now:x}, but "
                        f"the first call of this shape (which capture would have captured) "
                        f"read 0x{was:x}; with input_binding='strict' a runner must hand the "
                        "same tensor every step (use persistent buffers, or "
                        "input_binding='copy'). Checked with capture off too, so a CPU run "
                        "fails where a GPU run would."
                    )
        out = self._forward(*args)
        self._session.outputs[id(self)] = frozenset(
            o.untyped_storage().data_ptr() for o in out if isinstance(o, torch.Tensor)
        )
        return out


def _source(node) -> str:
    grapharg = node.meta.get("grapharg")
    return str(grapharg.source.name) if grapharg is not None else str(node.target)
