"""Run time of one compiled graph with capture on: per-step checks around the stitched module.

Per step (:meth:`GraphRuntime.__call__`): decide whether this step may capture/replay (capture
sizes, grad mode), check parameter addresses once (a move invalidates every captured graph of
this graph and recaptures), then run the stitched module, whose captured pieces are
:class:`~fxsplit.runtime.captured.CapturedPiece` objects.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxsplit import counters
from fxsplit.config import Config
from fxsplit.facts.aliasing import PieceAliasing
from fxsplit.runtime import binding
from fxsplit.runtime.captured import CapturedPiece, CaptureRefusedError, new_own_buffer
from fxsplit.runtime.captured import buffer_key as captured_buffer_key
from fxsplit.runtime.lending import Borrower
from fxsplit.runtime.output_lifetime import can_swap, poison
from fxsplit.runtime.pool import MemoryPool
from fxsplit.runtime.stats import PieceStats
from fxsplit.runtime.storage import clone_sharing, storage_ptr, view_over
from fxsplit.warn import FxsplitRuntimeWarning, warn_at_caller

if TYPE_CHECKING:  # the compile half's record, never imported at run time
    from fxsplit.passes import Split

log = logging.getLogger("fxsplit")

_GRAD = "grad is enabled and an input requires grad"
# torch's message for a resize_ of a storage over memory it does not own (a pool's)
_NOT_RESIZABLE = "Trying to resize storage that is not resizable"
# Calls a rebound parameter must hold still before it is read by address again: a model that
# rebinds its state hands a new tensor every call, so it never gets there.
_SETTLED = 3


class ConcurrentCallError(RuntimeError):
    """A compiled graph was called while another thread was inside a call of a graph of the
    same backend. Its graphs share a memory pool and static buffers (and a step is one call of
    the model), so overlapping calls would read and write one another's memory: call a
    backend's compiled models from one thread at a time."""


