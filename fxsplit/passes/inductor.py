"""Inductor pass: compile each distinct captured piece once with Inductor, and cache it.

A split graph is a row of pieces, most of them one per layer and structurally identical: the
same code (:attr:`fxsplit.passes.materialise.PieceModule.shared_code`, canonical names) on inputs
of the same layout. Parameters are inputs of the pieces (Dynamo inlines ``nn.Module`` calls and
lifts their parameters), so one compiled artifact serves every layer, and compile time stops
growing with depth.

Each distinct piece is compiled through ``torch._inductor.standalone_compile`` (AOTAutograd's
functionalization, then Inductor: Triton kernels on GPUs, C++ on the CPU; Inductor's own CUDA
graphs off, fxsplit captures), with the dynamic sizes Dynamo traced (one symbolic compile per
piece). Artifacts are kept in memory for the process and on disk (:mod:`fxsplit.cache`) for
later runs. Pieces Inductor should not compile keep their generated Python, with the reason
recorded: pieces that re-enter global state across a boundary, draw random numbers (Inductor's
generator would give other numbers than eager), take non-tensor inputs other than sizes (the
subgraphs of higher-order ops), return nothing or non-tensors, or read tensors that require
grad; and any piece Inductor fails on (remembered, in memory and on disk, so it is tried once).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sympy
import torch
from torch.fx import Graph, GraphModule, Node

from fxsplit import cache, counters
from fxsplit.passes import global_state, partition
from fxsplit.runtime import emulator

log = logging.getLogger("fxsplit")

COMPILE_MODES = ("auto", "inductor", "eager")

# Inductor asks Dynamo to trace the frame again with a float input specialised (its
# tensorify pass); only Dynamo can, so it must reach Dynamo.
RestartAnalysis = torch._dynamo.exc.TensorifyScalarRestartAnalysis

_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
# Artifacts compiled or loaded in this process, and why Inductor failed, by cache key.
_MEMORY: dict[str, object] = {}
_FAILED: dict[str, str] = {}


@dataclass
class CompiledPiece:
    """What the pass did for one distinct captured piece.

    Attributes:
        pieces: the pieces sharing it, in order (the first is the one compiled).
        outcome: ``"compiled"`` (by Inductor now), ``"disk"`` / ``"memory"`` (cache hits) or
            ``"eager"`` (kept as generated Python; see ``reason``).
        seconds: wall time of the compile or load.
        reason: why it stayed eager; None otherwise.
        output_code: Inductor's generated wrapper code, where this process generated it.
        key: the cache key (None when eager).
    """

    pieces: tuple[str, ...]
    outcome: str
    seconds: float = 0.0
    reason: str | None = None
    output_code: str | None = None
    key: str | None = None


class InductorPiece:
    """A piece's ``forward`` running a compiled artifact: same arguments, same return value
    structure (one value as is, several as a tuple).

    Attributes:
        artifact: the compiled callable (returns a list of outputs), symbolic in the sizes.
        eager: the piece's generated Python (capture-legality checks run it, see
            :mod:`fxsplit.runtime.captured`).
        size_arg / sized: with ``compile_sizes``, the argument carrying the token count (a
            tensor's leading dim, or the size itself) and the artifact compiled for each size.
    """

    __slots__ = ("artifact", "eager", "name", "single", "size_arg", "sized")

    def __init__(self, artifact, eager, single: bool, name: str, size_arg=None, sized=None):
        self.artifact = artifact
        self.eager = eager
        self.single = single
        self.name = name
        self.size_arg = size_arg
        self.sized = sized

    def __call__(self, *args):
        artifact = self.artifact
        if self.sized:
            size = args[self.size_arg]
            artifact = self.sized.get(size if type(size) is int else size.shape[0], artifact)
        out = emulator.call_opaque(artifact, args)
        return out[0] if self.single else tuple(out)

    def __repr__(self) -> str:
        return f"inductor:{self.name}"


def resolve(mode: str, device: torch.device | None) -> str:
    """``"inductor"`` or ``"eager"`` for a ``compile_pieces`` option value; ``"auto"`` means
    Inductor where the graph's tensors are on a CUDA/HIP device."""
    if mode == "auto":
        return "inductor" if device is not None and device.type == "cuda" else "eager"
    return mode


def forget() -> None:
    """Drop the artifacts and failures kept in memory (the disk cache stays)."""
    _MEMORY.clear()
    _FAILED.clear()


def compile_pieces(
    split,
    device: torch.device | None,
    cache_root: Path,
    grad_at_entry: bool,
    size: object = None,
    sizes: tuple[int, ...] = (),
) -> list[CompiledPiece]:
    """Compile every distinct captured piece of ``split`` and make its pieces run the result.

    Replaces ``forward`` of each compiled :class:`~fxsplit.passes.materialise.PieceModule` with
    an :class:`InductorPiece`. Plans do not change.

    Args:
        split: the :class:`fxsplit.passes.Split` of one graph.
        device: the graph's CUDA device, or None (CPU).
        cache_root: the cache folder (:func:`fxsplit.cache.cache_dir`).
        grad_at_entry: grad mode when the graph is called.
        size: the token count as Dynamo traced it (the leading dim of the size input: a SymInt
            when dynamic), for ``sizes``.
        sizes: the ``compile_sizes`` option: token counts that get a compile of their own.

    Returns:
        one :class:`CompiledPiece` per distinct captured piece, in graph order.
    """
    gm = split.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    groups: dict[tuple, list[int]] = {}
    for i, (part, module) in enumerate(zip(split.parts, split.materialised.pieces, strict=True)):
        if part.kind == partition.CAPTURED:
            examples = [nodes[name].meta.get("example_value") for name in module.input_names]
            layouts = (_layouts(examples), _assumptions(examples))
            groups.setdefault((module.shared_code, layouts), []).append(i)
    _specialise_floats(split, groups, nodes, grad_at_entry)
    disk = cache.PieceCache(cache_root)
    kind = cache.device_kind(device)
    results = []
    for (_, layouts), members in _progress(groups.items(), split.plan.graph_id):
        first = split.materialised.pieces[members[0]]
        names = tuple(split.materialised.pieces[i].name for i in members)
        reason = _not_compiled(split, members[0], nodes, grad_at_entry)
        if reason is not None:
            results.append(CompiledPiece(names, "eager", reason=reason))
            continue
        piece_gm, examples = _piece_graph(gm, split.parts[members[0]].nodes, first, nodes)
        objects, portable = _objects(split.parts[members[0]].nodes, gm)
        key = cache.key(piece_gm.code, layouts, kind)
        # Objects the code names but does not identify (a closure, a module) key by identity,
        # in memory only: another process may hold other objects under the same names.
        if objects:
            key = f"{key}-{'-'.join(map(str, objects))}"
        result = _compile(piece_gm, examples, key, disk if portable else None)
        results.append(CompiledPiece(names, *result))
        if result[0] == "eager":
            continue
        artifact = _MEMORY[result[-1]]
        size_arg, sized = _specialise(
            piece_gm, examples, layouts, key, disk if portable else None, size, sizes
        )
        for i in members:
            module = split.materialised.pieces[i]
            single = len(module.output_names) == 1
            module.forward = InductorPiece(
                artifact, module.forward, single, module.name, size_arg, sized
            )
    for record in results:
        if record.outcome == "eager":
            log.info("fxsplit: %s not compiled: %s", record.pieces[0], record.reason)
    return results


def _compile(
    piece_gm, examples, key: str, disk: cache.PieceCache | None, dynamic: str | None = None
):
    """(outcome, seconds, reason, output_code, key) for one distinct piece; ``disk`` None keeps
    it in memory only; ``dynamic`` is standalone_compile's ``dynamic_shapes`` (default:
    Dynamo's symbolic sizes)."""
    start = time.perf_counter()
    if key in _MEMORY:
        counters.totals["piece_cache_hits"] += 1
        return "memory", 0.0, None, None, key
    failed = _FAILED.get(key) or (disk.failure(key) if disk is not None else None)
    if failed is not None:
        _FAILED[key] = failed
        return "eager", 0.0, failed, None, None
    artifact = disk.load(key) if disk is not None else None
    if artifact is not None:
        _MEMORY[key] = artifact
        counters.totals["piece_cache_hits"] += 1
        return "disk", time.perf_counter() - start, None, None, key
    from torch._inductor import standalone_compile

    if dynamic is None:
        context = torch._guards.TracingContext.try_get()
        dynamic = "from_tracing_context" if context is not None else "from_graph"
    try:
        with _output_code() as code, torch.no_grad():
            artifact = standalone_compile(
                piece_gm,
                examples,
                dynamic_shapes=dynamic,
                options={"config_patches": {"triton.cudagraphs": False}},
            )
    except RestartAnalysis:
        raise
    except Exception as error:  # Inductor cannot compile it: keep the generated Python
        first_line = next(iter(str(error).splitlines()), "")
        reason = f"Inductor failed: {type(error).__name__}: {first_line}"
        log.debug("fxsplit: Inductor failed on %s", piece_gm, exc_info=True)
        _FAILED[key] = reason
        if disk is not None:
            disk.save_failure(key, reason)
        return "eager", time.perf_counter() - start, reason, None, None
    _MEMORY[key] = artifact
    if disk is not None:
        disk.save(key, artifact)
    counters.totals["pieces_compiled"] += 1
    return "compiled", time.perf_counter() - start, None, "\n\n".join(code) or None, key


_LIBRARIES = ("torch", "_operator", "operator", "math", "builtins")
_LITERALS = (int, float, bool, complex, str, type(None), slice, torch.dtype, torch.device)
_LITERALS += (torch.layout, torch.memory_format, torch.Size, type(Ellipsis))


def _objects(part_nodes, gm: GraphModule) -> tuple[tuple[int, ...], bool]:
    """(ids of the objects the piece's code names without identifying them, whether its code
    alone identifies the piece across processes). Ops and torch's functions are identified by
    their qualified names; a user function (``allow_in_graph``), a submodule or a constant
    object is printed by name or repr, which two different objects can share."""
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
    return tuple(found), not found


def _specialise_floats(split, groups, nodes, grad_at_entry: bool) -> None:
    """Ask Dynamo, once, to trace again with every symbolic float that a piece to compile
    reads made a constant.

    Dynamo lifts Python float attributes (a norm's ``eps``, an attention scale) to symbolic
    floats; Inductor cannot compile them and asks Dynamo to retrace with the one it met
    specialised, one compile at a time (a retrace of the whole frame per float, with the
    compiles before it wasted). Naming them all before any compile costs one retrace. Pass
    ``torch._dynamo.config.specialize_float=True`` to avoid even that one.

    Raises:
        RestartAnalysis: there are such floats not yet specialised (Dynamo catches it).
    """
    from torch._dynamo.symbolic_convert import TensorifyState

    floats = set()
    for members in groups.values():
        if _not_compiled(split, members[0], nodes, grad_at_entry) is not None:
            continue
        for name in split.materialised.pieces[members[0]].input_names:
            value = nodes[name].meta.get("example_value")
            if isinstance(value, torch.SymFloat) and value.node.expr.is_Symbol:
                floats.add(str(value.node.expr))
    pending = {f for f in floats if not TensorifyState.should_specialize(f)}
    if pending:
        for name in pending:
            TensorifyState.specialize(name)
        raise RestartAnalysis


def _specialise(piece_gm, examples, layouts, key: str, disk, size, sizes):
    """(argument index, {size: artifact}) for the ``compile_sizes`` of one piece: compiled on
    concrete inputs, the token count at each size, other sizes at their traced values."""
    if not sizes or not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
        return None, None
    symbol = size.node.expr
    size_arg = next(
        (
            k
            for k, value in enumerate(examples)
            if (isinstance(value, torch.SymInt) and value.node.expr == symbol)
            or (
                isinstance(value, torch.Tensor)
                and value.dim() > 0
                and isinstance(value.shape[0], torch.SymInt)
                and value.shape[0].node.expr == symbol
            )
        ),
        None,
    )
    shared = any(isinstance(lay, tuple) and lay[-1] != k for k, lay in enumerate(layouts[0]))
    if size_arg is None or shared or _symbols(examples) != {symbol}:
        # no token count here, inputs sharing storage, or other sizes or host values that a
        # compile for one token count would freeze while the key reads the token count alone
        return None, None
    sized = {}
    for n in sizes:
        concrete = [_at(value, symbol, n) for value in examples]
        sized_key = f"{key}-size{n}"
        outcome = _compile(piece_gm, concrete, sized_key, disk, dynamic="from_example_inputs")
        if outcome[0] != "eager":
            sized[n] = _MEMORY[sized_key]
    return size_arg, sized


def _at(value, symbol, n: int):
    """A concrete stand-in for an example value: ``symbol`` at ``n``, other symbols at their
    traced values (zeros for tensors: only layouts matter to a compile)."""

    def concrete(dim):
        if not isinstance(dim, torch.SymInt):
            return dim
        env = dim.node.shape_env
        hints = getattr(env, "backed_var_to_val", None) or env.var_to_val  # renamed in 2.13
        return int(
            sympy.sympify(dim.node.expr).xreplace({symbol: sympy.Integer(n)}).xreplace(hints)
        )

    if isinstance(value, torch.Tensor):
        shape = [concrete(d) for d in value.shape]
        stride = [concrete(d) for d in value.stride()]
        return torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device).zero_()
    if isinstance(value, torch.SymInt):
        return concrete(value)
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return value.node.hint
    return value


