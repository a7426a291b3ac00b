"""Inductor pass: compile each distinct captured piece once with Inductor, and cache it.

A split graph is a row of pieces, most of them one per layer and structurally identical: the
same code (:attr:`fxsplit.passes.materialise.PieceModule.shared_code`, canonical names) on inputs
of the same layout. Parameters are inputs of the pieces (Dynamo inlines ``nn.Module`` calls and
lifts their parameters), so one compiled artifact serves every layer, and compile time stops
growing with depth.

Each distinct piece is compiled through ``torch._inductor.standalone_compile`` (AOTAutograd's
functionalization, then Inductor: Triton kernels on GPUs, C++ on the CPU; Inductor's own CUDA
graphs off, fxsplit captures), with the dynamic sizes Dynamo traced (one symbolic compile per
piece; floats as :mod:`fxsplit.passes.piece_graph` describes). Artifacts are kept in memory for
the process and on disk (:mod:`fxsplit.cache`) for later runs, under the key of
:mod:`fxsplit.passes.piece_key`; a precompiled graph's travel in its bundle and load at their
second call (:class:`Deferred`). Pieces Inductor should not compile keep their generated Python,
with the reason recorded: pieces that re-enter global state across a boundary, draw random
numbers (Inductor's generator would give other numbers than eager), take non-tensor inputs
other than sizes (the subgraphs of higher-order ops), return nothing or non-tensors, or read
tensors that require grad; and any piece Inductor fails on (remembered, in memory and on disk,
so it is tried once).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
from torch.fx import Node

from fxsplit import cache, counters
from fxsplit.facts.op_facts import changes_layout
from fxsplit.passes import global_state, inductor_startup, partition, piece_graph, piece_key

log = logging.getLogger("fxsplit")

COMPILE_MODES = ("auto", "inductor", "eager")

# What Inductor's pass for Python scalars raises when a float must be specialised.
RestartAnalysis = torch._dynamo.exc.TensorifyScalarRestartAnalysis
COMPILED, DISK, MEMORY, BUNDLE, EAGER = "compiled", "disk", "memory", "bundle", "eager"
PENDING = "pending"  # a precompiled graph's piece, loaded from its bundle at its second call

_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
# Precompiled graphs' pieces waiting for their second call (Deferred), while they live.
_DEFERRED: weakref.WeakSet = weakref.WeakSet()
_OUTCOME_WORDS = {
    BUNDLE: "loaded from the bundle",
    DISK: "loaded from the piece cache",
    MEMORY: "found in memory",
    COMPILED: "compiled",
}
# Artifacts compiled or loaded in this process, and why Inductor failed, by cache key.
_MEMORY: dict[str, object] = {}
_FAILED: dict[str, str] = {}
# Their binary format, kept for precompiled graphs to bundle: an artifact Inductor loaded
# cannot be saved again, and the piece cache it came from may be another graph's.
_PAYLOADS: dict[str, bytes] = {}


@dataclass
class CompiledPiece:
    """What the pass did for one distinct captured piece.

    Attributes:
        pieces: the pieces sharing it, in order (the first is the one compiled).
        outcome: ``"compiled"`` (by Inductor now), ``"disk"`` / ``"memory"`` (cache hits),
            ``"bundle"`` (loaded with a precompiled graph), ``"pending"`` (to load from the
            precompiled graph's bundle at its second call) or ``"eager"`` (kept as generated
            Python; see ``reason``).
        seconds: wall time of the compile or load.
        reason: why it stayed eager; None otherwise.
        output_code: Inductor's generated wrapper code, where this process generated it.
        key: the cache key (:class:`fxsplit.passes.piece_key.Key` name; None when eager or
            loaded with a precompiled graph).
        identity: the piece within its graph (:func:`fxsplit.passes.piece_key.identity`).
        sized: the cache key of the compile of each ``compile_sizes`` token count, where this
            process compiled or loaded it from the piece cache.
    """

    pieces: tuple[str, ...]
    outcome: str
    seconds: float = 0.0
    reason: str | None = None
    output_code: str | None = None
    key: str | None = None
    identity: str | None = None
    sized: dict[int, str] = field(default_factory=dict)


class InductorPiece:
    """A piece's ``forward`` running a compiled artifact: same arguments, same return value
    structure (one value as is, several as a tuple).

    Attributes:
        artifact: the compiled callable (returns a list of outputs), symbolic in the sizes.
        eager: the piece's generated Python (capture-legality checks run it, see
            :mod:`fxsplit.runtime.piece.captured`).
        inputs: how the piece's arguments become the artifact's (a float argument as a 0-dim
            tensor, a specialised float left out: :class:`fxsplit.passes.piece_graph.Inputs`);
            None when they are the same.
        size_arg / sized: with ``compile_sizes``, the argument of the artifact carrying the
            token count (a tensor's leading dim, or the size itself) and the artifact compiled
            for each size.
        tail: the views that make the piece's outputs from the artifact's results, or None
            (:class:`fxsplit.passes.piece_graph.PieceGraph`).
        pending: a precompiled graph's artifact not loaded yet (:class:`Deferred`), else
            None: the piece's first call runs its generated Python, its second loads the
            artifact (``artifact`` is None until then).
        ran: the piece's first call (its generated Python) has run.
    """

    __slots__ = (
        "artifact",
        "eager",
        "inputs",
        "name",
        "pending",
        "ran",
        "single",
        "size_arg",
        "sized",
        "tail",
    )

    def __init__(
        self,
        artifact,
        eager,
        single: bool,
        name: str,
        inputs=None,
        size_arg=None,
        sized=None,
        tail=None,
        pending: Deferred | None = None,
    ):
        self.artifact = artifact
        self.eager = eager
        self.single = single
        self.name = name
        self.inputs = inputs
        self.size_arg = size_arg
        self.sized = sized
        self.tail = tail
        self.pending = pending
        self.ran = False

    def __call__(self, *args):
        if self.pending is not None:
            return self._unloaded(args)
        given = args
        if self.inputs is not None:
            args = self.inputs(args)
        artifact = self.artifact
        if self.sized:
            size = args[self.size_arg]
            artifact = self.sized.get(size if type(size) is int else size.shape[0], artifact)
        out = artifact(*args)
        if self.tail is not None:
            out = self.tail(*given, *out)
        return out[0] if self.single else tuple(out)

    @property
    def ready(self) -> bool:
        """Whether the next call runs the code the piece keeps: false only before a precompiled
        graph's piece has run once (that call runs its generated Python; the next one loads the
        artifact). The capture counts a call as a warm-up only where this held before it:
        Triton compiles a kernel at its first launch, which a CUDA capture would record. Asked
        after the call instead, a load by another thread meanwhile (``load_deferred``) would
        make a run of the generated Python count."""
        return self.pending is None or self.pending.python or self.ran

    def _unloaded(self, args):
        pending = self.pending
        if not pending.done:
            if not self.ran:
                self.ran = True
                return self.eager(*args)
            pending.load()
        if pending.python:  # neither loaded nor compiled: generated Python from now on
            return self.eager(*args)
        return self(*args)

    def __repr__(self) -> str:
        return f"inductor:{self.name}"


class Deferred:
    """The artifacts of one distinct piece of a precompiled graph, loaded from the graph's
    bundle at the second call of any piece sharing them.

    Loading is mostly Inductor's per-process start-up (:mod:`fxsplit.passes.inductor_startup`:
    about 1 s on a CPU, more than a one-layer model's whole first call eagerly), which runs in
    the background while the first call runs the pieces' generated Python, as Inductor's own
    asynchronous compile runs a graph eagerly until its compiled code is ready
    (``torch._inductor.compile_fx_async``). The switch is at a fixed call, not whenever the
    load ends: which kernels compute a call's numbers, and when a piece captures, do not
    depend on timing. The load itself runs on the calling thread: it patches Inductor's
    global configuration while it runs. Threads reaching it together wait for the first one's
    load (one load, or compile, per distinct piece), and ``done`` is set once every member
    runs the result.

    Attributes:
        members: the :class:`InductorPiece` of every piece sharing the artifacts.
        done: loaded (or given up: ``python``).
        python: the bundle's artifact could not be loaded, nor found or compiled in its
            place: the pieces keep their generated Python.
    """

    def __init__(self, resolve, records: list[CompiledPiece], index: int, grad: bool):
        self._resolve = resolve
        self._records = records
        self._index = index
        self._grad = grad
        self.members: list[InductorPiece] = []
        self.done = False
        self.python = False
        self._lock = threading.Lock()
        _DEFERRED.add(self)

    def load(self) -> None:
        """Load (or find, or compile) the artifacts, hand them to every member and record
        the outcome in the graph's records (:attr:`fxsplit.passes.Split.compiled_pieces`);
        nothing where another thread did (this one waits for it)."""
        with self._lock:
            if self.done:
                return
            with torch.set_grad_enabled(self._grad):
                record, artifact, sized = self._resolve()
            self._resolve = None  # the bundle's bytes and the piece's graph: not needed again
            _DEFERRED.discard(self)
            self._records[self._index] = record
            if artifact is None:
                self.python = True
                self.done = True
                log.info("fxsplit: %s not compiled: %s", record.pieces[0], record.reason)
                return
            log.info(
                "fxsplit: %s at its second call: %s, %.2f s",
                record.pieces[0],
                _OUTCOME_WORDS[record.outcome],
                record.seconds,
            )
            for piece in self.members:
                piece.artifact, piece.sized, piece.pending = artifact, sized, None
            self.done = True


def load_deferred() -> None:
    """Load now every compiled piece of this process that waits for its second call
    (:class:`Deferred`): capturing up front wants every piece as it will run."""
    for deferred in list(_DEFERRED):
        deferred.load()


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
    _PAYLOADS.clear()


def payload(key: str) -> bytes | None:
    """The binary format of the artifact compiled or loaded under ``key`` in this process
    (what a precompiled graph bundles); None where Inductor could not save it."""
    return _PAYLOADS.get(key)


def compile_pieces(
    split,
    device: torch.device | None,
    cache_root: Path,
    grad_at_entry: bool,
    size: object = None,
    sizes: tuple[int, ...] = (),
    bundle: dict[str, bytes | str] | None = None,
) -> list[CompiledPiece]:
    """Compile every distinct captured piece of ``split`` and make its pieces run the result.

    Replaces ``forward`` of each compiled :class:`~fxsplit.passes.materialise.PieceModule` with
    an :class:`InductorPiece`. Plans do not change. Logs one INFO line: how many distinct
    pieces were compiled, loaded or left as generated Python, and the seconds it took.

    Args:
        split: the :class:`fxsplit.passes.Split` of one graph.
        device: the graph's CUDA device, or None (CPU).
        cache_root: the cache folder (:func:`fxsplit.cache.cache_dir`).
        grad_at_entry: grad mode when the graph is called.
        size: the token count as Dynamo traced it (the leading dim of the size input: a SymInt
            when dynamic), for ``sizes``.
        sizes: the ``compile_sizes`` option: token counts that get a compile of their own.
        bundle: a precompiled graph's compiled pieces (Inductor's artifacts by
            :func:`fxsplit.passes.piece_key.identity`, their compiles for single token counts
            by :func:`~fxsplit.passes.piece_key.sized_identity`: :mod:`fxsplit.precompile`),
            loaded without keys or guards, as they were compiled, and why Inductor failed on
            a piece (a str: it stays generated Python); the rest as usual.

    Returns:
        one :class:`CompiledPiece` per distinct captured piece, in graph order.
    """
    start = time.perf_counter()
    inductor_startup.warmed()  # a precompiled graph loaded just before may still import
    gm = split.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    floats = piece_graph.float_sources(gm)
    relaid = _relaid_out(gm)
    position = {node: k for k, node in enumerate(gm.graph.nodes)} if relaid else {}
    groups: dict[tuple, list[int]] = {}
    for i, each in enumerate(split.pieces):
        part, module = each.part, each.module
        if part.kind == partition.CAPTURED:
            examples = [nodes[name].meta.get("example_value") for name in module.input_names]
            layouts = (
                piece_graph.layouts(examples),
                piece_graph.assumptions(examples),
                piece_graph.constants(examples, floats),
            )
            groups.setdefault((module.shared_code, layouts), []).append(i)
    disk = cache.PieceCache(cache_root)
    kind = cache.device_kind(device)
    context = torch._guards.TracingContext.try_get()
    dynamic = "from_tracing_context" if context is not None else "from_graph"
    results = []
    for (code, layouts), members in _progress(groups.items(), split.plan.graph_id):
        first = split.pieces[members[0]].module
        part_nodes = split.pieces[members[0]].part.nodes
        names = tuple(split.pieces[i].module.name for i in members)
        reason = _not_compiled(split, members[0], nodes, grad_at_entry)
        if reason is None and relaid:  # one artifact serves every member: each must fit it
            reason = next(
                filter(None, (_relaid_reason(split, i, nodes, relaid, position) for i in members)),
                None,
            )
        piece = None
        if reason is None:
            # a precompiled frame's guards were built when it was compiled
            piece = piece_graph.build(gm, part_nodes, first, nodes, floats, guard=bundle is None)
            reason = piece.reason
        if reason is not None:
            results.append(CompiledPiece(names, EAGER, reason=reason))
            continue
        identity = piece_key.identity(code, layouts)
        failed = bundle.get(identity) if bundle else None
        if isinstance(failed, str):
            results.append(CompiledPiece(names, EAGER, reason=failed, identity=identity))
            continue
        size_arg = _size_arg(piece, size, sizes)
        objects = piece_graph.objects(part_nodes, gm)
        resolve = functools.partial(
            _artifacts,
            piece,
            names,
            identity,
            bundle,
            sizes if size_arg is not None else (),
            size,
            functools.partial(_keyed, piece, names[0], dynamic, kind, objects, disk),
            dynamic,
        )
        deferred = None
        if bundle and isinstance(bundle.get(identity), bytes):
            deferred = Deferred(resolve, results, len(results), grad_at_entry)
            record, artifact, sized = CompiledPiece(names, PENDING, identity=identity), None, {}
        else:
            record, artifact, sized = resolve()
        results.append(record)
        if record.outcome == EAGER:
            continue
        for i in members:
            module = split.pieces[i].module
            module.forward = InductorPiece(
                artifact,
                module.forward,
                len(module.output_names) == 1,
                module.name,
                piece.inputs,
                size_arg,
                sized,
                piece.tail,
                deferred,
            )
            if deferred is not None:
                deferred.members.append(module.forward)
    for record in results:
        if record.outcome == EAGER:
            log.info("fxsplit: %s not compiled: %s", record.pieces[0], record.reason)
    if results:
        log.info("fxsplit %s compiled pieces: %s", split.plan.graph_id, summary(results, start))
    return results


def _keyed(piece: piece_graph.PieceGraph, name: str, dynamic: str, kind: str, objects, disk):
    """The piece's cache key and the store it is saved in (None: memory only)."""
    key = piece_key.key(piece, dynamic, kind, objects)
    if not key.portable:
        log.debug("fxsplit: %s is cached in memory only: %s", name, key.why)
    return key, disk if key.portable else None


