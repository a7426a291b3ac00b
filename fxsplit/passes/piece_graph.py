"""The graph Inductor compiles for one captured piece, and how its inputs reach it.

A piece's graph gets canonical names (inputs ``a<i>``, values ``v<j>``), so the pieces of
identical layers have the same code and share one compile. Floats need care: Dynamo lifts a
Python float (``dynamic=True``, or after a value changed) to a 0-dim float64 tensor read with
``.item()``, and pieces receive the ``SymFloat``. Inductor compiles no ``SymFloat`` input, so:

- a float constant for the frame (an attribute: a norm's ``eps``, an attention scale; a
  global) is specialised where the piece is compiled: its value becomes a constant of the
  piece's graph, with a guard on it in Dynamo's shape environment, so another value makes
  Dynamo compile the frame again. Nothing is traced twice.
- a float the frame takes as an argument (``forward(x, scale)``) stays an input: the piece's
  graph takes it as the 0-dim float64 tensor Dynamo made of it and reads it with ``.item()``,
  which AOTAutograd's pass for Python scalars turns into tensor arithmetic. The piece is
  called with the float; :class:`Inputs` turns it into that tensor.

Outputs that share storage (``q.split(...)`` at the end of a piece, both halves read by the
attention after it) need care too: AOTAutograd regenerates an output that views another
output with the sizes it traced, which would freeze a dynamic size. The views at the piece's
end that make such outputs (its view tail) stay out of the compiled graph, which returns their
bases instead, and run as Python on its results (:class:`PieceGraph` ``tail``): views launch no
kernel, and they view the same memory they viewed in the piece's generated Python.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.fx import Graph, GraphModule, Node

from fxsplit.facts import op_facts, ops

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(frozen=True)
class Inputs:
    """How the arguments of a piece become the arguments of its compiled graph.

    Attributes:
        keep: indices of the piece's arguments the graph takes (a specialised float is not
            one of them), in order.
        floats: indices into ``keep`` of float arguments the graph takes as 0-dim float64
            tensors.
    """

    keep: tuple[int, ...]
    floats: tuple[int, ...]

    def __call__(self, args) -> list:
        out = [args[i] for i in self.keep]
        for i in self.floats:
            out[i] = torch.scalar_tensor(out[i], dtype=torch.float64)
        return out


@dataclass
class PieceGraph:
    """A piece ready for Inductor.

    Attributes:
        graph_module: the piece's graph, canonical names, returning a tuple; None with a
            reason.
        examples: Dynamo's example values of its inputs (fake tensors, SymInts).
        inputs: how the piece's arguments map onto the graph's; None when they are the same.
        float_symbols: names of the symbolic floats it takes as inputs (``"zf0"``).
        reason: why Inductor cannot compile it, or None.
        tail: the piece's view tail, or None: called with the piece's arguments and then the
            compiled graph's results, it returns the piece's outputs (a tuple).
    """

    graph_module: GraphModule | None
    examples: list
    inputs: Inputs | None
    float_symbols: frozenset[str]
    reason: str | None = None
    tail: GraphModule | None = None


def float_sources(gm: GraphModule) -> dict[object, object]:
    """``{symbol: Dynamo source}`` of the floats Dynamo lifted in ``gm`` (the placeholder of a
    float holds its 0-dim tensor, read by an ``item`` call)."""
    found = {}
    for placeholder in gm.graph.find_nodes(op="placeholder"):
        grapharg = placeholder.meta.get("grapharg")
        if not getattr(grapharg, "pass_arg_as_tensor", False):
            continue
        for user in placeholder.users:
            value = user.meta.get("example_value")
            if isinstance(value, torch.SymFloat) and value.node.expr.is_Symbol:
                found[value.node.expr] = grapharg.source
    return found


def is_argument(source) -> bool:
    """Whether a Dynamo source is (an item of) an argument of the frame, rather than an
    attribute or a global, which stay constant for the frame."""
    from torch._dynamo.source import (
        DictGetItemSource,
        GetItemSource,
        LocalSource,
    )

    while not isinstance(source, LocalSource):
        if not isinstance(source, (GetItemSource, DictGetItemSource)):
            return False
        source = source.base
    return getattr(source, "is_input", True)


def build(
    gm: GraphModule, part_nodes, module, nodes: dict[str, Node], floats, guard: bool = True
) -> PieceGraph:
    """The graph of one piece, from its nodes in the Dynamo graph ``gm``.

    Args:
        part_nodes: the piece's nodes, in order.
        module: its :class:`~fxsplit.passes.materialise.PieceModule` (input and output names).
        nodes: ``gm``'s nodes by name.
        floats: :func:`float_sources` of ``gm``.
        guard: guard the constant floats it bakes in (False where the frame's guards exist
            already: a precompiled graph being loaded).
    """
    graph = Graph()
    env: dict[Node, object] = {}
    examples = []
    keep: list[int] = []
    as_tensor: list[int] = []
    float_names: set[str] = set()
    for k, name in enumerate(module.input_names):
        node = nodes[name]
        value = node.meta["example_value"]
        if isinstance(value, torch.SymFloat):
            kind = _float_kind(value, floats)
            if kind == "constant":
                # baked in; the guard makes another value a new frame compile
                guarded = torch.fx.experimental.symbolic_shapes.guard_scalar
                env[node] = float(guarded(value) if guard else value.node.hint)
                continue
            if kind != "argument" or not (node.op == "call_method" and node.target == "item"):
                reason = (
                    f"input {name} is a float that is neither constant for the frame nor one of "
                    "its arguments (data-dependent, or computed from a float argument)"
                )
                return PieceGraph(None, [], None, frozenset(), reason)
            if not _tensor_arithmetic(node, set(part_nodes)):
                source = floats[value.node.expr].name
                reason = (
                    f"float argument {source() if callable(source) else source} reaches an op "
                    "that AOTAutograd cannot turn into tensor arithmetic (Inductor would "
                    "specialise it: a compile per value)"
                )
                return PieceGraph(None, [], None, frozenset(), reason)
            tensor = node.args[0]
            placeholder = graph.placeholder(f"a{k}")
            placeholder.meta = _meta(tensor)
            env[node] = graph.call_method("item", (placeholder,))
            env[node].meta = _meta(node)
            as_tensor.append(len(keep))
            keep.append(k)
            examples.append(_float_tensor(tensor.meta["example_value"], value))
            float_names.add(str(value.node.expr))
            continue
        env[node] = graph.placeholder(f"a{k}")
        env[node].meta = _meta(node)
        keep.append(k)
        examples.append(value)
    outputs = [nodes[name] for name in module.output_names]
    tail: set[Node] = set()
    if _sharing(outputs) is not None:
        tail = _view_tail(part_nodes)
    results = _results(outputs, tail, part_nodes)
    for node in results:
        value = node.meta.get("example_value")
        if not isinstance(value, (torch.Tensor, torch.SymInt)):
            reason = f"its views read {node.name}, a {type(value).__name__}"
            return PieceGraph(None, [], None, frozenset(), reason)
    shared = _sharing(results)
    if shared is not None:
        return PieceGraph(None, [], None, frozenset(), f"outputs {shared} share storage")
    for j, node in enumerate(part_nodes):
        if node in tail:
            continue
        new = graph.create_node(
            node.op,
            node.target,
            torch.fx.map_arg(node.args, env.__getitem__),
            torch.fx.map_arg(node.kwargs, env.__getitem__),
            name=f"v{j}",
        )
        new.meta = _meta(node)
        env[node] = new
    graph.output(tuple(env[node] for node in results))
    inputs = None
    if as_tensor or len(keep) != len(module.input_names):
        inputs = Inputs(tuple(keep), tuple(as_tensor))
    piece = GraphModule(gm, graph, class_name="FxsplitPiece")
    views = _tail_module(gm, part_nodes, tail, module, nodes, results) if tail else None
    return PieceGraph(piece, examples, inputs, frozenset(float_names), tail=views)


def _sharing(values: list[Node]) -> str | None:
    """``"a and b"``: the first two of ``values`` whose example values share storage."""
    storages: dict[object, str] = {}
    for node in values:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            storage = torch.multiprocessing.reductions.StorageWeakRef(value.untyped_storage())
            if storage in storages:
                return f"{storages[storage]} and {node.name}"
            storages[storage] = node.name
    return None


def _view_tail(part_nodes: list[Node]) -> set[Node]:
    """The nodes at the end of a piece that only make views read by later pieces: views of
    the op schema's kind (:func:`fxsplit.facts.op_facts.is_view`) and the items of a view op's
    tuple (``q.split(...)[0]``), none of them read by a node of the piece outside the tail."""
    part = set(part_nodes)
    tail: set[Node] = set()
    for node in reversed(part_nodes):  # users first
        if (_item(node) or op_facts.is_view(node)) and all(
            u in tail or u not in part for u in node.users
        ):
            tail.add(node)
        else:  # its items, if tail, would read its tuple, which the compiled graph cannot return
            tail.difference_update(u for u in node.users if _item(u))
    return tail


def _item(node: Node) -> bool:
    """``node`` takes an item of a view op's tuple (``q.split(...)[0]``)."""
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], Node)
        and op_facts.is_view(node.args[0])
    )


