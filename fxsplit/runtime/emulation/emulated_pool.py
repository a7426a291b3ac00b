"""CPU stand-in for a CUDA graph memory pool: the caching allocator's reuse, on host memory.

Graphs captured into one CUDA memory pool share its memory: a block an intermediate used during
one capture (scratch) is free once that capture ends, and a later capture may place its outputs
there. Replaying the earlier graph then writes its scratch over those outputs. That is the rule
``CUDAGraph.h`` states (graphs sharing a pool are safe only when replayed in capture order), and a
CPU emulator that gives every tensor its own memory can never show a breach of it.

:class:`EmulatedPool` gives emulated captures the same reuse. Every tensor an op makes during a
capture is moved into a block of the pool (:meth:`EmulatedPool.adopt`); the program gets a tensor
over the block's *program storage*, the capture's record a tensor over its *record storage*
(:meth:`EmulatedPool.record_view`). Both are storages that do not own their memory; the pool's
segments do. A block is free again once its program storage is dead (every program tensor and view
over it dropped, checked through weak references), whatever the records still hold: the same point
at which the caching allocator returns a block to the pool during capture.

Allocation follows the caching allocator's rules closely enough to reproduce reuse: sizes rounded
up to 512 bytes, small requests (up to 1 MiB) from 2 MiB segments and large ones from segments of
at least 20 MiB, best fit among free blocks of the same class, blocks split and free neighbours
merged. Block starts are 64-byte aligned, as the CPU allocator's own allocations are, so a kernel
splits a relocated tensor into vector lanes exactly as it splits a fresh one.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Block", "EmulatedPool", "Outliving"]

_ROUND = 512  # the caching allocator's minimum block size (bytes)
_SMALL = 1 << 20  # requests up to this size come from small segments
_SMALL_SEGMENT = 2 << 20
_LARGE_SEGMENT = 20 << 20
_LARGE_ROUND = 2 << 20  # large segments beyond _LARGE_SEGMENT are rounded to this


@dataclass(eq=False)
class Outliving:
    """The segments of a dropped pool that the model still holds tensors over.

    Attributes:
        segments: the pool's segments (they own its memory).
        refs: weak references to the storages of the tensors that hold them.
        serial: the dropped pool's :attr:`EmulatedPool.serial`.
        made_by: who allocated the blocks still allocated when it went (see
            :attr:`Block.made_by`).
    """

    segments: list
    refs: list[StorageWeakRef]
    serial: int
    made_by: tuple[str, ...] = ()

    @property
    def alive(self) -> bool:
        return not all(r.expired() for r in self.refs)


# Segments of dropped pools that the model still holds tensors over; released when a new pool is
# made and they are all gone.
_OUTLIVING: list[Outliving] = []


def _outlive(segments: list, allocated: set, serial: int, held=()) -> None:
    """Keep ``segments`` alive while a block of ``allocated`` or a storage of ``held`` is.
    Nothing is copied: this may run inside garbage collection."""
    blocks = [b for b in allocated if b.ref is not None and not b.ref.expired()]
    live = [b.ref for b in blocks] + [ref for ref in held if not ref.expired()]
    if live:
        made_by = tuple(sorted({b.made_by for b in blocks if b.made_by is not None}))
        _OUTLIVING.append(Outliving(segments, live, serial, made_by))


# Every pool alive, and the serial number of the last one made: a test's teardown asks which pools
# it made that still hold memory (fxsplit.runtime.memory.live).
_POOLS: weakref.WeakSet[EmulatedPool] = weakref.WeakSet()
_SERIAL = 0  # the last pool's serial number


@dataclass(eq=False)
class _Segment:
    memory: torch.Tensor  # uint8, owns the bytes
    small: bool
    blocks: list[Block] = field(default_factory=list)  # in address order

    @property
    def base(self) -> int:
        return self.memory.data_ptr()


@dataclass(eq=False)
class Block:
    """A range of a segment: ``size`` bytes at ``offset``; allocated while ``ref`` (the weak
    reference to its program storage) is alive."""

    segment: _Segment
    offset: int
    size: int
    ref: StorageWeakRef | None = None
    record: torch.UntypedStorage | None = None
    made_by: str | None = None  # the capture that allocated it (EmulatedPool.capture_begin)

    @property
    def ptr(self) -> int:
        return self.segment.base + self.offset

    @property
    def free(self) -> bool:
        return self.ref is None


class EmulatedPool:
    """A memory pool shared by emulated captures (see the module docstring).

    Attributes:
        device: the device of every segment (the CPU).
        segments: the segments allocated so far; never released while the pool lives.
        serial: this pool's number among the pools of the process (1 for the first).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        _OUTLIVING[:] = [kept for kept in _OUTLIVING if kept.alive]
        global _SERIAL
        _SERIAL += 1
        self.serial = _SERIAL
        _POOLS.add(self)
        self.device = torch.device(device)
        self._label: str | None = None  # who allocates during the capture under way
        self.segments: list[_Segment] = []
        self._allocated: set[Block] = set()
        # A finalizer, not __del__: what it reads (the blocks and their weak references) stays
        # reachable from weakref.finalize's registry, so a garbage collection that finds the
        # pool in a reference cycle never finalizes them first (see outlive).
        self._gone = weakref.finalize(self, _outlive, self.segments, self._allocated, self.serial)
        self._gone.atexit = False
        self._by_storage: dict[int, Block] = {}  # program storage cdata -> its block
        self._recent: list[Block] = []  # allocated during the capture under way
        # free blocks per size class, ordered by (size, sequence number)
        self._free: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}
        self._sequence = 0

    # -- allocation -------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> torch.UntypedStorage:
        """The program storage (``nbytes`` long, not owning its memory) of a new block of at
        least ``nbytes`` bytes.

        Blocks whose program storage died during the capture under way are reused first, as the
        caching allocator reuses a block freed earlier in the same capture.
        """
        self._reclaim(self._recent)
        size = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        small = size <= _SMALL
        block = self._take(size, small)
        storage = torch._C._construct_storage_from_data_pointer(block.ptr, self.device, nbytes)
        stale = self._by_storage.get(storage._cdata)
        if stale is not None:  # a dead storage's address, reused for this one
            self._reclaim([stale])
        block.ref = StorageWeakRef(storage)
        block.made_by = self._label
        block.record = torch._C._construct_storage_from_data_pointer(block.ptr, self.device, nbytes)
        self._by_storage[storage._cdata] = block
        self._allocated.add(block)
        self._recent.append(block)
        return storage

    def adopt(self, tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """A tensor like ``tensor`` (dtype, size, stride, offset, conjugate and negative bits)
        over a new block of this pool, holding ``tensor``'s values where ``copy`` (an allocation's
        contents are undefined: without ``copy`` the block keeps what it held)."""
        from fxsplit.runtime.memory.storage import view_over

        source = tensor.untyped_storage()
        storage = self.allocate(source.nbytes())
        if copy:
            storage.copy_(source)
        return view_over(storage, tensor)

    def block_of(self, tensor: torch.Tensor) -> Block | None:
        """The allocated block ``tensor`` is a program tensor of, else None."""
        block = self._by_storage.get(tensor.untyped_storage()._cdata)
        if block is None or block.ref is None or block.ref.expired():
            return None
        return block

    def record_view(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A tensor with ``tensor``'s metadata over the record storage of its block (so a record
        holding it does not keep the block allocated); None when ``tensor`` is not in the pool."""
        from fxsplit.runtime.memory.storage import view_over

        block = self.block_of(tensor)
        if block is None:
            return None
        return view_over(block.record, tensor)

    def capture_begin(self, label: str | None = None) -> None:
        """Free the blocks whose program storage died since the last capture; the capture's
        blocks are ``label``'s (:attr:`Block.made_by`: a leak report names the piece)."""
        self._reclaim(list(self._allocated))
        self._recent = []
        self._label = label

    def capture_end(self) -> None:
        """Free the capture's blocks that died (its scratch); the rest stay allocated."""
        self._reclaim(self._recent)
        self._recent = []
        self._label = None

    def outlive(self, held=()) -> None:
        """The pool is going (its owner's finalizer,
        :class:`~fxsplit.runtime.memory.pool.MemoryPool`):
        if the model still holds a tensor over its memory (a block's program storage, or a
        storage among ``held``, weak references), its segments stay alive until every one of
        them is gone, as a CUDA tensor keeps its block. A pool nobody calls this for does the
        same for its blocks when it is dropped (a graph's private pool).

        ``held`` must not be finalized yet: a ``StorageWeakRef`` whose ``__del__`` ran has
        released its weak reference, and reading it reads a freed ``StorageImpl`` (a cycle
        collection runs every finalizer of the cycle before any object is freed, in no set
        order; hence finalizers, whose arguments stay reachable, rather than ``__del__``)."""
        self._gone.detach()
        _outlive(self.segments, self._allocated, self.serial, held)

    def allocated_blocks(self) -> list[Block]:
        """The allocated blocks (after freeing the dead ones), in no particular order."""
        self._reclaim(list(self._allocated))
        return list(self._allocated)

    @property
    def allocated_bytes(self) -> int:
        """Bytes in allocated blocks (after freeing the dead ones)."""
        self._reclaim(list(self._allocated))
        return sum(b.size for b in self._allocated)

    # -- internals --------------------------------------------------------------------------

    def _reclaim(self, blocks: list[Block]) -> None:
        dead = [b for b in blocks if b.ref is not None and b.ref.expired()]
        for block in dead:
            if self._by_storage.get(block.ref.cdata) is block:
                del self._by_storage[block.ref.cdata]
            block.ref = None
            block.record = None
            self._allocated.discard(block)
            self._release(block)
        if dead and blocks is self._recent:
            self._recent = [b for b in blocks if b.ref is not None]

    def _take(self, size: int, small: bool) -> Block:
        """Best fit among the free blocks of the size class (split), else a new segment."""
        free = self._free[small]
        i = bisect.bisect_left(free, (size, -1))
        block = free.pop(i)[2] if i < len(free) else self._grow(size, small)
        rest = block.size - size
        # The caching allocator keeps a small remainder attached; a large block splits only when
        # the remainder exceeds the small-request limit.
        if rest >= _ROUND and (small or rest > _SMALL):
            blocks = block.segment.blocks
            tail = Block(block.segment, block.offset + size, rest)
            blocks.insert(blocks.index(block) + 1, tail)
            block.size = size
            self._add_free(tail)
        return block

    def _grow(self, size: int, small: bool) -> Block:
        if small:
            length = _SMALL_SEGMENT
        else:
            length = max(_LARGE_SEGMENT, -(-size // _LARGE_ROUND) * _LARGE_ROUND)
        memory = torch.empty(length, dtype=torch.uint8, device=self.device)
        segment = _Segment(memory, small)
        segment.blocks.append(Block(segment, 0, length))
        self.segments.append(segment)
        return segment.blocks[0]

    def _add_free(self, block: Block) -> None:
        self._sequence += 1
        bisect.insort(self._free[block.segment.small], (block.size, self._sequence, block))

    def _remove_free(self, block: Block) -> None:
        free = self._free[block.segment.small]
        for i in range(bisect.bisect_left(free, (block.size, -1)), len(free)):
            if free[i][2] is block:
                del free[i]
                return

    def _release(self, block: Block) -> None:
        """Return ``block`` to the free lists, merged with free neighbours."""
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:
            after = blocks.pop(i + 1)
            self._remove_free(after)
            block.size += after.size
        if i > 0 and blocks[i - 1].free:
            before = blocks[i - 1]
            self._remove_free(before)
            before.size += blocks.pop(i).size
            block = before
        self._add_free(block)
