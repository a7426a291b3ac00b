"""Facts about torch's functional collectives (``torch.distributed._functional_collectives``).

A functional collective is two ops: the collective itself (``all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...), which issues the communication and
returns a tensor that is not ready yet, and ``wait_tensor`` on that tensor, after which it may be
read. Dynamo records both as ``torch.ops._c10d_functional.<op>`` nodes.

No op tag marks an op as a collective, so the namespace is the fact used here: torch registers
every functional collective, and only those, under ``_c10d_functional``, and the wait is the op
that namespace calls ``wait_tensor`` (the contract stated in
``torch/distributed/_functional_collectives.py``: a collective's result is read only after
``wait_tensor`` on it).
"""

from __future__ import annotations

import functools

import torch
from torch.fx import Node

__all__ = [
    "NAMESPACE",
    "group_name",
    "holds_until_wait",
    "is_collective",
    "is_collective_node",
    "is_wait_node",
]

NAMESPACE = "_c10d_functional"
_WAIT = "wait_tensor"


def _namespace_and_name(op: object) -> tuple[str, str] | None:
    # Asked for every node of every graph: answered once per op.
    try:
        return _names_of(op)
    except TypeError:  # an unhashable target
        return _names_of.__wrapped__(op)


@functools.lru_cache(maxsize=4096)
def _names_of(op: object) -> tuple[str, str] | None:
    if isinstance(op, torch._ops.OpOverload):
        return op.namespace, op._schema.name.partition("::")[2]
    if isinstance(op, torch._ops.OpOverloadPacket):
        ns, _, name = op._qualified_op_name.partition("::")
        return ns, name
    return None


def is_collective(op: object) -> bool:
    """Whether ``op`` (an OpOverload or packet) issues a functional collective (not the wait)."""
    names = _namespace_and_name(op)
    return names is not None and names[0] == NAMESPACE and names[1] != _WAIT


def holds_until_wait(op: object) -> bool:
    """Whether ``op`` is a collective whose work handle holds its tensors until they are waited
    for: a functional collective or the ``c10d`` op its kernel issues (torch registers the
    process group's ops under ``c10d``). Such a hold is no kept argument."""
    names = _namespace_and_name(op)
    return names is not None and names[0] in (NAMESPACE, "c10d")


def is_collective_node(node: Node) -> bool:
    """Whether the FX node calls a functional collective (not the wait)."""
    return node.op == "call_function" and is_collective(node.target)


def is_wait_node(node: Node) -> bool:
    """Whether the FX node is ``_c10d_functional.wait_tensor``."""
    return node.op == "call_function" and _namespace_and_name(node.target) == (NAMESPACE, _WAIT)


def group_name(node: Node) -> str | None:
    """The process group name a collective node communicates over (its ``group_name``
    argument), or None where the node carries none."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == "group_name":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
            return value if isinstance(value, str) else None
    return None
