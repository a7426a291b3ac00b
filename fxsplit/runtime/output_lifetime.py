"""Outputs handed out of a memory pool, and what becomes of them when a replay reuses it.

A captured graph's outputs live in the memory pool; every replay writes them again, and a replay
of a graph may also write over the outputs of every graph captured after it in the same pool (its
scratch was free when they were captured: the ordering rule of ``CUDAGraph.h``). A graph's
outputs that leave fxsplit (returned to the caller, stored on a cache object or in a dict by
Dynamo's side effects, kept by a forward hook) are therefore *handed out*, as Inductor's
cudagraph trees do: each call returns fresh tensor objects over fresh storage objects that do not
own the pool's memory, and the :class:`OutputLedger` keeps weak references to those storages.

Before a replay that may overwrite a handed-out output still referenced anywhere, the ledger
*invalidates* it:

- on CUDA, through PyTorch's own machinery: ``torch._C._set_storage_data_ptr_access_error_msg``
  makes every tensor over that storage (the output and every view of it) raise with fxsplit's
  message when its data is read. Nothing is copied, so the steady loop ``logits = model(...)``
  (the previous step's logits still bound, never read again) costs no copy;
- in the CPU emulator, whose wheel lacks that function and where no hook on a read of a CPU
  tensor exists, the storage's memory is replaced by a copy of its values
  (``UntypedStorage._swap_data_ptr_``): the number stays right. The emulator raises where it
  can see the read: an invalidated output handed to any compiled graph of the backend raises
  :class:`StaleOutputError` (as reading it on CUDA would), and an invalidated output still held a
  step after it was overwritten is warned about once. A torch without ``_swap_data_ptr_``
  (2.11) invalidates as CUDA does where it has the error message hook, else hands out clones.

Two kinds of held output are *moved* instead (a copy of their values into memory of their own,
where this torch can move a storage, and no CUDA capture is under way on this thread): the
outputs of a graph that is being freed (a reset, weights moved, a reordering recapture: no
replay writes them again), and the model's own state (an output Dynamo stores into a module's
buffers, or one that came back as a rebound buffer) before a replay overwrites it, since the
model reads it back at its next call. A third moves at once: an output exported to NumPy or
DLPack, which keep its address where no later move reaches (:mod:`fxsplit.runtime.exports`).

Outputs whose storage dies are simply forgotten: a caller that drops what it does not keep pays
nothing.

A captured piece's output that an eager piece of the same graph reads is lent to it
(:mod:`fxsplit.runtime.lending`): a loan an eager op keeps moves out of the pool before the next
step's replays, and the ledger frees loans with its other hand-outs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit.runtime.lending import Loans
from fxsplit.runtime.storage import may_move, move_out, view_over

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


def _unexportable(what: str, graph_id: str) -> str:
    return (
        f"fxsplit {graph_id}: {what} is exported to NumPy or DLPack, which keep its address, "
        "and this torch cannot move it out of the memory pool the next replay overwrites "
        "(no UntypedStorage._swap_data_ptr_, or a CUDA capture is under way): export a clone "
        "(t.clone().numpy())"
    )


@dataclass(eq=False)
class _HandOut:
    order: int  # capture order of the graph that wrote the memory
    step: int  # the step it was handed out in
    ref: StorageWeakRef
    graph_id: str
    ptr: int  # the memory's address
    slot: int  # its position among the graph's outputs
    state: bool  # the model keeps that output as its state (see OutputLedger.keep_as_state)


class OutputLedger:
    """The outputs one memory pool handed out that may still be referenced.

    Args:
        poison: invalidate by making reads raise (CUDA); else by copying the values out
            (the emulator).

    Attributes:
        loans: the outputs lent to eager pieces (:class:`~fxsplit.runtime.lending.Loans`).
    """

    def __init__(self, poison: bool):
        self.poison = (poison or not _CAN_SWAP) and _POISON is not None
        self.loans = Loans(poison=self.poison)
        self.can_invalidate = self.poison or _CAN_SWAP  # else outputs are handed out as clones
        self._live: dict[int, _HandOut] = {}  # storage cdata -> hand-out
        self._high = -1  # highest capture order among live hand-outs (a bound)
        self._stale: dict[int, tuple[StorageWeakRef, str, int]] = {}
        self._state_slots: set[tuple[str, int]] = set()  # (graph, output position)
        self._returned: dict[str, int] = {}  # graph -> the step its last call returned in
        self.invalidated = 0  # hand-outs invalidated while referenced, in all
        self.moved = 0  # hand-outs moved to memory of their own (graph freed, or model state)

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
            state = (graph_id, slot) in self._state_slots
            self._live[ref.cdata] = _HandOut(order, step, ref, graph_id, ptr, slot, state)
            if order > self._high:
                self._high = order
        elif (graph_id, slot) in self._state_slots:
            # another output over this storage came first: the state lives in it all the same
            handed = self._live.get(storage._cdata)
            if handed is not None:
                handed.state = True
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

    def keep_as_state(self, tensor: torch.Tensor, graph_id: str, slot: int) -> None:
        """``tensor``, output ``slot`` of ``graph_id``, came back as a parameter or buffer the
        model rebinds (``self.t = <output>``): what that graph hands out at that position is
        the model's state, read at its next call, maybe after replays of other graphs (two
        instances of one module, two models on one backend). Such a hand-out is moved to
        memory of its own before a replay overwrites it, not invalidated: a copy of the state
        where eager would have kept it (none where the model reads it back first)."""
        handed = self.handed_out(tensor)
        if handed is not None:
            handed.state = True
        self.state_slot(graph_id, slot)

    def state_slot(self, graph_id: str, slot: int) -> None:
        """What ``graph_id`` hands out at position ``slot`` is the model's state (known from
        Dynamo's side effects at compile time, or from :meth:`keep_as_state`)."""
        if (graph_id, slot) in self._state_slots:
            return
        self._state_slots.add((graph_id, slot))
        # what that position handed out before it was known is state too (another instance's,
        # handed out by an earlier call: a replay before that instance's next call overwrites it)
        for other in self._live.values():
            if other.graph_id == graph_id and other.slot == slot:
                other.state = True

    def adopt(self, tensor: torch.Tensor) -> None:
        """Forget ``tensor``'s hand-out: the runtime took its memory over for this call."""
        self._live.pop(tensor.untyped_storage()._cdata, None)

    def export(self, cdata: int, ptr: int) -> None:
        """A tensor over the storage ``cdata`` (at address ``ptr``) is about to be exported to
        NumPy or DLPack (:mod:`fxsplit.runtime.exports`), which keep its address, not its
        storage: a live hand-out or loan it is over moves to memory of its own now, with its
        values, and is forgotten (no replay reaches it).

        Raises:
            RuntimeError: where this torch cannot move a storage (2.11, or a CUDA capture under
                way), naming the output; nothing is exported.
        """
        handed = self._live.get(cdata)
        if handed is None or handed.ref.expired():
            unmoved = self.loans.export(cdata, ptr)
            if unmoved is not None:
                raise RuntimeError(_unexportable(f"an output of captured {unmoved[1]}", unmoved[0]))
            return
        if not may_move():
            raise RuntimeError(_unexportable(f"output {handed.slot}", handed.graph_id))
        del self._live[cdata]
        self.moved += 1
        move_out(cdata)

    def before_write(self, order: int, step: int) -> None:
        """A graph of capture order ``order`` is about to write the pool: invalidate every live
        hand-out it may overwrite (written by a graph of order ``order`` or later)."""
        if order > self._high:
            return
        high = -1
        for cdata, handed in list(self._live.items()):
            if handed.ref.expired():
                del self._live[cdata]
            elif handed.order >= order:
                del self._live[cdata]
                self._overwritten(handed, step)
            elif handed.order > high:
                high = handed.order
        self._high = high

    def before_copy(self, ptr: int, step: int) -> None:
        """A copy outside any replay is about to write the memory at ``ptr`` (an earlier
        piece's output buffer, refilled after that piece ran uncaptured): invalidate the live
        hand-outs over it, and the loans eager ops kept."""
        self.loans.before_copy(ptr)
        for cdata, handed in list(self._live.items()):
            if handed.ptr == ptr:
                del self._live[cdata]
                if not handed.ref.expired():
                    self._overwritten(handed, step)

    def release_order(self, order: int, step: int) -> None:
        """The graph of capture order ``order`` is being freed: its live hand-outs move to
        memory of their own (:meth:`_release`), as do its loans eager ops kept."""
        self.loans.release(order)
        for cdata, handed in list(self._live.items()):
            if handed.order == order:
                del self._live[cdata]
                if not handed.ref.expired():
                    self._release(handed, step)

    def release_all(self, step: int) -> None:
        """The pool's memory is being released: every live hand-out moves to memory of its own
        (:meth:`_release`), as does every loan an eager op kept."""
        self.loans.release()
        for handed in self._live.values():
            if not handed.ref.expired():
                self._release(handed, step)
        self._live.clear()
        self._high = -1

    def check_inputs(self, args, graph_id: str) -> None:
        """Raise if an argument is an invalidated output.

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
                        f"{stale_message(hit[1])}; it was handed to {graph_id} as an input"
                    )

    def returned(self, graph_id: str, step: int) -> None:
        """A call of ``graph_id`` in ``step`` returned: the caller has rebound what it keeps of
        the graph's earlier outputs (see :meth:`held_stale`)."""
        self._returned[graph_id] = step

    def held_stale(self) -> list[str]:
        """Graphs whose invalidated outputs are still referenced after a later call of the
        graph returned (forgets the dead ones). Held before that is no sign of keeping: in
        ``logits = model(x)`` the old logits are bound while the call that overwrites them
        runs, and in ``h = a(x); o = b(h)`` the old ``o``, which ``a``'s replay overwrites, is
        bound until ``b`` returns."""
        held = []
        returned = self._returned
        for cdata, (ref, graph_id, step) in list(self._stale.items()):
            if ref.expired():
                del self._stale[cdata]
            elif returned.get(graph_id, -1) >= step:
                held.append(graph_id)
        return held

    def _overwritten(self, handed: _HandOut, step: int) -> None:
        """A write is about to reuse ``handed``'s memory: the model's state moves (where this
        torch can move a storage), anything else is invalidated."""
        if handed.state and may_move():
            self.moved += 1
            move_out(handed.ref.cdata)
        else:
            self._invalidate(handed, step)

    def _release(self, handed: _HandOut, step: int) -> None:
        """Its graph is freed, so no replay will write it: where this torch can move a
        storage, its values move to memory of their own and it stays readable (a model's state
        rebound to an output survives a reset, as in eager); else it is invalidated."""
        if may_move():
            self.moved += 1
            move_out(handed.ref.cdata)
        else:
            self._invalidate(handed, step)

    def _invalidate(self, handed: _HandOut, step: int) -> None:
        self.invalidated += 1
        cdata = handed.ref.cdata
        if self.poison:
            _POISON(cdata, stale_message(handed.graph_id))
        else:
            move_out(cdata)
        self._stale[cdata] = (handed.ref, handed.graph_id, step)