def _results(outputs: list[Node], tail: set[Node], part_nodes: list[Node]) -> list[Node]:
    """What the compiled graph returns: the piece's outputs outside its view tail, then what
    the tail reads of the piece's other values (the bases of its views), each once, in graph
    order (never a set's: the order enters the compiled graph and so its cache key)."""
    part = set(part_nodes)
    results = dict.fromkeys(node for node in outputs if node not in tail)
    for node in part_nodes:
        if node in tail:
            results.update(
                (arg, None) for arg in node.all_input_nodes if arg in part and arg not in tail
            )
    return list(results)


def _tail_module(gm, part_nodes, tail, module, nodes, results) -> GraphModule:
    """The view tail as a module: ``tail(*piece_args, *compiled_results)`` returns the piece's
    outputs as a tuple."""
    graph = Graph()
    env: dict[Node, Node] = {}
    for k, name in enumerate(module.input_names):
        env[nodes[name]] = graph.placeholder(f"a{k}")
    for j, node in enumerate(results):
        env[node] = graph.placeholder(f"r{j}")
    for j, node in enumerate(part_nodes):
        if node in tail:
            args = torch.fx.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.map_arg(node.kwargs, env.__getitem__)
            env[node] = graph.create_node(node.op, node.target, args, kwargs, name=f"v{j}")
    graph.output(tuple(env[nodes[name]] for name in module.output_names))
    return GraphModule(gm, graph, class_name="FxsplitViewTail")


