"""Global state nodes: grad mode and context-manager blocks, made piece-local.

Dynamo lowers ``torch.no_grad()`` inside a graph to ``torch._C._set_grad_enabled(v)`` nodes, and
context managers with an enter/exit pair (``torch.autocast``, ``torch.inference_mode``) to an
``_enter_<name>(...)`` node whose result an ``_exit_<name>(ctx)`` node takes: that pairing of
Dynamo's own lowering is how a block is recognised, whatever its name. A piece boundary may
fall inside such a block, and a replayed captured piece runs none of its Python. So every piece
re-enters the blocks open at its start (prologue) and leaves the blocks open at its end
(epilogue): between pieces the state is always the state at graph entry, which Dynamo guards on.

Global setters without such a pair (``torch.nn.attention.sdpa_kernel`` lowers to a setter
called once to set and once to restore) cannot be re-entered per piece; :func:`setter_spans`
finds them for the mark pass, which runs what they govern eagerly (reason ``state:<name>``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Node

SET_GRAD = torch._C._set_grad_enabled


def _name(node: Node) -> str:
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def is_enter(node: Node) -> bool:
    """An ``_enter_<name>`` node whose result an ``_exit_<name>`` node takes."""
    name = _name(node)
    if not name.startswith("_enter_"):
        return False
    exit_name = "_exit_" + name[len("_enter_") :]
    return any(_name(user) == exit_name for user in node.users)


def is_exit(node: Node) -> bool:
    """The ``_exit_<name>`` node closing an :func:`is_enter` block."""
    return (
        _name(node).startswith("_exit_")
        and bool(node.args)
        and isinstance(node.args[0], Node)
        and is_enter(node.args[0])
    )


def exit_target(enter: Node) -> object:
    """The exit function of an enter node's block."""
    exit_name = "_exit_" + _name(enter)[len("_enter_") :]
    return next(user.target for user in enter.users if _name(user) == exit_name)


def is_state_node(node: Node) -> bool:
    """Grad-mode switches and block enters/exits: they launch no kernel."""
    return node.op == "call_function" and (
        node.target is SET_GRAD or is_enter(node) or is_exit(node)
    )


@dataclass
class PieceState:
    """State to restore around one piece.

    Attributes:
        grad_in: grad mode to set at piece start, None when it equals the graph-entry mode.
        blocks_in: enter nodes of the blocks open at piece start, outermost first.
        grad_out: grad mode in force at piece end, None when it equals the graph-entry mode.
        blocks_out: enter nodes of the blocks open at piece end, outermost first.
    """

    grad_in: bool | None = None
    blocks_in: tuple[Node, ...] = ()
    grad_out: bool | None = None
    blocks_out: tuple[Node, ...] = field(default_factory=tuple)


def track(pieces: list[list[Node]], grad_at_entry: bool) -> list[PieceState]:
    """Walk the pieces in order and give each its :class:`PieceState`."""
    grad: bool | None = None
    open_blocks: list[Node] = []
    states = []
    for nodes in pieces:
        state = PieceState(grad_in=grad, blocks_in=tuple(open_blocks))
        for node in nodes:
            if node.op != "call_function":
                continue
            if node.target is SET_GRAD:
                value = bool(node.args[0])
                grad = None if value == grad_at_entry else value
            elif is_enter(node):
                open_blocks.append(node)
            elif is_exit(node) and node.args[0] in open_blocks:
                open_blocks.remove(node.args[0])
        state.grad_out = grad
        state.blocks_out = tuple(open_blocks)
        states.append(state)
    return states


def setter_spans(nodes: list[Node]) -> dict[Node, str]:
    """Nodes governed by a global setter that has no enter/exit pair, with the setter's name.

    A setter is a call of a Python function (not an op: no aten op of that name) that returns
    nothing, has no users and takes no tensor, called at least twice in the graph (set, then
    restore); every node from its first call to its last is governed by it.
    """
    calls: dict[object, list[int]] = {}
    for i, node in enumerate(nodes):
        if is_setter(node):
            calls.setdefault(node.target, []).append(i)
    governed: dict[Node, str] = {}
    for target, where in calls.items():
        if len(where) < 2:
            continue
        for node in nodes[where[0] : where[-1] + 1]:
            governed.setdefault(node, getattr(target, "__name__", str(target)))
    return governed


def is_setter(node: Node) -> bool:
    """A call of a global setter (see :func:`setter_spans`): a Python function, not an op, that
    returns nothing, has no users and takes no tensor (``torch.set_default_dtype``)."""
    if node.op != "call_function" or node.users or is_state_node(node):
        return False
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    name = getattr(target, "__name__", None)
    if name is None or getattr(target, "__module__", None) == "_operator":
        return False
    if node.meta.get("example_value", None) is not None or hasattr(torch.ops.aten, name):
        return False
    return not any(
        isinstance(a.meta.get("example_value"), torch.Tensor) for a in node.all_input_nodes
    )
