"""What a backend's compiled graphs share at run time (a :class:`CaptureSession`): one thread
inside a call at a time, the model's steps, the memory pools, and the process-wide record of which
memory fxsplit produced.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit.runtime.pool import MemoryPool
from fxsplit.runtime.storage import is_strided, storage_ptr
from fxsplit.warn import FxsplitRuntimeWarning, warn_at_caller

__all__ = ["CaptureSession", "ConcurrentCallError"]


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
        self._calls = 0  # graph calls under way (more than one: a call inside another's)
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
        entered. A call inside another graph's call (a compiled model called by an eager
        piece's op) is part of that call's step: a new step would let its graph replay out of
        capture order over the outer graph's live outputs."""
        nested = self._calls > 0
        self._calls += 1
        if not nested and (entered or id(graph) in self._called):
            self.step += 1
            self._called.clear()
            for pool in self.pools.values():
                pool.begin_step(self.step)
                if not pool.ledger.poison and not self._warned_held:
                    self._warn_held(pool)
                for kept in pool.ledger.loans.settle():
                    self.warn_kept(*kept)
        self._called.add(id(graph))

    def end_call(self) -> None:
        """The call :meth:`begin_call` began returned or raised."""
        self._calls -= 1

    def _warn_held(self, pool: MemoryPool) -> None:
        held = pool.ledger.held_stale()
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
        theirs = {a.untyped_storage()._cdata for a in args if is_strided(a)}
        refs = {}
        for slot, o in enumerate(out):
            if is_strided(o):
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