def _artifacts(
    piece: piece_graph.PieceGraph,
    names: tuple[str, ...],
    identity: str,
    bundle,
    wanted: tuple[int, ...],
    size,
    keyed,
    dynamic: str,
):
    """``(record, artifact, sized)`` for one distinct piece: its artifact from ``bundle``, else
    from the piece cache or a compile (None when it stays generated Python), and the artifact
    of each ``wanted`` token count the same way (``size``: the traced token count; ``keyed``:
    the piece's key and store, asked only where something is not in the bundle)."""
    loading = time.perf_counter()
    artifact = _from_bundle(bundle, identity)
    sized = {n: _from_bundle(bundle, piece_key.sized_identity(identity, n)) for n in wanted}
    if artifact is not None:
        record = CompiledPiece(names, BUNDLE, time.perf_counter() - loading, identity=identity)
    if artifact is None or None in sized.values():
        key, store = keyed()
    if artifact is None:
        record = CompiledPiece(names, *_compile(piece, key, store, dynamic), identity=identity)
        if record.outcome == EAGER:
            return record, None, {}
        artifact = _MEMORY[key.name]
    for n in wanted:
        if sized[n] is None:
            sized_key = key.sized(n)
            at_n = _at_size(piece, size.node.expr, n)
            if _compile(at_n, sized_key, store, "from_example_inputs")[0] != EAGER:
                sized[n] = _MEMORY[sized_key.name]
                record.sized[n] = sized_key.name
    return record, artifact, {n: found for n, found in sized.items() if found is not None}