def _tensor_arithmetic(item: Node, part: set[Node]) -> bool:
    """Whether every tensor op of the piece that reads the float ``item`` gives (directly or
    through float arithmetic) becomes an op AOTAutograd's pass for Python scalars rewrites into
    tensor arithmetic (its own table: ``mul``, ``add``, ``sub``, ``div``, comparisons). The pass
    specialises a float it cannot rewrite with a guard in Dynamo's shape environment, which
    cannot be taken back, so such a piece is not tried."""
    from torch.fx.passes._tensorify_python_scalars import SUPPORTED_OPS

    pending, seen = [item], set()
    while pending:
        for user in pending.pop().users:
            if user not in part or user in seen:
                continue
            seen.add(user)
            if isinstance(user.meta.get("example_value"), torch.SymFloat):
                pending.append(user)  # float arithmetic: follow it to the tensor op
            elif not _rewritten(user, SUPPORTED_OPS):
                return False
    return True


def _rewritten(node: Node, table) -> bool:
    """Whether the aten op of a node on a tensor and a float is in the pass's ``table``: the
    op's ``Tensor`` or ``Scalar`` overload (``x * s`` becomes ``aten.mul.Tensor``, ``x > s``
    ``aten.gt.Scalar``, ``x ** s`` ``aten.pow.Tensor_Scalar``, which it does not rewrite)."""
    if isinstance(node.target, OpOverload):
        return node.target in table
    names = ops.op_names(node)
    if names is None or not names[0].startswith("aten::"):
        return False
    packet = getattr(torch.ops.aten, names[0].removeprefix("aten::"), None)
    overloads = packet.overloads() if isinstance(packet, OpOverloadPacket) else ()
    return any(getattr(packet, o) in table for o in ("Tensor", "Scalar") if o in overloads)


def _float_tensor(example: torch.Tensor, value: torch.SymFloat) -> torch.Tensor:
    """The 0-dim tensor of a float argument as the compile sees it: Dynamo hands its backend a
    fresh fake-tensor mode (sharing the shape environment), into which AOTAutograd converts
    the graph's example values; the conversion forgets what ``.item()`` of the tensor is.
    Convert it here and say so, so ``.item()`` gives the same symbolic float again."""
    context = torch._guards.TracingContext.try_get()
    mode = getattr(context, "fake_mode", None)
    if mode is None or getattr(example, "fake_mode", mode) is mode:
        return example
    converted = mode.from_tensor(example)
    converted.item_memo = value
    return converted


