"""Outputs leaving a call of a graph, and earlier outputs coming back in.

A call hands its outputs in the pool's memory out through the pool's
:class:`~fxsplit.runtime.memory.output_lifetime.OutputLedger` (:func:`hand_out`), or as clones under
``clone_outputs``. An output an earlier step handed out that comes back as an argument
(``x = model(x)``) is read from a private copy for the call (:func:`take_over`), since the
step's replays may overwrite its memory first; afterwards the caller's tensor gets memory of its
own holding the model's writes (:func:`hand_back`).
"""

from __future__ import annotations

import torch

from fxsplit.runtime.memory import provenance
from fxsplit.runtime.memory.output_lifetime import can_swap, poison
from fxsplit.runtime.memory.storage import clone_sharing, is_strided, storage_ptr, view_over

__all__ = ["hand_back", "hand_out", "take_over", "with_copies"]


def take_over(pool, args, indices: list[int]) -> list | None:
    """The arguments at ``indices`` that are outputs an earlier step handed out (or views of
    them): this step's replays may overwrite their memory before they are read, so the step
    reads private copies (sharing memory as the originals do), handed back afterwards.
    Outputs handed out in this step need none: replays keep capture order within a step."""
    ledger = pool.ledger
    earlier = ledger.handed_before(pool.step)
    if not earlier:  # the common step: nothing handed out before is still referenced
        return None
    back = [i for i in indices if args[i].untyped_storage()._cdata in earlier]
    if not back:
        return None
    copies = clone_sharing([args[i] for i in back])
    for i in back:
        ledger.adopt(args[i])
    handed = [(i, args[i], c) for i, c in zip(back, copies, strict=True)]
    provenance.RECORD.take(handed)
    return handed


def with_copies(args: tuple, handed: list | None) -> tuple:
    """``args`` with the private copies of :func:`take_over` in place."""
    if not handed:
        return args
    args = list(args)
    for i, _, copy in handed:
        args[i] = copy
    return tuple(args)


def hand_back(out: tuple, handed: list, graph_id: str) -> tuple:
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
        if is_strided(o) and o.untyped_storage()._cdata in swapped
        else o
        for o in out
    )


def hand_out(out: tuple, pool, graph_id: str, clone: bool) -> tuple:
    """The outputs in the pool's memory as fresh tensors the ledger follows, or clones with
    ``clone_outputs`` (keeping eager's aliasing between them) and for the model's state where
    this torch cannot move it out of the pool later
    (:meth:`~fxsplit.runtime.memory.output_lifetime.OutputLedger.owns_copy`)."""
    owners, ledger = pool.owners, pool.ledger
    # addresses read before anything moves: a loan moved below takes every tensor over it along
    ptrs = {
        j: storage_ptr(o)
        for j, o in enumerate(out)
        if isinstance(o, torch.Tensor)
        # a view of an input that is itself an output handed out earlier in this step is
        # returned as that view: one memory, one hand-out
        and ledger.handed_out(o) is None
    }
    mine = [j for j, ptr in ptrs.items() if ptr in owners]
    if not mine:
        return out
    result = list(out)
    # what an eager op kept of an output it was lent: the caller's tensor shares that memory
    loans, kept = pool.ledger.loans, {}
    if loans.lent:
        for j in mine:
            ptr = ptrs[j]
            if ptr not in kept:
                kept[ptr] = loans.kept_storage(ptr)
            if kept[ptr] is not None:
                result[j] = view_over(kept[ptr], out[j])
        mine = [j for j in mine if kept[ptrs[j]] is None]
    if clone or not pool.ledger.can_invalidate:
        for j, copy in zip(mine, clone_sharing([out[j] for j in mine]), strict=True):
            result[j] = copy
        return tuple(result)
    own = [j for j in mine if ledger.owns_copy(graph_id, j)]
    if own:
        for j, copy in zip(own, clone_sharing([out[j] for j in own]), strict=True):
            result[j] = copy
        mine = [j for j in mine if j not in own]
    storages: dict[int, torch.UntypedStorage] = {}
    step = pool.step
    for j in mine:
        result[j] = ledger.hand_out(out[j], storages, owners[ptrs[j]], step, graph_id, j)
    return tuple(result)