def summary(records: list[CompiledPiece], start: float | None = None) -> str:
    """``"3 distinct: 1 compiled, 2 loaded (2 disk), 0 left as Python, 4.2 s"`` (and ``", 2 to
    load at their second call"`` for a precompiled graph's pending pieces); the seconds are the
    records' own, or since ``start`` (``time.perf_counter()``)."""
    outcomes = Counter(r.outcome for r in records)
    loaded = outcomes[DISK] + outcomes[MEMORY] + outcomes[BUNDLE]
    where = ", ".join(f"{outcomes[o]} {o}" for o in (DISK, MEMORY, BUNDLE) if outcomes[o])
    pending = outcomes[PENDING]
    seconds = time.perf_counter() - start if start is not None else sum(r.seconds for r in records)
    return (
        f"{len(records)} distinct: {outcomes[COMPILED]} compiled, {loaded} loaded"
        f"{f' ({where})' if where else ''}"
        f"{f', {pending} to load at their second call' if pending else ''}, "
        f"{outcomes[EAGER]} left as Python, {seconds:.1f} s"
    )


def _from_bundle(bundle, identity: str):
    """The artifact of a precompiled graph's piece; None where the bundle lacks it or Inductor
    cannot read it (the piece is then looked up or compiled as usual)."""
    if not bundle or identity not in bundle:
        return None
    inductor_startup.ready()
    try:
        artifact = cache.load_artifact(bundle[identity])
    except Exception as error:
        log.info("fxsplit: a precompiled piece could not be loaded (%s); compiling", error)
        return None
    counters.totals["piece_cache_hits"] += 1
    return artifact


