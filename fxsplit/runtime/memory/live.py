"""Which memory of fxsplit's pools is still in use: what a test's teardown asks once the test's
compiled models are gone, as PyTorch's cudagraph-trees tests assert that no block is left live.

A captured graph's outputs live in its pool until the graph is freed, and what fxsplit hands out
of the pool (outputs returned to the caller, loans to eager pieces) is followed by the pool's
ledger. Once a test's models are dropped, anything of its pools still referenced was kept past
the test: by the test itself (a module-level list), or by a cache of fxsplit's or torch's that
holds a reference it should not. Left unnoticed, such a reference keeps memory alive for the rest
of the process, and on CUDA a later replay may overwrite what it points at.

Two moments tell different things (``tests/conftest.py`` asks at both):

- while the backends' sessions are still open: a hand-out still referenced, or a loan an eager
  op kept (``torch._dynamo.reset()`` moves both to memory of their own, so afterwards nothing
  says they were kept);
- after ``torch._dynamo.reset()``: an emulated pool that still has allocated blocks, or the
  segments of a dropped one that a tensor still holds
  (:class:`~fxsplit.runtime.emulation.emulated_pool.Outliving`).

The registries are weak (no pool lives longer for being asked about), and asking walks only the
pools alive, so a check that finds nothing costs next to nothing. Nothing here collects garbage:
the caller does (a pool in a reference cycle is alive until a collection).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxsplit.runtime.emulation import emulated_pool
from fxsplit.runtime.memory import pool

__all__ = ["Live", "live_memory", "serials"]


@dataclass(frozen=True)
class Live:
    """Memory of one pool still in use.

    Attributes:
        kind: ``"hand-out"`` (an output handed out of a memory pool, still referenced),
            ``"loan"`` (an output lent to an eager piece that something kept), ``"block"`` (an
            allocated block of a live emulated pool) or ``"outliving"`` (the segments of a
            dropped emulated pool that tensors still hold).
        pool: the serial number of the pool (a :class:`~fxsplit.runtime.memory.pool.MemoryPool`'s
        for
            hand-outs and loans, an :class:`~fxsplit.runtime.emulation.emulated_pool.EmulatedPool`'s
            otherwise).
        nbytes: the bytes kept (0 where not known: hand-outs and loans).
        made_by: the graphs and pieces whose memory it is, where known.
    """

    kind: str
    pool: int
    nbytes: int
    made_by: tuple[str, ...]

    def __str__(self) -> str:
        size = f", {self.nbytes} bytes" if self.nbytes else ""
        by = f" of {', '.join(self.made_by)}" if self.made_by else ""
        return f"{self.kind} (pool {self.pool}{size}){by}"


def serials() -> tuple[int, int]:
    """The serial numbers of the last memory pool and the last emulated pool made: pass them to
    :func:`live_memory` later to ask only about pools made since."""
    return pool._SERIAL, emulated_pool._SERIAL


def live_memory(since: tuple[int, int] = (0, 0)) -> list[Live]:
    """Every piece of pool memory still in use, in the pools made after ``since`` (from
    :func:`serials`; every pool by default).

    Garbage is not collected first: where the caller wants only what is truly kept, it collects
    (and resets Dynamo, for the allocated blocks of graphs still compiled) before asking.
    """
    pools_since, emulated_since = since
    found = []
    for memory in sorted(pool._POOLS, key=lambda p: p.serial):
        if memory.serial <= pools_since:
            continue
        ledger = memory.ledger
        for handed in ledger.live_hand_outs():
            found.append(
                Live("hand-out", memory.serial, 0, (f"{handed.graph_id} output {handed.slot}",))
            )
        for graph_id, piece in ledger.loans.kept():
            found.append(Live("loan", memory.serial, 0, (f"{graph_id} {piece}",)))
    for emulated in sorted(emulated_pool._POOLS, key=lambda p: p.serial):
        if emulated.serial <= emulated_since:
            continue
        blocks = emulated.allocated_blocks()
        if blocks:
            made_by = tuple(sorted({b.made_by for b in blocks if b.made_by is not None}))
            found.append(Live("block", emulated.serial, sum(b.size for b in blocks), made_by))
    for kept in emulated_pool._OUTLIVING:
        if kept.serial > emulated_since and kept.alive:
            nbytes = sum(segment.memory.nbytes for segment in kept.segments)
            found.append(Live("outliving", kept.serial, nbytes, kept.made_by))
    return found
