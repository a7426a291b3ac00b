"""Step-sizes pass: find the work whose shapes, or the host values it reads, change every step.

A captured piece replays only when its capture key repeats, and the key holds every symbolic
size and host value the piece reads (:func:`fxsplit.runtime.inputs.binding.key_reads`). In a decode
loop some of those change on every step: the KV length of a cache that grows by one token per
step (transformers' ``DynamicCache`` concatenates keys and values), the masks and positions
built over it, a host int counting the tokens cached so far (``cumulative_length_int`` of a
sliding-window ``StaticCache``). A piece holding such work is captured once per step and never
replayed. This pass finds it, from Dynamo's own facts, so the mark pass runs it eagerly with the
attention it feeds, while the work with the token count's shape stays captured.

The facts: every node's ``example_value`` carries its sizes as SymInts, and the graph's
``ShapeEnv`` traces each symbol back to where Dynamo read it (``var_to_sources``, e.g.
``L['kwargs']['cache'].layers[0].keys.size()[2]``). A symbol is a **step size** unless it is

- a size of the size input (the token count, see
  :func:`fxsplit.size_input.size_input_index`), or the leading dim of another input
  the ``size_input`` option names (an engine's ``positions``, which Dynamo gives a symbol of
  its own where the engine marks each argument dynamic): what engines pad to capture sizes;
- or, in a graph traced with ``dynamic=True`` (Dynamo's ``assume_static_by_default`` is off
  while it traces), a size or value of an argument the caller hands in
  (``L['block_table'].size()[1]``):
  ``dynamic=True`` makes every such size symbolic whether it changes or not, so only sizes and
  values of the state the model carries (reached through an attribute, as a cache's tensors and
  counters are) count there.

Under the default ``torch.compile`` (automatic dynamic shapes), Dynamo makes a size symbolic
only after it saw it change between two calls (or where the caller marked it dynamic), so every
symbol other than the token count is a step size.

A node is marked ``dynamic:<what>`` (``<what>`` in the model's terms, such as
``cache.layers[0].keys.size(2)``) when its value or one of its inputs holds a step size. A host
value nobody reads that depends on a step size (Dynamo keeps the ``x.numel()`` and ``sym_sum``
results it traced but never used) is dropped: left in place it would sit alone between captured
nodes and cut a captured piece in two. For the same reason, pure work built from host values
and constants that only feeds such nodes (an ``arange`` the positions are added to) moves
right before its first user and runs eagerly with it. Symbols of data-dependent sizes
(unbacked, from ``nonzero`` and the like) have no source and are left alone: the op that makes
them runs eagerly already. Float symbols are left alone too: Dynamo lifts float attributes (a norm's
``eps``, a scale) as symbols without having seen them change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node, map_arg

from fxsplit.facts import aliasing, op_facts
from fxsplit.facts.symbols import describe, symbols
from fxsplit.passes import global_state

__all__ = ["StepSizes", "describe", "find", "symbols"]

_HOST = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass
class StepSizes:
    """What :func:`find` found in one graph.

    Attributes:
        symbols: each step size's symbol -> its description in the model's terms
            (:func:`describe` of its first source).
        names: every symbol Dynamo traced to a source -> its description (step sizes, the
            token count and the rest), for messages about capture keys.
        tokens: the symbols of the token count (the size input's sizes).
        reasons: nodes that read or make a step size -> their ``dynamic:<what>`` reasons, sorted.
        dropped: names of the unused host-value nodes removed from the graph.
        every_size: the graph was traced under ``torch.compile(dynamic=True)``, where only
            the carried state's sizes count.
    """

    symbols: dict[object, str] = field(default_factory=dict)
    names: dict[object, str] = field(default_factory=dict)
    tokens: frozenset = frozenset()
    reasons: dict[Node, tuple[str, ...]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    every_size: bool = False


def find(
    graph: Graph,
    size_input: Node | Sequence[Node] | None,
    leading_only: bool = False,
    every_size: bool = False,
) -> StepSizes:
    """Find the step sizes of ``graph`` and the nodes that depend on them; drops unused host
    values that depend on one (see the module docstring).

    Args:
        graph: a Dynamo graph (nodes carry ``example_value``); a graph without a ShapeEnv (plain
            ``torch.fx``, or no symbolic size) has none.
        size_input: the placeholder whose sizes are the token count, or several: the first
            one's sizes and the leading dim of the others; None or empty for none.
        leading_only: only the first one's leading dim is (the placeholder is a value the
            model computed, such as hidden states handed to a frame resumed after a graph
            break, whose other dims may be anything, a mask over the KV length among them).
        every_size: the graph was traced under ``torch.compile(dynamic=True)`` (Dynamo's
            ``assume_static_by_default`` off): every size is symbolic, and only the carried
            state's sizes are step sizes.

    Returns:
        a :class:`StepSizes`, empty where the graph has no step size.
    """
    found = StepSizes()
    shape_env = _shape_env(graph)
    if shape_env is None:
        return found
    inputs = [size_input] if isinstance(size_input, Node) else list(size_input or ())
    tokens = set()
    for k, node in enumerate(inputs):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            tokens |= symbols(value.shape[:1] if leading_only or k else value.shape)
    found.tokens = frozenset(tokens)
    found.every_size = every_size
    for symbol, sources in shape_env.var_to_sources.items():
        if sources:
            found.names[symbol] = describe(sources[0].name)
        if not sources or symbol in tokens or not symbol.is_integer:
            continue
        if every_size and not any(_carried_state(s) for s in sources):
            continue
        found.symbols[symbol] = describe(sources[0].name)
    if not found.symbols:
        return found
    step = found.symbols
    made: dict[Node, set] = {}
    cache: dict = {}
    for node in graph.nodes:
        mine = {s for s in symbols(node.meta.get("example_value"), cache) if s in step}
        made[node] = mine
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        read = set(mine)
        for arg in node.all_input_nodes:
            read |= made.get(arg, set())
        if not read:
            continue
        if not node.users and _unused_host_value(node):
            found.dropped.append(node.name)
            graph.erase_node(node)
            continue
        found.reasons[node] = tuple(sorted({f"dynamic:{step[s]}" for s in read}))
    _gather(graph, found.reasons)
    return found


def _gather(graph: Graph, reasons: dict[Node, tuple[str, ...]]) -> None:
    """Move the pure work that only feeds nodes in ``reasons`` (``arange`` before
    ``arange + past_length``, host arithmetic on a cache's counter) right before its first
    user, into ``reasons`` with its users' reasons: left where Dynamo traced it, it would stand
    alone between eager nodes as a captured piece of one or two ops. Only pure work
    (:func:`fxsplit.facts.op_facts.is_pure`: torch's own ops that write nothing, draw nothing
    and have no registered effect, and host arithmetic) built from host values and constants
    moves: never a random op (moved past another, it would draw that one's numbers), never a
    user's op (a custom op or ``allow_in_graph`` function may draw or bump a counter that no
    schema declares), never past a write to a tensor such work made (``positions[1:].add_(1)``
    between ``doubled = positions * 2`` and its user, or through an alias made by an op that
    reads other tensors too: ``positions.view_as(x).add_(1)``, ``positions.to(x).add_(1)``, or
    by an op whose schema does not declare it: ``batch_norm``'s running statistics), and never
    across a global-state switch (grad mode, autocast) or setter (``set_default_dtype``). Work
    that itself writes a tensor where its schema says it writes none (``batch_norm`` in
    training mode updating running statistics that are pure work too) never moves either:
    moved past a reader of those statistics, the reader would see them not yet updated."""
    constant = {n for n in graph.nodes if _constant(n)}
    built: set[Node] = set()
    for node in graph.nodes:
        if (
            all(a in built or a in constant for a in node.all_input_nodes)
            and not global_state.is_state_node(node)
            and op_facts.is_pure(node)
            and not (_reads_tensors(node) and writes_when_run(node))
        ):
            built.add(node)
    memory = {m for n in built if (m := _storage(n)) is not None}
    known: dict[Node, bool] = {}

    def writes(node: Node) -> bool:
        if node not in known:
            known[node] = _writes_built(node, built, memory)
        return known[node]

    for node in reversed(list(graph.nodes)):
        if node not in built or not node.users or not all(u in reasons for u in node.users):
            continue
        first = _first_user(node, writes)
        if first is None:
            continue
        if first is not node.next:
            first.prepend(node)
        reasons[node] = tuple(
            sorted({*reasons.get(node, ()), *(r for u in node.users for r in reasons[u])})
        )


def _reads_tensors(node: Node) -> bool:
    """Whether one of ``node``'s inputs is a tensor (host arithmetic writes no memory)."""
    return any(isinstance(a.meta.get("example_value"), torch.Tensor) for a in node.all_input_nodes)


def _constant(node: Node) -> bool:
    """A host value (a SymInt placeholder, ``x.size(0)``) or a module constant."""
    return node.op == "get_attr" or isinstance(
        node.meta.get("example_value"), (*_HOST, int, float, bool)
    )


def _first_user(node: Node, writes) -> Node | None:
    """``node``'s first user in graph order; None where a global-state switch or setter
    (``set_default_dtype``), or an op that may write a tensor of ``built`` (``writes``, see
    :func:`_writes_built`), lies between."""
    users = node.users
    current = node.next
    while current.op != "root":
        if current in users:
            return current
        if global_state.is_state_node(current) or global_state.is_setter(current):
            return None
        if writes(current):
            return None
        current = current.next
    return None


def _writes_built(node: Node, built: set[Node], memory: set[int]) -> bool:
    """Whether ``node`` may write one of its inputs that is in ``built``, a module constant, or
    shares the memory of a tensor of ``built`` (``memory``: their storages, as Dynamo's example
    values hold them; an alias is not always pure work: ``positions.view_as(x)`` reads ``x``).
    Where the schemas say the op writes nothing, functionalization is asked
    (:func:`writes_when_run`)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if not any(
        a.op == "get_attr" or (a in built and not _constant(a)) or _storage(a) in memory
        for a in node.all_input_nodes
    ):
        return False  # only tensors are written: host arithmetic on built values writes none
    return (
        node.op == "call_module"
        or node.is_impure()
        or op_facts.may_write(node, dispatch=True)
        or writes_when_run(node)
    )


def writes_when_run(node: Node) -> bool:
    """Whether ``node``, run on fake copies of its inputs, writes one, as functionalization
    sees it (:func:`fxsplit.facts.aliasing.analyse`): the schema of an op that decomposes need
    not declare what its decomposition writes (``batch_norm`` and ``instance_norm`` write their
    running statistics). True where the analysis cannot run (no example value, a data-dependent
    size)."""
    inputs = node.all_input_nodes

    def run(*values):
        env = dict(zip(inputs, values, strict=True))
        args, kwargs = map_arg((node.args, node.kwargs), env.__getitem__)
        if node.op == "call_method":
            getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            node.target(*args, **kwargs)
        return ()

    facts = aliasing.analyse(run, [n.meta.get("example_value") for n in inputs], 0)
    written = facts.written or facts.metadata_written
    return facts.error is not None or facts.deferred or bool(written)


def _storage(node: Node) -> int | None:
    """The identity of the storage of ``node``'s example value (shared by all its aliases), or
    None where it has none (a host value, no example value)."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage to compare
        return None


def _unused_host_value(node: Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, (*_HOST, int, float, bool)) and not node.is_impure()


def _shape_env(graph: Graph):
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            fake_mode = getattr(value, "fake_mode", None)
            if fake_mode is not None and fake_mode.shape_env is not None:
                return fake_mode.shape_env
        elif isinstance(value, _HOST):
            return value.node.shape_env
    return None


def _carried_state(source) -> bool:
    """Whether a source reaches its value through an attribute of an object (the state a model
    or a cache carries, ``L['cache'].layers[0].keys``) rather than being an argument the caller
    hands in, a size of one or of the tensor it views (``L['block_table'].size()[1]``,
    ``L['kwargs']['mask']``, ``L['x']._base.size()[0]``)."""
    from torch._dynamo.source import AttrSource

    while source is not None:
        # ``_base``: the tensor an argument is a view of (Dynamo traces views with their base)
        if isinstance(source, AttrSource) and source.member != "_base":
            return True
        source = getattr(source, "base", None)
    return False