def _compile(piece: piece_graph.PieceGraph, found: piece_key.Key, disk, dynamic: str):
    """(outcome, seconds, reason, output_code, key) for one distinct piece; ``disk`` None keeps
    it in memory only; ``dynamic`` is standalone_compile's ``dynamic_shapes``."""
    start = time.perf_counter()
    key = found.name
    if key in _MEMORY:
        counters.totals["piece_cache_hits"] += 1
        if disk is not None and key in _PAYLOADS and not disk.path(key).exists():
            disk.save(key, _PAYLOADS[key])  # another backend's folder: its next run loads it
        return MEMORY, 0.0, None, None, key
    marker = disk.failure(key) if disk is not None else None
    failed = _FAILED.get(key) or marker
    if failed is not None:
        _FAILED[key] = failed
        if disk is not None and marker is None:
            disk.save_failure(key, failed)  # as for artifacts: this folder's next run knows
        return EAGER, 0.0, failed, None, None
    inductor_startup.ready()
    stored = disk.load(key) if disk is not None else None
    if stored is not None:
        _MEMORY[key], _PAYLOADS[key] = stored
        counters.totals["piece_cache_hits"] += 1
        return DISK, time.perf_counter() - start, None, None, key
    from torch._inductor import standalone_compile

    try:
        with (
            _output_code() as code,
            _other_floats_settled(piece),
            found.tagged(),
            piece_key.standalone(),
            torch.no_grad(),
        ):
            artifact = standalone_compile(
                piece.graph_module,
                piece.examples,
                dynamic_shapes=dynamic,
                options={"config_patches": {"triton.cudagraphs": False}},
            )
    except RestartAnalysis:
        reason = (
            "Inductor cannot keep its float arguments symbolic "
            f"({', '.join(sorted(piece.float_symbols))})"
        )
        return _failed(key, disk, reason, start)
    except Exception as error:  # Inductor cannot compile it: keep the generated Python
        first_line = next(iter(str(error).splitlines()), "")
        log.debug("fxsplit: Inductor failed on %s", piece.graph_module, exc_info=True)
        reason = f"Inductor failed: {type(error).__name__}: {first_line}"
        return _failed(key, disk, reason, start)
    _MEMORY[key] = artifact
    saved = cache.payload_of(artifact, disk.folder if disk is not None and disk.usable() else None)
    if saved is not None:
        _PAYLOADS[key] = saved
        if disk is not None:
            disk.save(key, saved)
    counters.totals["pieces_compiled"] += 1
    return COMPILED, time.perf_counter() - start, None, "\n\n".join(code) or None, key