def _float_kind(value: torch.SymFloat, floats) -> str:
    """``"constant"`` (every float it is computed from is constant for the frame),
    ``"argument"`` (it is a float argument) or ``"other"`` (data-dependent, or computed from a
    float argument)."""
    expr = value.node.expr  # a number once specialised
    sources = [floats.get(symbol) for symbol in expr.free_symbols]
    if any(source is None for source in sources):
        return "other"
    arguments = [is_argument(source) for source in sources]
    if not any(arguments):
        return "constant"
    return "argument" if expr.is_Symbol else "other"


def _meta(node: Node) -> dict:
    """What Inductor reads of a node's meta: its example value. The rest of Dynamo's meta
    (module stacks, annotations) would enter Inductor's cache key, and some of it does not
    pickle, which turns Inductor's caches (and so the saved artifact) off."""
    return {k: node.meta[k] for k in ("example_value", "val") if k in node.meta}


def layouts(examples) -> tuple:
    """What a compiled piece depends on besides its code, per input: size and stride
    expressions, offset, dtype, device, and which earlier input shares its storage."""
    storages: dict[object, int] = {}
    out = []
    for k, value in enumerate(examples):
        if isinstance(value, torch.Tensor):
            storage = torch.multiprocessing.reductions.StorageWeakRef(value.untyped_storage())
            shared = storages.setdefault(storage, k)
            out.append(
                (
                    str(tuple(value.shape)),
                    str(value.stride()),
                    str(value.storage_offset()),
                    str(value.dtype),
                    str(value.device),
                    value.requires_grad,
                    shared,
                )
            )
        else:
            out.append(type(value).__name__)
    return tuple(out)


def symbolic(examples):
    """The symbolic sizes, strides, offsets and host values among the inputs."""
    for value in examples:
        dims = ()
        if isinstance(value, torch.Tensor):
            dims = (*value.shape, *value.stride(), value.storage_offset())
        elif isinstance(value, _SYMBOLIC):
            dims = (value,)
        yield from (d for d in dims if isinstance(d, _SYMBOLIC))


def symbols(examples) -> set:
    """The free symbols of the inputs' sizes, strides, offsets and host values."""
    return {symbol for dim in symbolic(examples) for symbol in dim.node.expr.free_symbols}


def assumptions(examples) -> tuple[str, ...]:
    """What Dynamo's shape environment knows about the sizes of ``examples`` (its guards and
    value ranges on their symbols): Inductor may simplify with it, so an artifact is shared,
    and found in the cache, only where it is the same. Floats are not sizes (see
    :func:`constants`)."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    dim = next(symbolic(examples), None)
    if dim is None:
        return ()
    shape_env = dim.node.shape_env
    found = {s for s in symbols(examples) if not symbol_is_type(s, SymT.FLOAT)}
    guards = sorted(str(g.expr) for g in shape_env.guards if g.expr.free_symbols & found)
    ranges = [f"{s}:{shape_env.var_to_range.get(s)}" for s in sorted(found, key=str)]
    return (*guards, *ranges)


def constants(examples, floats) -> tuple:
    """The values of the inputs that are floats constant for the frame (baked into the compiled
    graph, so they tell its pieces apart: each layer's ``eps`` is a float of its own), in
    order; ``"argument"`` for a float argument, ``"other"`` for another float."""
    return tuple(
        repr(value.node.hint) if kind == "constant" else kind
        for value in examples
        if isinstance(value, torch.SymFloat)
        for kind in (_float_kind(value, floats),)
    )


_LIBRARIES = ("torch", "_operator", "operator", "math", "builtins")
_LITERALS = (int, float, bool, complex, str, type(None), slice, torch.dtype, torch.device)
_LITERALS += (torch.layout, torch.memory_format, torch.Size, type(Ellipsis))


def objects(part_nodes, gm: GraphModule) -> tuple[int, ...]:
    """Ids of the objects the piece's code names without identifying them: a user function
    (``allow_in_graph``), a submodule or a constant object is printed by name or repr, which
    two different objects can share; ops and torch's functions are identified by their
    qualified names. Pieces holding such objects share an artifact only with pieces holding the
    same objects, in memory only."""
    found: list[int] = []

    def visit(value):
        if not isinstance(value, (Node, *_LITERALS)):
            found.append(id(value))
        return value

    for node in part_nodes:
        target = node.target
        if node.op == "call_module":
            found.append(id(gm.get_submodule(target)))
        elif node.op == "call_function" and not isinstance(
            target,
            (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator),
        ):
            module = getattr(target, "__module__", None) or ""
            if module.split(".")[0] not in _LIBRARIES:
                found.append(id(target))
        torch.fx.node.map_aggregate((node.args, node.kwargs), visit)
    return tuple(found)