class CaptureSession:
    """What a backend's compiled graphs share at run time: garbage collection once per capture
    session, the model's steps, the memory pools, and which memory fxsplit produced.

    Capturing many pieces (or many sizes) with a ``gc.collect()`` per piece made capture take
    seconds per size. A session is a step of a compiled graph, or ``Backend.capture`` around many
    steps; the first capture inside it collects and freezes, the session's end unfreezes.

    A *step* is one call of the model: it starts with a call of a graph compiled from the frame
    the caller entered, or with the next call of a graph already called in the step (a model
    whose own frame compiled no graph, a graph called twice per step). Replays keep capture
    order within a step (:mod:`fxsplit.runtime.pool`).

    Memory fxsplit produced is never the caller's (see :mod:`fxsplit.runtime.binding`): the
    outputs every pool handed out, and the outputs every graph returned on its last call (a graph
    Dynamo resumes after a graph break reads them as inputs), known by storage identity, never by
    address (the allocator hands a freed address out again at once).
    """

    def __init__(self):
        self.depth = 0
        self.frozen = False
        self.up_front = False  # Backend.capture is capturing sizes up front
        self.step = 0
        self.pools: dict[tuple[str, torch.device], MemoryPool] = {}
        self._called: set[int] = set()  # graphs called in this step
        # graph -> its last call's outputs: storage -> (weak reference, graph id, position)
        self._outputs: dict[int, dict[int, tuple[StorageWeakRef, str, int]]] = {}
        # graph -> the outputs of its calls that are still alive, in the same form; kept when
        # the graph is reset (its outputs may be the model's state)
        self._origins: dict[int, dict[int, tuple[StorageWeakRef, str, int]]] = {}
        self._swept: dict[int, int] = {}  # graph -> its origins' count after the last sweep
        self._taken: dict[int, StorageWeakRef] = {}  # private copies of a call under way
        self._warned_held = False
        self._warned_kept: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # held by the thread inside a call (own / disown)
        self._owner: int | None = None
        self._owned = 0
        _SESSIONS.add(self)

    def own(self, graph_id: str) -> None:
        """The calling thread enters a call of a graph (again, where it is already inside one:
        a graph called from another's eager code).

        Raises:
            ConcurrentCallError: another thread is inside a call (nothing is changed).
        """
        me = threading.get_ident()
        if self._owner == me:
            self._owned += 1
            return
        if not self._lock.acquire(blocking=False):
            raise ConcurrentCallError(
                f"fxsplit {graph_id}: called while another thread is inside a call of a model "
                "compiled with the same backend; its graphs share a memory pool and static "
                "buffers: call them from one thread at a time (a lock around the call)"
            )
        self._owner, self._owned = me, 1

    def disown(self) -> None:
        """The calling thread leaves the call :meth:`own` entered."""
        self._owned -= 1
        if not self._owned:
            self._owner = None
            self._lock.release()

    def pool(self, mode: str, device: torch.device) -> MemoryPool:
        """The memory pool of ``mode`` (``"cuda"`` / ``"emulate"``) on ``device``."""
        found = self.pools.get((mode, device))
        if found is None:
            found = self.pools[(mode, device)] = MemoryPool(mode, device)
        return found

    def begin_call(self, graph: object, entered: bool) -> None:
        """``graph`` is called; ``entered``: it was compiled from the frame the caller
        entered."""
        if entered or id(graph) in self._called:
            self.step += 1
            self._called.clear()
            for pool in self.pools.values():
                pool.begin_step(self.step)
                if not pool.ledger.poison and not self._warned_held:
                    self._warn_held(pool)
                for kept in pool.ledger.loans.settle():
                    self.warn_kept(*kept)
        self._called.add(id(graph))

    def _warn_held(self, pool: MemoryPool) -> None:
        # held one step after it was overwritten is no sign of keeping: in ``h = a(x); o = b(h)``
        # the old ``o``, overwritten by ``a``'s replay, is still bound while ``b`` runs
        held = pool.ledger.held_stale(self.step - 1)
        if held:
            self._warned_held = True
            warn_at_caller(
                f"fxsplit {held[0]}: an output of an earlier call is still held after a later "
                "replay reused its memory. Under capture='emulate' the tensor's values were "
                "kept by a copy, but a NumPy array or DLPack capsule made from it still reads "
                "the reused memory; on CUDA, reading it raises. Clone outputs you keep across "
                "calls (out.clone()), or compile with options={'clone_outputs': True}",
                FxsplitRuntimeWarning,
            )

    def warn_kept(self, graph_id: str, piece: str) -> None:
        """Warn once per piece that an output lent to eager code is still referenced after its
        call, where this torch can neither move nor invalidate it
        (:meth:`~fxsplit.runtime.lending.Loans.settle`)."""
        if (graph_id, piece) in self._warned_kept:
            return
        self._warned_kept.add((graph_id, piece))
        warn_at_caller(
            f"fxsplit {graph_id}: an output of captured {piece} is still referenced after the "
            "call that handed it to eager code (an op, a custom op or a hook kept it), and "
            "this torch cannot move it out of the pool: the next replay overwrites it. Clone "
            "it where it is kept (t.clone())",
            FxsplitRuntimeWarning,
        )

    def produced(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in memory fxsplit produced, by this backend or any other of
        the process (see the class docstring): one model's output handed to another model
        compiled with another backend is fxsplit's memory there too, never the caller's."""
        cdata = tensor.untyped_storage()._cdata
        return self._produced_here(tensor, cdata) or any(
            session._produced_here(tensor, cdata) for session in _SESSIONS if session is not self
        )

    def _produced_here(self, tensor: torch.Tensor, cdata: int) -> bool:
        if cdata in self._taken:
            return True
        for outputs in self._outputs.values():
            found = outputs.get(cdata)
            if found is not None and not found[0].expired():
                return True
        return self._in_pool_here(tensor)

    def in_pool(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in a memory pool of any backend of the process: a captured
        graph's output (handed out or not), whose memory later replays and captures reuse."""
        return self._in_pool_here(tensor) or any(
            session._in_pool_here(tensor) for session in _SESSIONS if session is not self
        )

    def _in_pool_here(self, tensor: torch.Tensor) -> bool:
        if not self.pools:
            return False
        ptr = tensor.untyped_storage().data_ptr()
        return any(
            pool.ledger.handed_out(tensor) is not None or ptr in pool.owners
            for pool in self.pools.values()
        )

    def record_outputs(self, graph: object, out: tuple, args: tuple = ()) -> None:
        """Remember ``graph``'s outputs of this call (by storage identity), except views of
        what the call was handed (those are the caller's)."""
        theirs = {a.untyped_storage()._cdata for a in args if _is_strided(a)}
        refs = {}
        for slot, o in enumerate(out):
            if _is_strided(o):
                storage = o.untyped_storage()
                if storage._cdata not in refs and storage._cdata not in theirs:
                    refs[storage._cdata] = (StorageWeakRef(storage), graph.graph_id, slot)
        self._outputs[id(graph)] = refs
        origins = self._origins.setdefault(id(graph), {})
        origins.update(refs)
        if len(origins) > 2 * self._swept.get(id(graph), 4):
            # forget the dead only when the live may have doubled: a caller keeping every
            # step's output would otherwise make each call walk all of them
            for cdata in [cdata for cdata, found in origins.items() if found[0].expired()]:
                del origins[cdata]
            self._swept[id(graph)] = len(origins)

    def output_slot(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        """``(graph id, output position)`` of the output of a call of a graph, still alive,
        that ``tensor`` is (or views), else None."""
        cdata = tensor.untyped_storage()._cdata
        for outputs in self._origins.values():
            found = outputs.get(cdata)
            if found is not None and not found[0].expired():
                return found[1], found[2]
        return None

    def take(self, handed: list) -> None:
        """The private copies of earlier outputs a call reads instead (see
        :meth:`GraphRuntime._take_over`) are memory fxsplit produced while the call runs."""
        for _, _, copy in handed:
            storage = copy.untyped_storage()
            self._taken[storage._cdata] = StorageWeakRef(storage)

    def forget_taken(self, handed: list) -> None:
        for _, _, copy in handed:
            self._taken.pop(copy.untyped_storage()._cdata, None)

    def close(self) -> None:
        """Release every output the pools handed out and that is still held (their memory is
        about to go): moved to memory of its own, see
        :meth:`~fxsplit.runtime.output_lifetime.OutputLedger.release_all`."""
        for pool in self.pools.values():
            pool.ledger.release_all(self.step)
        _SESSIONS.discard(self)  # its memory is released: other backends stop asking it

    def forget(self, graph: object) -> None:
        """Drop what is recorded for ``graph``."""
        self._outputs.pop(id(graph), None)
        self._called.discard(id(graph))

    def sync_mark(self, tensor: torch.Tensor) -> tuple | None:
        """``(weak reference, version, data pointer)`` of a value just copied into a static
        buffer, telling the next call whether it changed since; None where the version counter
        cannot tell (inference tensors have none; outputs in a memory pool change by replay,
        unseen)."""
        if tensor.is_inference():
            return None
        ptr = storage_ptr(tensor)
        sessions = (self, *(session for session in _SESSIONS if session is not self))
        if any(ptr in pool.owners for session in sessions for pool in session.pools.values()):
            return None
        return weakref.ref(tensor), tensor._version, tensor.data_ptr()

    def enter(self) -> None:
        """Open a (possibly nested) session; collects nothing yet."""
        self.depth += 1

    def exit(self) -> None:
        """Close a session; the outermost one unfreezes the collector if a capture froze it."""
        self.depth -= 1
        if self.depth == 0 and self.frozen:
            self.frozen = False
            gc.unfreeze()

    def collect_once(self) -> None:
        """Called before each capture: collect and freeze on the session's first capture."""
        if not self.frozen:
            gc.collect()
            if self.depth > 0:
                gc.freeze()
                self.frozen = True

    @contextlib.contextmanager
    def __call__(self):
        self.enter()
        try:
            yield
        finally:
            self.exit()


# Every live session of the process: which memory fxsplit produced is one question for all of
# them (one backend's outputs handed to a model compiled with another).
_SESSIONS: weakref.WeakSet[CaptureSession] = weakref.WeakSet()


@dataclass(frozen=True)
class Frame:
    """The Python frame a graph was compiled from.

    Attributes:
        arg_names: its argument names in signature order (where the size input is looked up).
        resumed: a frame Dynamo resumes after a graph break: its arguments are the live values
            of the model at the break, not tensors the caller handed in.
        root: the class of the ``nn.Module`` whose method the frame runs, if any.
        model: the root's class name, else the function's name (for dump folder names).
        nested: a frame called by model code that runs eagerly (Dynamo gave up on an enclosing
            frame: a graph break, a recompile limit): its arguments were computed by the model,
            not handed in by the caller.
        state_outputs: positions of the graph's outputs that Dynamo stores into a module's
            parameters or buffers after the call (``self.t = <output>``): the model's state,
            read back at its next call.
    """

    arg_names: tuple[str, ...]
    resumed: bool = False
    root: type | None = None
    model: str | None = None
    nested: bool = False
    state_outputs: frozenset[int] = frozenset()

    @property
    def model_values(self) -> bool:
        """Its tensor arguments are the model's own values (resumed or nested), fxsplit's to
        copy under every binding."""
        return self.resumed or self.nested

    @property
    def entered(self) -> bool:
        """Compiled from the frame the caller entered: its call starts a step of the model."""
        return not self.model_values


class GraphRuntime:
    """The callable Dynamo runs for one graph when capture is ``"cuda"`` or ``"emulate"``, or
    when strict binding is checked with capture off (``"check"``).

    Per call: start a step where this graph starts one, refuse invalidated outputs handed back
    in, decide whether this step may capture or replay (capture sizes, grad mode), check
    parameter addresses once (a move invalidates every captured graph of this graph and
    recaptures), copy earlier steps' outputs handed back in (this step's replays may overwrite
    them), run the stitched module, and hand its outputs out of the memory pool
    (:mod:`fxsplit.runtime.output_lifetime`).

    Args:
        split: the split graph, with its pieces' aliasing facts (its stitched module's captured
            pieces are replaced here).
        config: the options it was compiled with.
        mode: ``"cuda"``, ``"emulate"`` or ``"check"``.
        example_inputs: Dynamo's example inputs (locate the size input and parameters).
        pool: the :class:`~fxsplit.runtime.pool.MemoryPool` the graph's captures share with
            the backend's other graphs on this device; None for ``"check"``.
        device: the device of the graph's tensors.
        session: the backend's :class:`CaptureSession`.
        frame: the compiled :class:`Frame`; None when unknown.

    Attributes:
        pieces: the :class:`CapturedPiece` objects, in order.
    """

    def __init__(
        self,
        split: Split,
        config: Config,
        mode,
        example_inputs,
        pool: MemoryPool | None,
        device,
        session,
        frame: Frame | None = None,
    ):
        self.split = split
        self.graph_id = split.plan.graph_id
        self.mode = mode
        self.checking = mode == "check"
        self.pool = pool
        if pool is not None and frame is not None:
            for slot in frame.state_outputs:
                pool.ledger.state_slot(self.graph_id, slot)
        self.device = device
        self.capture_session = self.session = session
        self.binding = config.binding
        self.warmup_runs = config.warmup_runs
        self.max_captured_keys = config.max_captured_keys
        self.on_capture_error = config.on_capture_error
        self.verify = config.verify
        self.clone_outputs = config.clone_outputs
        self.capture_sizes = frozenset(config.capture_sizes) if config.capture_sizes else None
        self.capture_step = False
        self.static_outputs: dict[int, torch.Tensor] = {}
        self._buffers: dict[tuple, object] = {}  # caller view -> fxsplit's own buffer
        self._warned: set[str] = set()
        self._logged_sizes: set[int] = set()
        self._steps = 0
        self._recaptures: list[int] = []  # steps at which a parameter move dropped the graphs
        self._moves: dict[int, int] = {}  # placeholder index -> the last step it moved on
        # rebound placeholder index -> (weak reference, address, calls it held still)
        self._settling: dict[int, tuple] = {}
        self._entered = frame is None or frame.entered

        stitched = split.materialised.stitched
        self._placeholders = list(stitched.graph.find_nodes(op="placeholder"))
        self._volatile: set[str] = set()
        # a marked cache handed in as an argument is read by address through the capture key
        self._static_arguments = frozenset(
            n.name for n in self._placeholders if binding.is_static_argument(n)
        )
        self._params = [
            i
            for i, n in enumerate(self._placeholders)
            if binding.is_static_input(n) and n.name not in self._static_arguments
        ]
        self._runner_inputs = [
            i
            for i, value in enumerate(example_inputs)
            if isinstance(value, torch.Tensor) and i not in self._params
        ]
        self._param_ptrs: tuple | None = None
        self._frozen: frozenset[int] = frozenset()  # storages of parameters and buffers
        self._size_index = size_input_index(
            self._placeholders,
            example_inputs,
            self._params,
            frame.arg_names if frame is not None else None,
            config.size_input,
        )
        self._resumed = frame is not None and frame.model_values
        self._stitched = stitched
        self.pieces = self._install()
        self._forward = stitched.forward
        self._warn_unreachable_sizes()

    def _warn_unreachable_sizes(self) -> None:
        """A graph whose size input is static (``dynamic=False``, or not yet dynamic) can only
        ever capture that one size; one with no size input never captures under
        ``capture_sizes``."""
        if self.capture_sizes is None:
            return
        if self._size_index is None:
            self._warn_once(
                "no-size",
                f"fxsplit {self.graph_id}: capture_sizes={sorted(self.capture_sizes)} is set but "
                "the graph has no tensor argument to read the size from; it never captures",
            )
            return
        value = self._placeholders[self._size_index].meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            return
        size = value.shape[0]
        if isinstance(size, int) and size not in self.capture_sizes:
            self._warn_once(
                "static-size",
                f"fxsplit {self.graph_id}: the size input of this graph "
                f"({self._placeholders[self._size_index].name}) is fixed at {size} (a static "
                f"graph), which is not in capture_sizes={sorted(self.capture_sizes)}; it never "
                "captures. Compile with dynamic=True, or add the size.",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_at_caller(message)

    def _install(self) -> list[CapturedPiece]:
        split = self.split
        nodes = {n.name: n for n in split.graph_module.graph.nodes}
        producer = {}
        pieces = []
        volatile = frozenset(self._volatile)
        # marked caches handed in as arguments, and views of them a captured piece hands on
        statics = set(self._static_arguments)
        for part, module, plan_piece, facts in zip(
            split.parts, split.materialised.pieces, split.plan.pieces, split.aliasing, strict=True
        ):
            if part.kind == "captured":
                if facts is None:
                    facts = PieceAliasing(error="the split ran without the aliasing analysis")
                inputs = [nodes[name] for name in module.input_names]
                specs = binding.classify(
                    inputs,
                    producer,
                    facts.written,
                    volatile,
                    resumed=self._resumed,
                    statics=statics,
                )
                for j, base in enumerate(facts.output_bases):
                    if base is not None and inputs[base].name in statics:
                        statics.add(module.output_names[j])
                reads = binding.key_reads(specs, inputs)
                captured = CapturedPiece(
                    module, specs, reads, facts, plan_piece, self, _generators(part.nodes)
                )
                # the stitched module's generated code calls it through its instance dict
                self._stitched.register_module(captured.name, captured)
                object.__setattr__(self._stitched, captured.name, captured)
                pieces.append(captured)
            elif self.pool is not None:
                self._lend_to(module, nodes, producer, pieces)
            for name in module.output_names:
                producer[nodes[name]] = module.name
        return pieces

    def _lend_to(self, module, nodes: dict, producer: dict, captured: list) -> None:
        """Hand eager piece ``module`` the captured outputs it reads as loans
        (:mod:`fxsplit.runtime.lending`)."""
        by_name = {piece.name: piece for piece in captured}
        positions = []
        lent: dict[str, set[int]] = {}
        for i, name in enumerate(module.input_names):
            piece = by_name.get(producer.get(nodes[name]))
            if piece is not None:
                positions.append(i)
                lent.setdefault(piece.name, set()).add(piece.output_names.index(name))
        if not positions:
            return
        for name, outputs in lent.items():
            piece = by_name[name]
            piece.lent = tuple(sorted({*piece.lent, *outputs}))
        borrower = Borrower(module, tuple(positions), self.pool.ledger.loans)
        object.__setattr__(self._stitched, module.name, borrower)

    def __call__(self, *args):
        session = self.session
        session.own(self.graph_id)
        try:
            return self._call(session, args)
        finally:
            session.disown()

    def _call(self, session: CaptureSession, args: tuple):
        self._steps += 1
        session.begin_call(self, self._entered)
        pool = self.pool
        if pool is not None:
            pool.ledger.check_inputs(args, self.graph_id)
        handed = None
        self.capture_step = self._may_capture(args)
        if self.capture_step:
            if self._volatile and pool is not None:
                self._keep_state(args)
            # Earlier outputs handed back in are read before anything (a parameter move's
            # recapture included) may invalidate their memory.
            if pool is not None:
                handed = self._take_over(args, self._runner_inputs)
                args = _with_copies(args, handed)
            if self._params:
                rebound = self._check_params(args)
                if rebound:  # buffers the model rebinds to its outputs, copied before the reset
                    args = _with_copies(args, rebound)
                    handed = [*(handed or ()), *rebound]
            if self._volatile:
                self._check_settled(args)
        session.enter()
        out = ()
        try:
            out = self._forward(*args)
        except BaseException as error:
            if isinstance(error, RuntimeError) and _NOT_RESIZABLE in str(error):
                raise RuntimeError(
                    f"fxsplit {self.graph_id}: the model resized (resize_) a tensor in a "
                    "capture memory pool, an output of a captured piece; pool memory cannot "
                    "grow. Resize a clone (t = t.clone(); t.resize_(...)), or run the op that "
                    "resizes it eagerly (splitting_ops) with the work making that tensor"
                ) from error
            raise
        finally:
            session.exit()
            if handed:  # also when the model raised: the caller's tensors leave the pool
                out = _hand_back(out, handed, self.graph_id)
                session.forget_taken(handed)
        if pool is not None:
            out = self._hand_out(out, pool)
        session.record_outputs(self, out, args)
        return out

    def _take_over(self, args, indices: list[int]) -> list | None:
        """The arguments at ``indices`` that are outputs an earlier step handed out (or views of
        them): this step's replays may overwrite their memory before they are read, so the step
        reads private copies (sharing memory as the originals do), handed back afterwards.
        Outputs handed out in this step need none: replays keep capture order within a step."""
        ledger = self.pool.ledger
        step = self.pool.step
        back = [
            i for i in indices if (h := ledger.handed_out(args[i])) is not None and h.step != step
        ]
        if not back:
            return None
        copies = clone_sharing([args[i] for i in back])
        for i in back:
            ledger.adopt(args[i])
        handed = [(i, args[i], c) for i, c in zip(back, copies, strict=True)]
        self.session.take(handed)
        return handed

    def _hand_out(self, out: tuple, pool: MemoryPool) -> tuple:
        """The outputs in the pool's memory as fresh tensors the ledger follows, or clones with
        ``clone_outputs`` (keeping eager's aliasing between them)."""
        owners, ledger = pool.owners, pool.ledger
        mine = [
            j
            for j, o in enumerate(out)
            if isinstance(o, torch.Tensor)
            and storage_ptr(o) in owners
            # a view of an input that is itself an output handed out earlier in this step is
            # returned as that view: one memory, one hand-out
            and ledger.handed_out(o) is None
        ]
        if not mine:
            return out
        result = list(out)
        if self.clone_outputs or not pool.ledger.can_invalidate:
            loans, kept = pool.ledger.loans, {}
            for j, copy in zip(mine, clone_sharing([out[j] for j in mine]), strict=True):
                ptr = storage_ptr(out[j])
                if ptr not in kept:
                    kept[ptr] = loans.kept_storage(ptr)
                result[j] = copy if kept[ptr] is None else view_over(kept[ptr], out[j])
            return tuple(result)
        storages: dict[int, torch.UntypedStorage] = {}
        step, graph_id = pool.step, self.graph_id
        for j in mine:
            o = out[j]
            order = owners[storage_ptr(o)]
            result[j] = ledger.hand_out(o, storages, order, step, graph_id, j)
        return tuple(result)

    def own_buffer(self, value: torch.Tensor, rebound: bool = False):
        """fxsplit's static buffer for the caller's ``value`` holding its values, shared by
        every piece and capture key of this graph that captured the same view of the same
        tensor; ``rebound``: ``value`` is a rebound parameter (copied every call)."""
        key = captured_buffer_key(value)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.source.expired():
            buffer = self._buffers[key] = new_own_buffer(value)
            buffer.rebound = rebound
            return buffer
        buffer.rebound |= rebound
        mark = buffer.mark
        if not (
            mark is not None
            and mark[0]() is value
            and mark[1] == value._version
            and mark[2] == value.data_ptr()
        ):
            target = buffer.static if buffer.region is None else buffer.region
            source = (
                value
                if buffer.region is None
                else value.as_strided(buffer.region.shape, (1,), value.storage_offset())
            )
            with torch.no_grad():
                target.copy_(source)
            buffer.remember(self.session, value)
        return buffer

    def is_frozen_memory(self, value: torch.Tensor) -> bool:
        """Whether ``value`` lives in a parameter's or buffer's storage of this graph."""
        return bool(self._frozen) and storage_ptr(value) in self._frozen

    def _may_capture(self, args) -> bool:
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            if self.on_capture_error == "raise" and not self.checking:
                raise CaptureRefusedError(
                    f"fxsplit {self.graph_id}: grad is enabled and an input requires grad, so "
                    "pieces cannot be captured (on_capture_error='raise'); run inference under "
                    "torch.no_grad() or torch.inference_mode()"
                )
            for piece in self.pieces:
                piece.stats.refusals[_GRAD] += 1
            self._warn_once(
                "grad",
                f"fxsplit {self.graph_id}: {_GRAD}, so pieces run uncaptured (a replay returns "
                "outputs without grad_fn); run inference under torch.no_grad() or "
                "torch.inference_mode()",
            )
            return False
        if self.capture_sizes is None or self._size_index is None:
            return True
        size = args[self._size_index].shape[0]
        if size in self.capture_sizes:
            return True
        if size not in self._logged_sizes:
            self._logged_sizes.add(size)
            log.info(
                "fxsplit %s: size %s is not a capture size; runs uncaptured", self.graph_id, size
            )
        return False

    def _check_params(self, args) -> list | None:
        """Follow the parameters and buffers: recapture where they moved, or make those the
        model rebinds runner inputs; returns the private copies taken of rebound ones that are
        earlier outputs (:meth:`_take_over`), or None."""
        ptrs = tuple(args[i].data_ptr() for i in self._params)
        if self._param_ptrs is None:
            self._param_ptrs = ptrs
            self._frozen = frozenset(storage_ptr(args[i]) for i in self._params)
            # A captured graph's output (another graph's, rebound by the model as its state):
            # the pool's memory, which that graph's next output reuses and the ledger may move
            # a held tensor out of, so its address says nothing of the tensor it holds. (An
            # output of an uncaptured run, a KV cache made in a prefill, is the caller's.)
            pooled = [i for i in self._params if self.session.in_pool(args[i])]
            return self._rebind(pooled, args) if pooled else None
        if ptrs == self._param_ptrs:
            return
        moved = [i for i, a, b in zip(self._params, ptrs, self._param_ptrs, strict=True) if a != b]
        self._param_ptrs = ptrs
        self._frozen = frozenset(storage_ptr(args[i]) for i in self._params)
        # The model rebinding its buffers moves them on consecutive steps, or to memory fxsplit
        # produced (an output); reloading weights (load_state_dict(assign=True)) moves them once
        # in a while, to the caller's memory.
        produced = any(self.session.produced(args[i]) for i in moved)
        rebound = []
        for i in moved:
            if produced or self._moves.get(i) == self._steps - 1:
                rebound.append(i)
            self._moves[i] = self._steps
        if rebound:
            return self._rebind(rebound, args)
        dropped = self.reset()
        log.info(
            "fxsplit %s: parameters or buffers moved since capture (%s); dropped %d captured "
            "graphs, recapturing",
            self.graph_id,
            ", ".join(self._placeholders[i].name for i in moved),
            dropped,
        )
        if dropped:
            counters.totals["recaptures"] += 1
            self._note_recapture("parameters or buffers moved (load_state_dict(assign=True)?)")

    def _rebind(self, indices: list[int], args) -> list | None:
        """Static inputs that moved on two consecutive steps, or are outputs of a compiled graph,
        are rebound by the model itself (``self.t = self.t + 1``): from now on they are
        fxsplit's to copy, like runner inputs, until they hold still (:meth:`_check_settled`).
        Those that are earlier outputs are copied first (returned, see :meth:`_take_over`): the
        reset releases what this graph handed out (moved, or invalidated on torch 2.11), and
        this step still reads them."""
        names = [self._placeholders[i].name for i in indices]
        self._warn_once(
            "rebound:" + ",".join(names),
            f"fxsplit {self.graph_id}: {', '.join(names)} (a parameter or buffer) moved on "
            "consecutive calls or is an output of a compiled graph, so fxsplit now copies it "
            "like a runner input, every call until it holds still, instead of recapturing. "
            "Either the model rebinds it in forward (update it in place with copy_ to avoid the "
            "copy), or several instances of one module class call this compiled graph (compile "
            "each with its own fxsplit.Backend).",
        )
        self._volatile.update(names)
        self._params = [i for i in self._params if i not in indices]
        self._runner_inputs = sorted({*self._runner_inputs, *indices})
        # The others keep following from this step's addresses: forgetting them (None) took the
        # next step's move for the first look, and a graph captured on the old weights replayed.
        self._param_ptrs = tuple(args[i].data_ptr() for i in self._params)
        self._frozen = frozenset(storage_ptr(args[i]) for i in self._params)
        taken = None
        if self.pool is not None:
            self._keep_state(args)
            taken = self._take_over(args, indices)
        self.reset()
        self.pieces = self._install()
        return taken

    def _keep_state(self, args) -> None:
        """The outputs the model rebinds its parameters or buffers to are its state: tell the
        ledger which graph output each came from (:meth:`OutputLedger.keep_as_state`)."""
        ledger = self.pool.ledger
        for i in self._runner_inputs:
            if self._placeholders[i].name in self._volatile:
                handed = ledger.handed_out(args[i])
                if handed is not None:
                    found = handed.graph_id, handed.slot
                else:
                    found = self.session.output_slot(args[i])
                if found is not None:
                    ledger.keep_as_state(args[i], *found)

    def _check_settled(self, args) -> None:
        """Rebound parameters that were the same tensor at the same address, in the caller's
        memory, for the last ``_SETTLED`` calls are read by address again (weights reloaded on
        two consecutive calls, then left alone): a rebound one is copied every call."""
        settled = []
        for i in self._runner_inputs:
            if self._placeholders[i].name not in self._volatile:
                continue
            value = args[i]
            ref, ptr, calls = self._settling.get(i, (None, None, 0))
            if ref is not None and ref() is value and ptr == value.data_ptr():
                calls += 1
            else:
                ref, ptr, calls = weakref.ref(value), value.data_ptr(), 1
            self._settling[i] = (ref, ptr, calls)
            # in the pool, a replay may move it (an address says nothing of the tensor); an
            # uncaptured run's output (a cache made in a prefill) is the caller's memory, and
            # stays "produced" until its graph runs again
            if calls >= _SETTLED and not self.session.in_pool(value):
                settled.append(i)
        if not settled:
            return
        log.info(
            "fxsplit %s: %s held still for %d calls: read by address again, recapturing",
            self.graph_id,
            ", ".join(self._placeholders[i].name for i in settled),
            _SETTLED,
        )
        for i in settled:
            self._volatile.discard(self._placeholders[i].name)
            del self._settling[i]
        self._runner_inputs = [i for i in self._runner_inputs if i not in settled]
        self._params = sorted({*self._params, *settled})
        self._param_ptrs = tuple(args[i].data_ptr() for i in self._params)
        self._frozen = frozenset(storage_ptr(args[i]) for i in self._params)
        self.reset()
        self.pieces = self._install()

    def _note_recapture(self, reason: str) -> None:
        """Warn once when the graph recaptured more than a few times within a few steps."""
        steps = self._steps
        self._recaptures = [s for s in self._recaptures if s > steps - 10] + [steps]
        if len(self._recaptures) > 3:
            self._warn_once(
                "storm",
                f"fxsplit {self.graph_id}: recaptured {len(self._recaptures)} times in the last "
                f"10 steps: {reason}; every recapture costs a capture of every piece",
            )

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{piece: {key: counters}}`` for every captured piece."""
        return {p.name: p.stats.as_dict() for p in self.pieces}

    def reset(self) -> int:
        """Free every captured graph and static buffer (keys start over with warmup); outputs
        handed out of them and still held move to memory of their own
        (:meth:`~fxsplit.runtime.output_lifetime.OutputLedger.release_order`). Returns how many
        graphs were dropped."""
        dropped = 0
        for piece in self.pieces:
            for entry in piece.entries.values():
                if entry.graph is not None:
                    piece.drop(entry)
                    dropped += 1
            piece.entries.clear()
            piece.warmups.clear()
        self.static_outputs.clear()
        self._buffers.clear()
        self.session.forget(self)
        if dropped and self.pool is not None and self.pool.cuda is not None:
            self.pool.cuda.renew(f"{self.graph_id} reset")
        return dropped


def size_input_index(
    placeholders, example_inputs, params, arg_names, size_input, warn: bool = True
) -> int | None:
    """Index of the graph input whose leading dim is the token count: the first tensor argument
    of the compiled frame in its signature's order (Dynamo orders graph inputs by first use, so
    a model that reads ``block_table`` first would key on the number of sequences), or the first
    argument named by ``size_input`` (a tuple of names) that the graph has (names matching none
    warn, where ``warn``)."""
    found = size_input_indices(placeholders, example_inputs, params, arg_names, size_input, warn)
    return found[0] if found else None


def size_input_indices(
    placeholders, example_inputs, params, arg_names, size_input, warn: bool = True
) -> tuple[int, ...]:
    """Indices of every graph input whose leading dim is the token count, the one
    :func:`size_input_index` returns first, then the others ``size_input`` names (in its order);
    empty where the graph has no tensor argument."""
    candidates = [
        i
        for i, value in enumerate(example_inputs)
        if isinstance(value, torch.Tensor) and i not in params and value.dim() > 0
    ]
    if not candidates:
        return ()
    names = {i: _argument(placeholders[i]) for i in candidates}
    if size_input:
        by_name = {names[i]: i for i in reversed(candidates)}  # the first input of each name
        named = tuple(by_name[n] for n in size_input if n in by_name)
        if named:
            return named
    if size_input and warn:
        given = size_input[0] if len(size_input) == 1 else list(size_input)
        warn_at_caller(
            f"fxsplit: size_input={given!r} names no tensor argument of this graph "
            f"(tensor arguments: {', '.join(sorted(n for n in names.values() if n)) or 'none'}); "
            "using the first tensor argument"
        )
    if arg_names:
        order = {name: k for k, name in enumerate(arg_names)}
        ranked = sorted(candidates, key=lambda i: (order.get(names[i], len(order)), i))
        return (ranked[0],)
    return (candidates[0],)


def _argument(node) -> str | None:
    """The frame argument a placeholder comes from: ``x`` for source ``L['x']``."""
    grapharg = node.meta.get("grapharg")
    name = getattr(getattr(grapharg, "source", None), "name", None)
    name = name() if callable(name) else name
    if isinstance(name, str) and name.startswith("L['") and name.endswith("']"):
        return name[3:-2]
    return None


def _is_strided(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided


def _generators(nodes) -> tuple:
    """The CUDA generators other than the default ones that ``nodes`` pass to their ops."""
    found: dict[int, torch.Generator] = {}
    for node in nodes:
        for value in tree_leaves((node.args, node.kwargs)):
            if isinstance(value, torch.Generator) and value.device.type == "cuda":
                found.setdefault(id(value), value)
    return tuple(found.values())


def _with_copies(args: tuple, handed: list | None) -> tuple:
    """``args`` with the private copies of :meth:`GraphRuntime._take_over` in place."""
    if not handed:
        return args
    args = list(args)
    for i, _, copy in handed:
        args[i] = copy
    return tuple(args)


def _hand_back(out: tuple, handed: list, graph_id: str) -> tuple:
    """After a step that read private copies of earlier outputs handed back in: each handed-in
    tensor takes memory of its own holding the model's writes to it as eager would leave them
    (its storage swaps data pointers with a clone of the copy's, so every view of it follows,
    and the pool memory it lived in is no longer the caller's); the copy keeps its own memory
    (an op may have kept it, as eager's would keep the handed-in tensor); outputs over a copy
    become the same views of the handed-in tensor, as eager returns them."""
    swapped: dict[int, torch.UntypedStorage] = {}
    for _, original, copy in handed:
        theirs, mine = original.untyped_storage(), copy.untyped_storage()
        if mine._cdata in swapped:
            continue
        if can_swap():
            theirs._swap_data_ptr_(mine.clone())
        else:  # torch 2.11: it stays in the pool's memory, which this step's outputs reuse
            poison(original, graph_id)
        swapped[mine._cdata] = theirs
    return tuple(
        view_over(swapped[o.untyped_storage()._cdata], o)
        if _is_strided(o) and o.untyped_storage()._cdata in swapped
        else o
        for o in out
    )


__all__ = ["CaptureSession", "ConcurrentCallError", "Frame", "GraphRuntime", "PieceStats"]
