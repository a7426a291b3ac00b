"""Global state nodes: grad mode and autocast blocks, made piece-local.

Dynamo lowers ``torch.no_grad()`` and ``torch.autocast`` inside a graph to
``torch._C._set_grad_enabled(v)`` and ``_enter_autocast(...)`` / ``_exit_autocast(ctx)`` nodes. A
piece boundary may fall inside such a block, and a replayed captured piece runs none of its
Python. So every piece re-enters the blocks open at its start (prologue) and leaves the blocks
open at its end (epilogue): between pieces the state is always the state at graph entry, which
Dynamo guards on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast
from torch.fx import Node

SET_GRAD = torch._C._set_grad_enabled
ENTER_AUTOCAST = _enter_autocast
EXIT_AUTOCAST = _exit_autocast
STATE_TARGETS = frozenset({SET_GRAD, ENTER_AUTOCAST, EXIT_AUTOCAST})


@dataclass
class PieceState:
    """State to restore around one piece.

    Attributes:
        grad_in: grad mode to set at piece start, None when it equals the graph-entry mode.
        autocast_in: autocast enter nodes open at piece start, outermost first.
        grad_out: grad mode in force at piece end, None when it equals the graph-entry mode.
        autocast_out: autocast enter nodes open at piece end, outermost first.
    """

    grad_in: bool | None = None
    autocast_in: tuple[Node, ...] = ()
    grad_out: bool | None = None
    autocast_out: tuple[Node, ...] = field(default_factory=tuple)


def track(pieces: list[list[Node]], grad_at_entry: bool) -> list[PieceState]:
    """Walk the pieces in order and give each its :class:`PieceState`."""
    grad: bool | None = None
    open_blocks: list[Node] = []
    states = []
    for nodes in pieces:
        state = PieceState(grad_in=grad, autocast_in=tuple(open_blocks))
        for node in nodes:
            if node.op != "call_function":
                continue
            if node.target is SET_GRAD:
                value = bool(node.args[0])
                grad = None if value == grad_at_entry else value
            elif node.target is ENTER_AUTOCAST:
                open_blocks.append(node)
            elif node.target is EXIT_AUTOCAST and node.args[0] in open_blocks:
                open_blocks.remove(node.args[0])
        state.grad_out = grad
        state.autocast_out = tuple(open_blocks)
        states.append(state)
    return states