def _not_compiled(split, i: int, nodes: dict[str, Node], grad_at_entry: bool) -> str | None:
    """Why piece ``i`` keeps its generated Python, or None when Inductor may compile it."""
    module = split.materialised.pieces[i]
    plan_piece = split.plan.pieces[i]
    if module.stateful or any(global_state.is_state_node(n) for n in split.parts[i].nodes):
        return "it switches grad mode or autocast (kept as generated Python)"
    if plan_piece.random:
        return "it draws random numbers (Inductor's generator gives other numbers than eager)"
    if not module.output_names:
        return "it returns nothing"
    for name in module.input_names:
        value = nodes[name].meta.get("example_value")
        if not isinstance(value, (torch.Tensor, *_SCALARS)):
            return f"input {name} is a {type(value).__name__}, not a tensor or a size"
        if grad_at_entry and isinstance(value, torch.Tensor) and value.requires_grad:
            return f"input {name} requires grad (compiled pieces are for inference)"
    storages: dict[object, str] = {}
    for name in module.output_names:
        value = nodes[name].meta.get("example_value")
        if not isinstance(value, (torch.Tensor, torch.SymInt)):
            return f"output {name} is a {type(value).__name__}, not a tensor or a size"
        if isinstance(value, torch.Tensor):
            # AOTAutograd regenerates an output that views another output with the sizes it
            # traced, which would freeze a dynamic size
            storage = torch.multiprocessing.reductions.StorageWeakRef(value.untyped_storage())
            if storage in storages:
                return f"outputs {storages[storage]} and {name} share storage"
            storages[storage] = name
    return None


