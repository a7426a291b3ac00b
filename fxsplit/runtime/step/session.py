"""What a backend's compiled graphs share at run time (a :class:`CaptureSession`): one thread
inside a call at a time, the model's steps, and the memory pools. Which memory fxsplit produced is
one record for the whole process, shared by every backend: :mod:`fxsplit.runtime.memory.provenance`.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import torch

from fxsplit.runtime.memory import provenance
from fxsplit.runtime.memory.pool import MemoryPool
from fxsplit.warn import FxsplitRuntimeWarning, warn_at_caller

__all__ = ["CaptureSession", "ConcurrentCallError"]


class ConcurrentCallError(RuntimeError):
    """A compiled graph was called while another thread was inside a call of a graph of the
    same backend. Its graphs share a memory pool and static buffers (and a step is one call of
    the model), so overlapping calls would read and write one another's memory: call a
    backend's compiled models from one thread at a time."""


class CaptureSession:
    """What a backend's compiled graphs share at run time: garbage collection once per capture
    session, the model's steps, and the memory pools.

    Capturing many pieces (or many sizes) with a ``gc.collect()`` per piece made capture take
    seconds per size. A session is a step of a compiled graph, or ``Backend.capture`` around many
    steps; the first capture inside it collects and freezes, the session's end unfreezes.

    A *step* is one call of the model: it starts with a call of a graph compiled from the frame
    the caller entered, or with the next call of a graph already called in the step (a model
    whose own frame compiled no graph, a graph called twice per step). Replays keep capture
    order within a step (:mod:`fxsplit.runtime.memory.pool`).

    The session's pools, and what its graphs return, are in the process-wide record of which
    memory fxsplit produced (:data:`fxsplit.runtime.memory.provenance.RECORD`) until it closes.
    """

    def __init__(self):
        self.depth = 0
        self.frozen = False
        self.up_front = False  # Backend.capture is capturing sizes up front
        self.step = 0
        self.pools: dict[tuple[str, torch.device], MemoryPool] = {}
        self._called: dict[int, int] = {}  # id -> calls in this step, of each graph called
        self._calls = 0  # graph calls under way (more than one: a call inside another's)
        self._warned_kept: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # held by the thread inside a call (own / disown)
        self._owner: int | None = None
        self._owned = 0

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
            provenance.RECORD.add_pool(found)
        return found

    def begin_call(self, graph: object, entered: bool) -> int:
        """``graph`` is called; ``entered``: it was compiled from the frame the caller
        entered. A call inside another graph's call (a compiled model called by an eager
        piece's op) is part of that call's step: a new step would let its graph replay out of
        capture order over the outer graph's live outputs. Returns how many calls of ``graph``
        came before this one in the step (more than none only inside another graph's call:
        :attr:`~fxsplit.runtime.step.context.GraphContext.repeat`)."""
        nested = self._calls > 0
        self._calls += 1
        called = self._called
        key = id(graph)
        if not nested and (entered or key in called):
            self.step += 1
            called.clear()
            for pool in self.pools.values():
                pool.begin_step(self.step)
                for kept in pool.ledger.loans.settle():
                    self.warn_kept(*kept)
        before = called.get(key, 0)
        called[key] = before + 1
        return before

    def end_call(self) -> None:
        """The call :meth:`begin_call` began returned or raised."""
        self._calls -= 1

    def warn_kept(self, graph_id: str, piece: str) -> None:
        """Warn once per piece that an output lent to eager code is still referenced after its
        call, where this torch can neither move nor invalidate it
        (:meth:`~fxsplit.runtime.memory.lending.Loans.settle`)."""
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

    def close(self) -> None:
        """Release every output the pools handed out and that is still held (their memory is
        about to go): moved to memory of its own, see
        :meth:`~fxsplit.runtime.memory.output_lifetime.OutputLedger.release_all`. Its pools and what
        its graphs returned leave the process-wide record: other backends stop asking them."""
        for pool in self.pools.values():
            pool.ledger.release_all()
            provenance.RECORD.drop_pool(pool)
        provenance.RECORD.close(self)

    def forget(self, graph: object) -> None:
        """``graph`` is reset: drop what this session and the record keep of its calls."""
        self._called.pop(id(graph), None)
        provenance.RECORD.forget(graph)

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
