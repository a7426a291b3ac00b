"""fxsplit's own static buffers: the copies of caller tensors a captured graph reads (same
strides and address alignment, shared by every key and piece that captured one view), and the
guard that refuses a call whose shared storage separate buffers could not keep.
"""

from __future__ import annotations

import bisect
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit.runtime.inputs.binding import Bind, Refused
from fxsplit.runtime.memory import provenance
from fxsplit.runtime.memory.storage import storage_ptr

__all__ = [
    "AliasGuard",
    "OwnBuffer",
    "OwnBuffers",
    "Spans",
    "WrittenMemory",
    "buffer_key",
    "memory_span",
    "new_own_buffer",
    "own_buffer",
]

_OWN = Bind.OWN


class OwnBuffer:
    """fxsplit's static buffer for one view of a caller's tensor, shared by every capture key
    and piece of a graph that captured that view (a KV cache handed in as a plain argument is
    held once), or an earlier captured piece's output read where it lies (``pooled``: memory
    of the pool, whose handed-out outputs a copy into it must invalidate first); ``mark``
    remembers the value last copied in (:meth:`remember`); ``owner``: the graph's
    :class:`OwnBuffers` (None for ``pooled``)."""

    __slots__ = ("mark", "owner", "pooled", "rebound", "region", "source", "static")

    def __init__(self, static, region, source, pooled: bool = False, owner=None):
        self.static = static
        self.region = region  # the flat memory under an overlapping (expanded) buffer
        self.source = source  # weak reference to the caller's storage it mirrors
        self.pooled = pooled
        self.owner: OwnBuffers | None = owner
        self.rebound = False
        self.mark = None

    def remember(self, value: torch.Tensor, epoch: int) -> None:
        """``value`` was just copied in during ``epoch`` (:attr:`~fxsplit.runtime.step.context.
        GraphContext.epoch`): remember it (a weak reference, its version, data pointer and the
        epoch), telling the later pieces of that epoch whether it changed since. Only within
        one epoch: between calls the caller may refill the tensor where its version counter
        does not see it (through NumPy, DLPack or ``.data``, as engines fill their staging
        buffers; a cache the model writes alike), and so may an eager op within a call, or
        write it through another tensor over its memory with a counter of its own.
        Nothing is remembered where the version counter cannot tell: an inference tensor has
        none, and a replay changes a captured graph's output unseen; nor for a ``rebound``
        parameter (see :class:`~fxsplit.runtime.inputs.binding.InputSpec`), copied every call;
        nor for memory a captured graph writes at its capture's addresses (:class:`WrittenMemory`),
        where no version counter but the one of the tensor the graph was handed moves. A copy
        of memory an eager piece of the call writes with torch's ops is remembered until that
        write (:meth:`OwnBuffers.forget_eager_written`)."""
        if self.rebound or value.is_inference():
            self.mark = None
            return
        memory = memory_span(value)
        owner = self.owner
        if provenance.RECORD.captured_storage(memory[0]) or (
            owner is not None and owner.written.overlaps(memory)
        ):
            self.mark = None
            return
        self.mark = weakref.ref(value), value._version, value.data_ptr(), epoch, memory
        if owner is not None and owner.eager_written and owner.eager_overlaps(memory):
            owner.fragile.append(self)

    def holds(self, value: torch.Tensor, epoch: int) -> bool:
        """Whether the buffer holds ``value``'s values: the same tensor, at the same address,
        unchanged (its version counter) since it was copied in earlier in ``epoch``."""
        mark = self.mark
        return (
            mark is not None
            and mark[3] == epoch
            and mark[0]() is value
            and mark[1] == value._version
            and mark[2] == value.data_ptr()
        )