def _failed(key: str, disk, reason: str, start: float):
    """Remember that Inductor fails on ``key`` (in memory and on disk): tried once."""
    _FAILED[key] = reason
    if disk is not None:
        disk.save_failure(key, reason)
    return EAGER, time.perf_counter() - start, reason, None, None


@contextlib.contextmanager
def _other_floats_settled(piece: piece_graph.PieceGraph) -> Iterator[None]:
    """Inductor's pass for Python scalars asks Dynamo to trace the frame again with every
    symbolic float of the frame it did not turn into tensor arithmetic specialised: here,
    the floats of the frame's other pieces too. For the length of one compile, mark those as
    settled (Dynamo's own record of floats to specialise, restored afterwards), so only the
    piece's own float arguments can make it give up."""
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    context = torch._guards.TracingContext.try_get()
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    saved = set(TensorifyState.force_specializations)
    if shape_env is not None:
        # renamed in 2.13
        values = getattr(shape_env, "backed_var_to_val", None)
        values = shape_env.var_to_val if values is None else values
        others = {str(s) for s in values if symbol_is_type(s, SymT.FLOAT)}
        TensorifyState.force_specializations.update(others - piece.float_symbols)
    try:
        yield
    finally:
        TensorifyState.force_specializations.clear()
        TensorifyState.force_specializations.update(saved)


