"""Outputs handed out of a memory pool, and what becomes of them when a replay reuses it.

A captured graph's outputs live in the memory pool; every replay writes them again, and a replay
of a graph may also write over the outputs of every graph captured after it in the same pool (its
scratch was free when they were captured: the ordering rule of ``CUDAGraph.h``). A graph's
outputs that leave fxsplit (returned to the caller, stored on a cache object or in a dict by
Dynamo's side effects, kept by a forward hook) are therefore *handed out*, as Inductor's
cudagraph trees do: each call returns fresh tensor objects over fresh storage objects that do not
own the pool's memory, and the :class:`OutputLedger` keeps weak references to those storages.

One rule, on CUDA and in the CPU emulator alike: before a write that may reuse the memory of a
handed-out output still referenced anywhere (a replay, a copy into the pool, its graph freed),
the output *moves* to memory of its own with its values (``UntypedStorage._swap_data_ptr_``: the
output and every view of it follow). From then on it is the caller's tensor, as eager's would
be: reading it, writing it and handing it back in all work. An output the caller drops before
the next call costs nothing; one it keeps costs one copy per replay that would overwrite it
(counted in :attr:`OutputLedger.moved`).

A torch that cannot move a storage (2.11) *invalidates* instead, as Inductor's cudagraph trees
do: ``torch._C._set_storage_data_ptr_access_error_msg`` makes every read of the output raise
with fxsplit's message, and handing it to a compiled graph raises :class:`StaleOutputError`
(a CPU-only build without that hook hands outputs out as clones). There, what the model keeps as
its state (an output Dynamo stores on an object or into a module's buffers, or one that came back
as a rebound buffer) is handed out as memory of its own from the start: the model reads it back
at its next call, after replays that would invalidate it.

A NumPy array or a DLPack capsule made from a hand-out keeps its address, not its storage: no
move reaches it, so it holds the output's values until that memory is next written (a later
replay), as cudagraph trees' outputs do. fxsplit patches nothing in torch to see exports; export
a clone to keep one (docs/capture.md, "Exports").

A captured piece's output that an eager piece of the same graph reads is lent to it
(:mod:`fxsplit.runtime.memory.lending`): a loan an eager op keeps moves out of the pool before the
next
step's replays, and the ledger frees loans with its other hand-outs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit.runtime.memory.lending import Loans
from fxsplit.runtime.memory.storage import may_move, move_out, view_over

__all__ = ["OutputLedger", "StaleOutputError", "can_swap", "poison"]

log = logging.getLogger("fxsplit")

_POISON = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)
# torch 2.11 lacks it: there the emulator invalidates as CUDA does (a read raises)
_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def can_swap() -> bool:
    """Whether this torch can move a storage to other memory (``_swap_data_ptr_``)."""
    return _CAN_SWAP


def poison(tensor: torch.Tensor, graph_id: str) -> None:
    """Make every read of ``tensor``'s storage raise :func:`stale_message` (``graph_id``)."""
    _POISON(tensor.untyped_storage()._cdata, stale_message(graph_id))


class StaleOutputError(RuntimeError):
    """An output of a captured graph was read after a later replay reused its memory.

    Raised when such an output is handed to a compiled graph (every capture mode); on CUDA any
    read of it raises a RuntimeError with the same message.
    """


def stale_message(graph_id: str) -> str:
    """What a read of an overwritten output of ``graph_id`` says."""
    return (
        f"fxsplit {graph_id}: this tensor is an output of a captured graph that a later replay "
        "has overwritten (captured graphs reuse their output memory on every replay). Clone "
        "outputs you keep past the next call (out.clone()), or compile with "
        "options={'clone_outputs': True}"
    )


@dataclass(eq=False)
class _HandOut:
    order: int  # capture order of the graph that wrote the memory
    step: int  # the step it was handed out in
    ref: StorageWeakRef
    graph_id: str
    ptr: int  # the memory's address
    slot: int  # its position among the graph's outputs