def _piece_graph(gm: GraphModule, part_nodes, module, nodes) -> tuple[GraphModule, list]:
    """The piece as a GraphModule with canonical names (inputs ``a<i>``, values ``v<j>``), so
    its code is the same for every layer, and the example values of its inputs."""
    graph = Graph()
    env: dict[Node, Node] = {}
    examples = []
    for k, name in enumerate(module.input_names):
        node = nodes[name]
        env[node] = graph.placeholder(f"a{k}")
        env[node].meta = _meta(node)
        examples.append(node.meta["example_value"])
    for j, node in enumerate(part_nodes):
        new = graph.create_node(
            node.op,
            node.target,
            torch.fx.map_arg(node.args, env.__getitem__),
            torch.fx.map_arg(node.kwargs, env.__getitem__),
            name=f"v{j}",
        )
        new.meta = _meta(node)
        env[node] = new
    graph.output(tuple(env[nodes[name]] for name in module.output_names))
    return GraphModule(gm, graph, class_name="FxsplitPiece"), examples


def _meta(node: Node) -> dict:
    """What Inductor reads of a node's meta: its example value. The rest of Dynamo's meta
    (module stacks, annotations) would enter Inductor's cache key, and some of it does not
    pickle, which turns Inductor's caches (and so the saved artifact) off."""
    return {k: node.meta[k] for k in ("example_value", "val") if k in node.meta}