def _size_arg(piece: piece_graph.PieceGraph, size, sizes) -> int | None:
    """The argument of ``piece`` carrying the token count ``size`` (a SymInt: the leading dim
    of the size input as Dynamo traced it) where the ``compile_sizes`` get compiles of their
    own, else None."""
    if not sizes or not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
        return None
    examples = piece.examples
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
    layouts = piece_graph.layouts(examples)
    shared = any(isinstance(lay, tuple) and lay[-1] != k for k, lay in enumerate(layouts))
    floats = piece.inputs is not None and piece.inputs.floats
    if size_arg is None or shared or floats or piece_graph.symbols(examples) != {symbol}:
        # no token count here, inputs sharing storage, float arguments, or other sizes or
        # host values that a compile for one token count would freeze while the key reads
        # the token count alone
        return None
    return size_arg


def _at_size(piece: piece_graph.PieceGraph, symbol, n: int) -> piece_graph.PieceGraph:
    """``piece`` on concrete inputs for a compile of its own: the token count ``symbol`` at
    ``n``, other sizes at their traced values."""
    return piece_graph.PieceGraph(
        piece.graph_module,
        [_at(value, symbol, n) for value in piece.examples],
        piece.inputs,
        piece.float_symbols,
    )


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


def _relaid_out(gm: torch.fx.GraphModule) -> dict[int, int]:
    """The example values (by ``id``) whose layout an op of ``gm`` changes in place
    (:func:`~fxsplit.facts.op_facts.changes_layout`), each with the position of the last such
    op among the graph's nodes. Dynamo's fake tensor is changed with the real one, so every
    node over such a tensor holds its last layout as its example, not the one a piece before
    that op reads."""
    last = {}
    for k, node in enumerate(gm.graph.nodes):
        if changes_layout(node) and node.args and isinstance(node.args[0], Node):
            value = node.args[0].meta.get("example_value")
            if isinstance(value, torch.Tensor):
                last[id(value)] = k
    return last


def _relaid_reason(
    split, i: int, nodes: dict[str, Node], relaid: dict[int, int], position: dict[Node, int]
) -> str | None:
    """Why piece ``i`` keeps its generated Python because an input or output of it changes
    layout in place after it (``relaid``: :func:`_relaid_out`; ``position``: each node's
    among the graph's), else None. A captured piece changes no layout itself."""
    module = split.pieces[i].module
    start = position[split.pieces[i].part.nodes[0]]
    for kind, names in (("input", module.input_names), ("output", module.output_names)):
        for name in names:
            if relaid.get(id(nodes[name].meta.get("example_value")), -1) > start:
                return (
                    f"{kind} {name}: its layout changes in place later in the graph, so its "
                    "example is not its layout here"
                )
    return None


def _not_compiled(split, i: int, nodes: dict[str, Node], grad_at_entry: bool) -> str | None:
    """Why piece ``i`` keeps its generated Python, or None when Inductor may compile it."""
    module, plan_piece, part = split.pieces[i].module, split.pieces[i].plan, split.pieces[i].part
    if module.stateful or any(global_state.is_state_node(n) for n in part.nodes):
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
    for name in module.output_names:
        value = nodes[name].meta.get("example_value")
        if not isinstance(value, (torch.Tensor, torch.SymInt)):
            return f"output {name} is a {type(value).__name__}, not a tensor or a size"
    return None  # outputs sharing storage: piece_graph.build


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
