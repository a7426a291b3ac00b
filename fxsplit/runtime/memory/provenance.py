"""Which memory fxsplit produced: one record for the whole process (:data:`RECORD`), shared by
every backend, since one model's output handed to a model compiled with another backend is
fxsplit's memory there too.

Memory fxsplit produced is never the caller's (see :mod:`fxsplit.runtime.inputs.binding`). It is:

- memory of an open memory pool: a captured graph's output storages
  (:attr:`MemoryPool.owners <fxsplit.runtime.memory.pool.MemoryPool>`) and what the pool handed out
  (its :class:`~fxsplit.runtime.memory.output_lifetime.OutputLedger`);
- the outputs every graph returned on its last call (a graph Dynamo resumes after a graph
  break reads them as inputs), captured or not;
- the private copies a call under way reads instead of earlier outputs handed back in
  (:func:`~fxsplit.runtime.memory.hand_out.take_over`).

Outputs are known by storage identity (``untyped_storage()._cdata``, with a ``StorageWeakRef``
saying whether that storage is still alive, as ``torch/_inductor/cudagraph_trees.py`` does),
never by address: the allocator hands a freed address out again at once. A pool's captured
outputs are known by address, which the pool owns while it is open.

The record holds weak references only: no tensor, storage or pool lives longer for being
recorded. A backend's :class:`~fxsplit.runtime.step.session.CaptureSession` registers the pools it
makes and, when it closes (their memory is released), drops them and what its graphs returned.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit.runtime.memory.storage import is_strided, storage_ptr

if TYPE_CHECKING:
    from fxsplit.runtime.memory.pool import MemoryPool

__all__ = ["RECORD", "Provenance"]

# storage cdata -> (weak reference to the storage, graph id, output position)
_Outputs = dict[int, tuple[StorageWeakRef, str, int]]


@dataclass(eq=False)
class _Returned:
    """What one graph's calls returned.

    Attributes:
        owner: the session the graph runs in (weakly): :meth:`Provenance.output_slot` answers
            within one session (graph ids repeat across backends), and a session's close drops
            its graphs.
        last: the outputs of its last call.
        origins: the outputs of its calls that are still alive; kept when the graph is reset
            (its outputs may be the model's state).
        swept: how many origins were left after the last sweep of the dead ones.
    """

    owner: weakref.ref
    last: _Outputs = field(default_factory=dict)
    origins: _Outputs = field(default_factory=dict)
    swept: int = 4


class Provenance:
    """The process-wide record of which memory fxsplit produced (see the module docstring)."""

    def __init__(self):
        self._returned: dict[int, _Returned] = {}  # id(graph) -> what its calls returned
        self._taken: dict[int, StorageWeakRef] = {}  # private copies of a call under way
        # the open pools, weakly: id -> reference (a WeakSet's iteration costs microseconds)
        self._pools: dict[int, weakref.ref[MemoryPool]] = {}

    def add_pool(self, pool: MemoryPool) -> None:
        """``pool``'s memory is fxsplit's from now on."""
        pools, key = self._pools, id(pool)
        pools[key] = weakref.ref(pool, lambda _, key=key: pools.pop(key, None))

    def _open(self) -> list[MemoryPool]:
        return [pool for ref in list(self._pools.values()) if (pool := ref()) is not None]

    def drop_pool(self, pool: MemoryPool) -> None:
        """``pool``'s memory is released: nothing asks it any more."""
        self._pools.pop(id(pool), None)

    def produced(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in memory fxsplit produced, by any backend of the process:
        a private copy of a call under way, an output of a graph's last call still alive, or
        memory of an open pool (:meth:`in_pool`)."""
        cdata = tensor.untyped_storage()._cdata
        if cdata in self._taken:
            return True
        for returned in self._returned.values():
            found = returned.last.get(cdata)
            if found is not None and not found[0].expired():
                return True
        return self.in_pool(tensor)

    def in_pool(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in an open memory pool of any backend of the process: a
        captured graph's output (handed out or not), whose memory later replays and captures
        reuse."""
        if not self._pools:
            return False
        ptr = tensor.untyped_storage().data_ptr()
        return any(
            pool.ledger.handed_out(tensor) is not None or ptr in pool.owners
            for pool in self._open()
        )

    def captured_output(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in a captured graph's output storage of an open pool (a
        replay changes it, unseen by its version counter)."""
        return self.captured_storage(storage_ptr(tensor))

    def captured_storage(self, ptr: int | None) -> bool:
        """:meth:`captured_output` for the storage at address ``ptr``."""
        for ref in tuple(self._pools.values()):
            pool = ref()
            if pool is not None and ptr in pool.owners:
                return True
        return False

    def record_outputs(
        self, owner: object, graph: object, out: tuple, slots: tuple[int, ...], args: tuple = ()
    ) -> None:
        """Remember the outputs of this call of ``graph`` (run in session ``owner``) at
        ``slots``: those the graph makes (a compile-time fact), not views of what the call was
        handed, which are the caller's. A slot whose making is unknown (-1 - its position) is
        remembered unless it views one of ``args``."""
        refs = {}
        theirs = None
        for slot in slots:
            if slot < 0:
                slot = -1 - slot
                if theirs is None:
                    theirs = {a.untyped_storage()._cdata for a in args if is_strided(a)}
                if not is_strided(out[slot]) or out[slot].untyped_storage()._cdata in theirs:
                    continue
            o = out[slot]
            if is_strided(o):
                storage = o.untyped_storage()
                if storage._cdata not in refs:
                    refs[storage._cdata] = (StorageWeakRef(storage), graph.graph_id, slot)
        returned = self._returned.get(id(graph))
        if returned is None or returned.owner() is not owner:
            returned = self._returned[id(graph)] = _Returned(weakref.ref(owner))
        returned.last = refs
        origins = returned.origins
        origins.update(refs)
        if len(origins) > 2 * returned.swept:
            # forget the dead only when the live may have doubled: a caller keeping every
            # step's output would otherwise make each call walk all of them
            for cdata in [cdata for cdata, found in origins.items() if found[0].expired()]:
                del origins[cdata]
            returned.swept = len(origins)

    def output_slot(self, owner: object, tensor: torch.Tensor) -> tuple[str, int] | None:
        """``(graph id, output position)`` of the output of a call of a graph run in session
        ``owner``, still alive, that ``tensor`` is (or views), else None."""
        cdata = tensor.untyped_storage()._cdata
        for returned in self._returned.values():
            if returned.owner() is owner:
                found = returned.origins.get(cdata)
                if found is not None and not found[0].expired():
                    return found[1], found[2]
        return None

    def forget(self, graph: object) -> None:
        """``graph`` is reset: its last call's outputs are no longer fxsplit's (its origins
        stay)."""
        returned = self._returned.get(id(graph))
        if returned is not None:
            returned.last = {}

    def close(self, owner: object) -> None:
        """Session ``owner`` closes: forget everything its graphs returned."""
        for key in [k for k, r in self._returned.items() if r.owner() in (owner, None)]:
            del self._returned[key]

    def take(self, handed: list) -> None:
        """The private copies of earlier outputs a call reads instead (``(index, original,
        copy)`` triples, see :func:`~fxsplit.runtime.memory.hand_out.take_over`) are memory fxsplit
        produced while the call runs."""
        for _, _, copy in handed:
            storage = copy.untyped_storage()
            self._taken[storage._cdata] = StorageWeakRef(storage)

    def forget_taken(self, handed: list) -> None:
        """The call that read the copies :meth:`take` recorded is over."""
        for _, _, copy in handed:
            self._taken.pop(copy.untyped_storage()._cdata, None)


RECORD = Provenance()
"""The process's one :class:`Provenance`."""