def _layouts(examples) -> tuple:
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


def _symbolic(examples):
    """The symbolic sizes, strides, offsets and host values among the inputs."""
    for value in examples:
        dims = ()
        if isinstance(value, torch.Tensor):
            dims = (*value.shape, *value.stride(), value.storage_offset())
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            dims = (value,)
        yield from (d for d in dims if isinstance(d, (torch.SymInt, torch.SymFloat, torch.SymBool)))


def _symbols(examples) -> set:
    """The free symbols of the inputs' sizes, strides, offsets and host values."""
    return {symbol for dim in _symbolic(examples) for symbol in dim.node.expr.free_symbols}


def _assumptions(examples) -> tuple[str, ...]:
    """What Dynamo's shape environment knows about the sizes of ``examples`` (its guards and
    value ranges on their symbols): Inductor may simplify with it, so an artifact is shared,
    and found in the cache, only where it is the same."""
    dim = next(_symbolic(examples), None)
    if dim is None:
        return ()
    shape_env, symbols = dim.node.shape_env, _symbols(examples)
    guards = sorted(str(g.expr) for g in shape_env.guards if g.expr.free_symbols & symbols)
    ranges = [f"{s}:{shape_env.var_to_range.get(s)}" for s in sorted(symbols, key=str)]
    return (*guards, *ranges)


def _progress(items, graph_id: str):
    items = list(items)
    try:
        from tqdm import tqdm
    except ImportError:  # a bare GPU box: torch, pytest and numpy only
        return items
    if len(items) < 2:
        return items

    # Shown where a terminal watches (tqdm's own test), never in logs or pipes.
    return tqdm(
        items,
        desc=f"fxsplit {graph_id}: compiling pieces",
        unit="piece",
        disable=None,
        file=sys.stderr,
        leave=False,
    )


@contextlib.contextmanager
def _output_code() -> Iterator[list[str]]:
    """Collect the wrapper code Inductor generates inside the block (its ``save_output_code``
    hook; nothing when Inductor's own cache served the graph)."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    previous = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append
    try:
        yield codes
    finally:
        GraphLowering.save_output_code = previous
