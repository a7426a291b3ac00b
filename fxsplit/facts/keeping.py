"""Which inputs of an eager piece its code may keep past the call.

An eager piece handed a captured output (in the pool, written again by the next replay) must
be handed it as a loan (:mod:`fxsplit.runtime.memory.lending`) where its code may keep that memory:
a
custom op or an ``allow_in_graph`` function storing its argument (EAGLE/MTP-style reuse of the
hidden state), an op changing the tensor's layout in place, or the piece returning a view of it
to code that runs later. Code that only computes from the memory needs no loan, and a loan costs
a fresh tensor per input per call.

The facts come from torch: an op of torch's own (:func:`fxsplit.facts.op_facts.is_torch_op`: its
kernel holds no reference to its arguments past the call, in-place writes included) cannot keep
an argument, nor can indexing (``operator.getitem``: aten's reads of a tensor, or the element of
a tuple of results), unless it changes the argument's layout in place (``t_()``: the tensor keeps
it) or autograd tracks its result (saved tensors, forward-mode tangents keep what it read);
which values share an input's memory is read from the storages of Dynamo's fake example values,
as :func:`fxsplit.facts.op_facts.is_view` does. Anything unknown (no example value, an op of
the user's, a ``call_module``) may keep.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch.autograd import forward_ad
from torch.fx import Node

from fxsplit.facts import op_facts

__all__ = ["kept_inputs", "made_outputs", "storages", "tracked", "written_storages"]

_CALLS = ("call_function", "call_method", "call_module")


def kept_inputs(inputs: Sequence[Node], nodes: Sequence[Node], outputs: Sequence[Node]):
    """Positions among ``inputs`` of the values the code of ``nodes`` may keep past the call:
    some node reading memory of the input is not known to be unable to keep it, or some
    output (``outputs``: what the piece returns) shares its memory.

    Args:
        inputs: the piece's input nodes, in its argument order (nodes of the Dynamo graph,
            with their ``example_value``).
        nodes: the piece's nodes in graph order.
        outputs: the nodes the piece returns.

    Returns:
        A frozenset of positions in ``inputs``.
    """
    memory = {node: storages(node) for node in (*inputs, *nodes)}
    kept = set()
    for i, node in enumerate(inputs):
        own = memory[node]
        if own is None:
            kept.add(i)
            continue
        if not own:
            continue  # no memory: a Python number, a SymInt

        def shares(other: Node, own=own) -> bool:
            found = memory.get(other)
            return found is None or not found.isdisjoint(own)

        if any(shares(out) for out in outputs) or any(
            n.op in _CALLS and not _cannot_keep(n) and any(shares(arg) for arg in n.all_input_nodes)
            for n in nodes
        ):
            kept.add(i)
    return frozenset(kept)


def _cannot_keep(node: Node) -> bool:
    """An op of torch's own (:func:`fxsplit.facts.op_facts.is_torch_op`: its kernel holds no
    reference past the call, in-place writes included; what it returns is followed by memory)
    or indexing, whose result autograd does not track: autograd keeps what an op reads where
    its result requires grad (saved for backward) or carries a forward-mode tangent
    (``make_dual`` holds the tangent it is given), whatever the op's schema says."""
    if node.target is not operator.getitem and not op_facts.is_torch_op(node):
        return False
    if op_facts.changes_layout(node):  # t_(), as_strided_(): the tensor keeps its new layout
        return False
    return not tracked(node.meta.get("example_value"))


def tracked(value: object, unknown: bool = True) -> bool:
    """Whether autograd tracks ``value`` (a tensor, or a tuple or list of them): it requires
    grad, or carries a forward-mode tangent; then what made it may be kept (saved for backward,
    the tangent). ``unknown`` where torch gives no answer."""
    if isinstance(value, (tuple, list)):
        return any(tracked(each, unknown) for each in value)
    if not isinstance(value, torch.Tensor):
        return False
    if value.requires_grad:
        return True
    if forward_ad._current_level < 0:
        # no dual level is open, so no value has a tangent (and asking a fake tensor made under
        # inference_mode logs an internal assert with a traceback that holds the frames' tensors)
        return False
    try:
        return torch._unpack_dual(value, 0).tangent is not None
    except Exception:
        return unknown


def made_outputs(graph) -> tuple[int, ...]:
    """The positions of ``graph``'s outputs the graph makes, not views of its inputs (from the
    storages of Dynamo's example values); ``-1 - position`` where that is unknown (no example
    value), for :meth:`~fxsplit.runtime.memory.provenance.Provenance.record_outputs` to tell at run
    time."""
    inputs = set()
    for node in graph.find_nodes(op="placeholder"):
        found = storages(node)
        if found is not None:
            inputs |= found
    slots = []
    (output,) = graph.find_nodes(op="output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for slot, node in enumerate(values):
        found = storages(node) if isinstance(node, Node) else frozenset()
        if found is None:
            slots.append(-1 - slot)
        elif found and found.isdisjoint(inputs):
            slots.append(slot)
    return tuple(slots)


def written_storages(nodes: Sequence[Node]) -> frozenset | None:
    """The storages (of Dynamo's example values) that ``nodes`` write with torch's own ops,
    whose writes bump the version counter of what they write; None where one of them may write
    unseen by any version counter (:func:`fxsplit.facts.op_facts.writes_unseen`: a custom op,
    an in-place layout change) or writes something without a known storage."""
    if op_facts.writes_unseen(nodes):
        return None
    found: set = set()
    for node in nodes:
        for written in op_facts.written_arguments(node):
            memory = storages(written)
            if memory is None:
                return None
            found |= memory
    return frozenset(found)


def storages(node: Node) -> frozenset | None:
    """The storages of ``node``'s example value (of each tensor in a tuple or list of them);
    None where unknown (no example value, a value that may hold memory and is no tensor)."""
    if "example_value" not in node.meta:
        return None
    return _of(node.meta["example_value"])


def _of(value: object) -> frozenset | None:
    if isinstance(value, torch.Tensor):
        try:
            return frozenset((value.untyped_storage()._cdata,))
        except (RuntimeError, NotImplementedError):  # no storage to compare
            return None
    if isinstance(value, (tuple, list)):
        found: set = set()
        for each in value:
            part = _of(each)
            if part is None:
                return None
            found |= part
        return frozenset(found)
    return frozenset() if isinstance(value, _NO_MEMORY) else None


# Values that hold no tensor memory; anything else (a storage, an object of the user's) may.
_NO_MEMORY = (
    int,
    float,
    bool,
    complex,
    str,
    type(None),
    torch.SymInt,
    torch.SymFloat,
    torch.SymBool,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
