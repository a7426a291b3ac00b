"""Cache-ops pass: under a runner that does not keep its inputs (v1), the work on a cache the
step writes in place runs eagerly with the attention that reads it.

A KV cache handed in each call (an argument, or reached through one: transformers' StaticCache
and its layers) is written in place by the step (the new token's keys and values: an
``index_copy_`` at the cache position) and read by attention, which runs eagerly. Left in a
captured piece between the two, the cache is a runner input of that piece: copy binding copies
the whole cache into fxsplit's buffer and back every step (the cache per token), and a new
cache per ``generate()`` is new memory every call, while the runner keeps none of it. vLLM keeps
its KV-cache update with attention for the same reason.

The cache is found from the graph, never from a list of method names: a placeholder that is not
the model's own (a parameter or a buffer of the module the frame runs: read by address, never
copied), marked static or not (transformers marks a StaticCache it initialises eagerly, and
``generate()`` makes a new one per call: bound by address, a new one recaptures), whose memory
some node writes (:func:`fxsplit.facts.op_facts.may_write`, with Dynamo's example
values saying which tensors share that memory) and which an eager attention node reads, directly
or through other nodes. Every node that writes that memory, and every node on a path from the
cache to that attention (views of it, ``repeat_kv``'s expand and reshape, the position it is
written at), runs eagerly: reason ``cache:<what>``, ``<what>`` in the model's terms
(``cache.layers[0].keys``). A runner that keeps its inputs in persistent buffers (v2) binds such
a cache by address and never copies it: its cache work stays captured.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.fx import Graph, Node

from fxsplit.facts import op_facts
from fxsplit.facts.symbols import describe
from fxsplit.passes.mark import Marks

__all__ = ["find"]

_CALLS = ("call_function", "call_method", "call_module")


def find(graph: Graph, marks: Marks, attention: str) -> dict[Node, str]:
    """The nodes of ``graph`` to run eagerly with the attention that reads a cache the step
    writes (see the module docstring), each with its ``cache:<what>`` reason.

    Args:
        graph: a normalised Dynamo graph (nodes carry ``example_value``).
        marks: the mark pass's result: which nodes are eager (``reasons``) and which sit in
            region ``attention`` (``regions``).
        attention: the attention region's name.

    Returns:
        ``{node: reason}`` for nodes not already eager; empty where no eager attention node
        reads a cache the graph writes.
    """
    regions, reasons = marks.regions, marks.reasons
    readers = [n for n in marks.nodes if n in reasons and attention in regions.get(n, ())]
    if not readers:
        return {}
    upstream = _ancestors(readers)
    calls = [n for n in graph.nodes if n.op in _CALLS]
    found: dict[Node, str] = {}
    placeholders = list(graph.find_nodes(op="placeholder"))
    # the model's memory, also where the caller hands a view of it in (``model(x, self.kv[0])``)
    model = _storages(p for p in placeholders if _model_state(p))
    for placeholder in placeholders:
        memory = _storage(placeholder)
        if memory is None or memory in model:
            continue
        touching = [n for n in calls if memory in _storages(n.all_input_nodes)]
        if not any(_writes(n, memory) for n in touching):
            continue
        path = _descendants(placeholder, set(readers)) & upstream if placeholder in upstream else ()
        reason = f"cache:{_what(placeholder)}"
        for node in (*touching, *path):
            if node.op in _CALLS and node not in reasons:
                found.setdefault(node, reason)
    return found


def _writes(node: Node, memory: int) -> bool:
    """Whether ``node`` may write the storage ``memory`` (an argument its schema writes is over
    it; an op whose writes are unknown may write any argument)."""
    return memory in _storages(op_facts.written_arguments(node))


def _ancestors(nodes: Iterable[Node]) -> set[Node]:
    seen: set[Node] = set()
    stack = list(nodes)
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


def _descendants(node: Node, readers: set[Node]) -> set[Node]:
    """The nodes reached from ``node`` through users, not past an attention node (``readers``):
    a later layer reads this cache only through the attention that read it."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                if user not in readers:
                    stack.append(user)
    return seen


def _model_state(placeholder: Node) -> bool:
    """Whether a placeholder is the model's own: a parameter, or reached through the module the
    frame runs (``L['self']...``: its buffers), bound by address and never copied. A cache
    reached through the call's arguments (``L['kwargs']['cache'].layers[0].keys``) is the
    runner's, marked static or not: transformers marks a StaticCache it initialises eagerly,
    and ``generate()`` makes a new one per call."""
    if isinstance(getattr(placeholder.meta.get("grapharg"), "example", None), torch.nn.Parameter):
        return True
    source = getattr(placeholder.meta.get("grapharg"), "source", None)
    while source is not None and getattr(source, "base", None) is not None:
        source = source.base
    return getattr(source, "local_name", None) == "self"


def _storage(node: Node) -> int | None:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _storages(nodes: Iterable[Node]) -> set[int]:
    return {found for n in nodes if (found := _storage(n)) is not None}


def _what(placeholder: Node) -> str:
    source = getattr(placeholder.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    return describe(name() if callable(name) else name) if name else placeholder.name