class OwnBuffers:
    """A graph's :class:`OwnBuffer` objects, one per view of a caller's tensor, and what makes
    their copies stale unseen by version counters: the memory captured graphs write by address
    (``written``, a :class:`WrittenMemory`), and the graph arguments the eager pieces write
    with torch's ops (``eager_written``, their indices, set once the pieces are known), which
    a copy through another tensor over their memory must not outlive (``fragile``: the buffers
    holding such a copy in this call)."""

    def __init__(self):
        self._buffers: dict[tuple, OwnBuffer] = {}
        self.written = WrittenMemory()
        self.eager_written: tuple[int, ...] = ()
        self.fragile: list[OwnBuffer] = []
        self._args: tuple = ()  # the arguments of the call under way
        self._eager_spans: Spans | None = None

    def bind_call(self, args: tuple) -> tuple:
        """A call of the graph with ``args`` starts. Copies remembered in an earlier call are
        of another epoch already; the memory of this call's ``eager_written`` arguments is read
        at the first copy that needs it. Returns the state of the call under way, if any (a
        call of the graph made inside its own call, by an eager piece's op), for
        :meth:`end_call`."""
        outer = self._args, self._eager_spans, self.fragile
        self._args, self._eager_spans, self.fragile = args, None, []
        return outer

    def end_call(self, outer: tuple) -> None:
        """The call :meth:`bind_call` began ended: back to the call under way around it
        (``outer``), holding no argument of the ended one."""
        self._args, self._eager_spans, self.fragile = outer

    def eager_overlaps(self, span: tuple[int, int]) -> bool:
        """Whether ``span`` meets the memory of an argument of this call that an eager piece
        writes with torch's ops."""
        spans = self._eager_spans
        if spans is None:
            args = self._args
            spans = self._eager_spans = Spans(
                memory_span(args[i])
                for i in self.eager_written
                if i < len(args) and isinstance(args[i], torch.Tensor)
            )
        return spans.overlaps(span)

    def forget_eager_written(self) -> None:
        """An eager piece just wrote arguments in ``eager_written`` with torch's ops: the
        copies of their memory through other tensors (whose version counters did not see it)
        are stale."""
        for buffer in self.fragile:
            buffer.mark = None
        self.fragile.clear()

    def get(self, value: torch.Tensor, epoch: int, rebound: bool = False) -> OwnBuffer:
        """fxsplit's static buffer for the caller's ``value`` holding its values, shared by
        every piece and capture key of the graph that captured the same view of the same
        tensor; ``epoch``: see :meth:`OwnBuffer.remember`; ``rebound``: ``value`` is a rebound
        parameter (copied every call)."""
        key = buffer_key(value)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.source.expired():
            buffer = self._buffers[key] = new_own_buffer(value, self)
            buffer.rebound = rebound
            return buffer
        buffer.rebound |= rebound
        if not buffer.holds(value, epoch):
            target = buffer.static if buffer.region is None else buffer.region
            source = (
                value
                if buffer.region is None
                else value.as_strided(buffer.region.shape, (1,), value.storage_offset())
            )
            with torch.no_grad():
                target.copy_(source)
            buffer.remember(value, epoch)
        return buffer

    def forget_over(self, value: torch.Tensor) -> None:
        """A write just reached ``value`` unseen by other tensors over its memory: no buffer
        holds what another tensor over any of its storage's memory holds now (that tensor's
        version counter did not see the write: ``torch.from_numpy(a.numpy())``, a storage
        ``set_`` into another tensor)."""
        self.forget_spans((memory_span(value),))

    def forget_spans(self, spans: tuple[tuple[int, int], ...]) -> None:
        """:meth:`forget_over` for ``spans`` of ``(low, high)`` byte addresses."""
        for buffer in self._buffers.values():
            mark = buffer.mark
            if mark is not None:
                start, end = mark[4]
                for low, high in spans:
                    if start < high and low < end:
                        buffer.mark = None
                        break

    def __iter__(self):
        return iter(self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
        self.fragile.clear()


class Spans:
    """Byte ranges ``(low, high)``, merged into sorted disjoint ranges, asked for overlap by
    bisection."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, spans=()):
        starts: list[int] = []
        ends: list[int] = []
        for low, high in sorted(spans):
            if starts and low <= ends[-1]:
                ends[-1] = max(ends[-1], high)
            else:
                starts.append(low)
                ends.append(high)
        self._starts, self._ends = starts, ends

    def overlaps(self, span: tuple[int, int]) -> bool:
        """Whether the byte range ``span`` = ``(low, high)`` meets any of the ranges."""
        low, high = span
        i = bisect.bisect_right(self._ends, low)  # the first range ending past low
        return i < len(self._starts) and self._starts[i] < high


class WrittenMemory:
    """The memory captured graphs write at their capture's addresses: the storages of the
    inputs bound by address that a piece writes (a runner's persistent KV cache). A replay's
    writes bump only the version counter of the tensor the graph was handed; a copy of that
    memory made from another tensor over it would be taken as current after the replay. So no
    copy of this memory is ever remembered (:meth:`OwnBuffer.remember`), and a replay has
    nothing to forget: the check is made once per copy, never per replay.

    Spans are counted per entry that registered them (:meth:`add` at capture, :meth:`remove`
    when its graph is freed)."""

    __slots__ = ("_counts", "_spans")

    def __init__(self):
        self._counts: dict[tuple[int, int], int] = {}
        self._spans = Spans()

    def add(self, spans) -> None:
        for span in spans:
            self._counts[span] = self._counts.get(span, 0) + 1
        if spans:
            self._spans = Spans(self._counts)

    def remove(self, spans) -> None:
        for span in spans:
            left = self._counts.pop(span) - 1
            if left:
                self._counts[span] = left
        if spans:
            self._spans = Spans(self._counts)

    def overlaps(self, span: tuple[int, int]) -> bool:
        """Whether the byte range ``span`` = ``(low, high)`` meets any written span."""
        return self._spans.overlaps(span)


def memory_span(value: torch.Tensor) -> tuple[int, int]:
    """The ``(low, high)`` byte addresses of ``value``'s whole storage."""
    storage = value.untyped_storage()
    low = storage.data_ptr()
    return low, low + storage.nbytes()


def own_buffer(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fxsplit's static buffer for ``value``: same size, strides and address alignment (so
    vectorised reductions split the data the same way and replay bit-exactly, and views map
    back); requires grad where ``value`` does. For a ``value`` whose elements share memory
    (expanded), also the flat region under it, which copies go through (an elementwise copy
    into overlapping memory is an error)."""
    # Same start offset modulo 512 elements as the caller's tensor: allocations are aligned to
    # at most 512 bytes, so the data pointer lands on the same alignment.
    if value.is_conj() or value.is_neg():
        # Keep the bit: copy the memory as it is, then view it with the same bit.
        plain = value.conj() if value.is_conj() else torch._neg_view(value)
        buffer, region = own_buffer(plain)
        return (buffer.conj() if value.is_conj() else torch._neg_view(buffer)), region
    pad = value.storage_offset() % 512
    extent = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride(), strict=True))
    extent = extent if value.numel() else 0
    # Never an inference tensor: one graph may serve calls under inference mode and outside it
    # (a model called inside an eager op's kernel, where Dynamo's guards see the same dispatch
    # keys under both), and a copy into an inference tensor outside inference mode raises.
    with torch.inference_mode(False), torch.no_grad():
        flat = torch.empty(pad + extent, dtype=value.dtype, device=value.device)
        buffer = flat.as_strided(value.size(), value.stride(), pad)
        region = flat[pad:] if _overlaps(value) else None
    with torch.no_grad():
        if region is not None:
            region.copy_(value.as_strided((extent,), (1,), value.storage_offset()))
        else:
            buffer.copy_(value)
    # A piece that enables grad must see what eager sees, so its capture can refuse.
    return buffer.requires_grad_(value.requires_grad), region


def buffer_key(value: torch.Tensor) -> tuple:
    """What makes two caller tensors the same view for :class:`OwnBuffer` sharing: the storage
    (by identity), offset, size, stride, dtype and bits."""
    return (
        value.untyped_storage()._cdata,
        value.storage_offset(),
        tuple(value.shape),
        value.stride(),
        value.dtype,
        value.is_conj(),
        value.is_neg(),
        value.requires_grad,
    )


def new_own_buffer(value: torch.Tensor, owner: OwnBuffers | None = None) -> OwnBuffer:
    """A :class:`OwnBuffer` mirroring ``value`` (``owner``: its graph's :class:`OwnBuffers`)."""
    static, region = own_buffer(value)
    return OwnBuffer(static, region, StorageWeakRef(value.untyped_storage()), owner=owner)


def _overlaps(value: torch.Tensor) -> bool:
    """Whether two elements of ``value`` share memory (a zero or otherwise overlapping stride)."""
    reach = 0  # furthest element offset reachable with the dims seen so far
    for stride, size in sorted(
        (s, n) for n, s in zip(value.shape, value.stride(), strict=True) if n > 1
    ):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


class AliasGuard:
    """Refuses a call whose inputs share storage where the static buffers could not keep it: an
    input bound to fxsplit's own copy (OWN) sharing storage with an input the piece writes, while
    their static buffers do not share memory (the copy would not see the write, or the write
    would not reach the caller's other view).

    Inputs bound by address keep their capture-time storage on every replay (a move raises,
    refuses or recaptures first), so the storages of the written ones are fixed here and each
    call looks up only the OWN inputs' storages; only a piece that writes an OWN input compares
    every pair. Inputs whose static buffers share memory as the caller's tensors do (one caller
    tensor handed twice, bound to one shared buffer) are no hazard.
    """

    __slots__ = ("fixed", "needed", "own", "paired", "wide", "written")

    def __init__(self, statics, inputs, binds, written: list[int]):
        self.written = frozenset(written)
        self.own = tuple(i for i, b in enumerate(binds) if b == _OWN)
        self.wide = any(binds[i] == _OWN for i in written)
        self.fixed = {
            storage_ptr(inputs[i]): i for i in written if binds[i] != _OWN and inputs[i].numel()
        }
        # pairs of OWN or written inputs whose static buffers share memory: sharing is kept there
        groups: dict[int, list[int]] = {}
        for i in {*self.own, *written}:
            static = statics[i]
            if isinstance(static, torch.Tensor) and static.numel():
                groups.setdefault(storage_ptr(static), []).append(i)
        self.paired = frozenset(
            (i, j) for group in groups.values() for i in group for j in group if i != j
        )
        self.needed = bool(self.own) and (self.wide or bool(self.fixed))

    def check(self, specs, inputs) -> None:
        """Raises:
        Refused: naming the two inputs that share storage."""
        if self.wide:
            written = self.written
            seen: dict[int, int] = {}
            for i, value in enumerate(inputs):
                if isinstance(value, torch.Tensor) and value.numel():
                    j = seen.setdefault(storage_ptr(value), i)
                    # two inputs only read may share storage: their copies keep the values
                    if j != i and (i in written or j in written) and (j, i) not in self.paired:
                        raise Refused(_shared(specs, j, i))
            return
        fixed = self.fixed
        for i in self.own:
            value = inputs[i]
            if value.numel():  # empty tensors all report storage address 0
                j = fixed.get(storage_ptr(value))
                if j is not None and (j, i) not in self.paired:
                    raise Refused(_shared(specs, j, i))


def _shared(specs, j: int, i: int) -> str:
    return (
        f"inputs {specs[j].name!r} and {specs[i].name!r} share storage and the piece writes one "
        "of them; separate static buffers would not keep that aliasing"
    )