class OutputLedger:
    """The outputs one memory pool handed out that may still be referenced.

    Attributes:
        loans: the outputs lent to eager pieces (:class:`~fxsplit.runtime.memory.lending.Loans`).
        poison: this torch cannot move a storage and invalidates held outputs instead (2.11).
        can_invalidate: a held output can be moved or invalidated; where neither is possible,
            outputs are handed out as clones.
        moved: hand-outs moved to memory of their own, in all.
        invalidated: hand-outs invalidated while referenced, in all (torch 2.11).
        state_slots: ``(graph id, output position)`` of the outputs the model keeps as its
            state (:meth:`keep_as_state`).
    """

    def __init__(self):
        self.poison = not _CAN_SWAP and _POISON is not None
        self.loans = Loans(poison=self.poison)
        self.can_invalidate = self.poison or _CAN_SWAP
        self._live: dict[int, _HandOut] = {}  # storage cdata -> hand-out
        self._high = -1  # highest capture order among live hand-outs (a bound)
        self._stale: dict[int, tuple[StorageWeakRef, str]] = {}
        self.state_slots: set[tuple[str, int]] = set()
        self.invalidated = 0
        self.moved = 0

    def owns_copy(self, graph_id: str, slot: int) -> bool:
        """Whether output ``slot`` of ``graph_id`` is handed out as memory of its own (a clone):
        the model's state, where this torch can neither move it out of the pool later nor
        let it be invalidated (the model reads it back)."""
        return not _CAN_SWAP and (graph_id, slot) in self.state_slots

    def hand_out(
        self,
        value: torch.Tensor,
        storages: dict,
        order: int,
        step: int,
        graph_id: str,
        slot: int,
    ) -> torch.Tensor:
        """``value`` (output ``slot`` of ``graph_id``, a tensor in the pool, written by the
        graph of capture order ``order``) as a fresh tensor over a fresh storage object;
        tensors of one storage share one (through ``storages``, one dict per call)."""
        source = value.untyped_storage()
        ptr = source.data_ptr()
        storage = storages.get(ptr)
        if storage is None:
            storage = storages[ptr] = torch._C._construct_storage_from_data_pointer(
                ptr, value.device, source.nbytes()
            )
            ref = StorageWeakRef(storage)
            self._live[ref.cdata] = _HandOut(order, step, ref, graph_id, ptr, slot)
            if order > self._high:
                self._high = order
        return view_over(storage, value)

    def live_refs(self) -> list[StorageWeakRef]:
        """Weak references to the storages of every hand-out and loan still followed."""
        return [handed.ref for handed in self._live.values()] + self.loans.live_refs()

    def live_hand_outs(self) -> list[_HandOut]:
        """The hand-outs still referenced (and still over the pool's memory)."""
        return [handed for handed in self._live.values() if not handed.ref.expired()]

    def handed_out(self, tensor: torch.Tensor) -> _HandOut | None:
        """The live hand-out ``tensor`` is (or is a view of), else None."""
        found = self._live.get(tensor.untyped_storage()._cdata)
        if found is None or found.ref.expired():
            return None
        return found

    def handed_before(self, step: int) -> set[int]:
        """The storages (``_cdata``) of the hand-outs of steps before ``step`` still referenced;
        forgets the others (the cost is the number of hand-outs followed, not of arguments)."""
        earlier = set()
        for cdata, handed in list(self._live.items()):
            if handed.ref.expired():
                del self._live[cdata]
            elif handed.step != step:
                earlier.add(cdata)
        return earlier

    def keep_as_state(self, graph_id: str, slot: int) -> None:
        """What ``graph_id`` hands out at position ``slot`` is the model's state, read back at
        its next call (known from Dynamo's side effects at compile time, or found when it came
        back as a parameter or buffer the model rebinds, ``self.t = <output>``): where this
        torch cannot move a storage, it is handed out as memory of its own
        (:meth:`owns_copy`)."""
        self.state_slots.add((graph_id, slot))

    def adopt(self, tensor: torch.Tensor) -> None:
        """Forget ``tensor``'s hand-out: the runtime took its memory over for this call."""
        self._live.pop(tensor.untyped_storage()._cdata, None)

    def before_write(self, order: int) -> None:
        """A graph of capture order ``order`` is about to write the pool: every live hand-out
        it may overwrite (written by a graph of order ``order`` or later) leaves the pool
        (:meth:`_leave`)."""
        if order > self._high:
            return
        high = -1
        for cdata, handed in list(self._live.items()):
            if handed.ref.expired():
                del self._live[cdata]
            elif handed.order >= order:
                del self._live[cdata]
                self._leave(handed)
            elif handed.order > high:
                high = handed.order
        self._high = high

    def before_copy(self, ptr: int) -> None:
        """A copy outside any replay is about to write the memory at ``ptr`` (an earlier
        piece's output buffer, refilled after that piece ran uncaptured): the live hand-outs over
        it leave the pool (:meth:`_leave`), and so do the loans eager ops kept."""
        self.loans.before_copy(ptr)
        for cdata, handed in list(self._live.items()):
            if handed.ptr == ptr:
                del self._live[cdata]
                if not handed.ref.expired():
                    self._leave(handed)

    def release_order(self, order: int) -> None:
        """The graph of capture order ``order`` is being freed: its live hand-outs move to
        memory of their own (:meth:`_leave`), as do its loans eager ops kept."""
        self.loans.release(order)
        for cdata, handed in list(self._live.items()):
            if handed.order == order:
                del self._live[cdata]
                if not handed.ref.expired():
                    self._leave(handed)

    def release_all(self) -> None:
        """The pool's memory is being released: every live hand-out moves to memory of its own
        (:meth:`_leave`), as does every loan an eager op kept."""
        self.loans.release()
        for handed in self._live.values():
            if not handed.ref.expired():
                self._leave(handed)
        self._live.clear()
        self._high = -1

    def check_inputs(self, args, graph_id: str) -> None:
        """Raise if an argument is an invalidated output (torch 2.11: see the module docstring).

        Raises:
            StaleOutputError: naming the graph that produced it and what to do.
        """
        if not self._stale:
            return
        stale = self._stale
        for arg in args:
            if isinstance(arg, torch.Tensor):
                hit = stale.get(arg.untyped_storage()._cdata)
                if hit is not None and not hit[0].expired():
                    raise StaleOutputError(
                        f"fxsplit {graph_id}: an input is an output of {hit[1]} handed back in "
                        "(s = model(x, s)) after a later replay overwrote its memory, which "
                        "this torch cannot move out of the pool first (no "
                        "UntypedStorage._swap_data_ptr_): clone it before the next call "
                        "(s = s.clone()), or compile with options={'clone_outputs': True}"
                    )

    def _leave(self, handed: _HandOut) -> None:
        """A write is about to reuse ``handed``'s memory, or its graph is freed: it moves to
        memory of its own with its values; where this torch cannot move a storage (2.11), or a
        CUDA capture is under way on this thread (a collected backend's finalizer), it is
        invalidated (a read raises where torch has the hook)."""
        cdata = handed.ref.cdata
        if may_move():
            self.moved += 1
            move_out(cdata)
            return
        self.invalidated += 1
        if _POISON is not None:
            _POISON(cdata, stale_message(handed.graph_id))
        self._stale[cdata] = (handed.ref, handed.graph_id)
