"""Captured outputs lent to the eager pieces of their graph, and what becomes of one an eager op
keeps.

A captured piece's output that an eager piece reads (the hidden state an attention op or a
drafter's custom op is handed) lives in the pool, and the piece's next replay writes it again.
An op may keep what it was handed past the call (EAGLE/MTP-style reuse of the hidden state, a
hook that stores its argument); in eager it would keep that step's values. So an eager piece is
handed such an output as a *loan*: a fresh tensor, each call, over a storage object of its own
(one ``StorageImpl`` per pool storage, made once per capture) over the pool's memory, never the
pool's own tensor (so an in-place change of its sizes, or a cache keyed on it, never outlives
the call, as with eager's new tensor each step). At the start of each step, before any replay
can write the pool, a loan over which any tensor beyond fxsplit's own views still exists, or
whose storage object something holds, was kept: its storage moves to memory of its own with that
step's values
(``UntypedStorage._swap_data_ptr_``), so whatever kept it reads what eager's would, and the
piece's later loans get a fresh storage. Nothing is counted per call: a loan is found kept from
its storage's use count and its storage object's references, and a false alarm (a traceback
holding a frame) costs one copy, never a wrong number. A NumPy array or DLPack capsule an op
makes of a loan keeps the pool's address, which no move reaches (docs/capture.md, "Exports").

Where this torch cannot move a storage (2.11), a kept loan is invalidated as CUDA invalidates a
handed-out output (a read raises) where the hook for that exists, else warned about.

The ledger (:class:`~fxsplit.runtime.memory.output_lifetime.OutputLedger`) frees loans with the
rest of
its hand-outs: a graph freed, the pool released, a copy into the memory outside any replay.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit.runtime.memory.storage import may_move, move_out, storage_ptr, view_over

__all__ = ["Borrower", "Loans", "borrower"]

_POISON = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)
_USE_COUNT = torch._C._storage_Use_Count  # tensors (and storage objects) over one storage
_REFS = sys.getrefcount


class _Lent(NamedTuple):
    """One pool tensor lent: ``source`` (the pool's tensor) and ``view``, the same tensor
    over the loan's storage; each call is handed a fresh ``detach`` of ``view``."""

    source: torch.Tensor
    view: torch.Tensor


@dataclass(eq=False)
class _Loan:
    """One pool storage lent out: ``views[i]`` is ``sources[i]`` (a pool tensor) over a storage
    of its own; ``base`` is what :func:`_uses` reads when nothing but fxsplit holds them."""

    order: int  # capture order of the graph that writes the memory
    ptr: int  # the memory's address
    graph_id: str
    piece: str
    sources: list
    views: list
    lent: list = field(default_factory=list)  # a _Lent per source
    storage: torch.UntypedStorage | None = None  # the loan's storage (the one Python object)
    cdata: int = 0
    ref: StorageWeakRef | None = None  # to the loan's storage
    base: int = 0


def _uses(loan: _Loan) -> int:
    """Every reference to the loan's storage: each tensor over it (what an eager piece was
    handed, any view of that, held by Python or C++ code) holds it once, and its one Python
    storage object (``t.untyped_storage()`` returns it) counts what holds that."""
    return _USE_COUNT(loan.cdata) + _REFS(loan.storage)


def _kept(loan: _Loan) -> bool:
    """Whether anything but fxsplit's own views refers to the loan's memory."""
    return _uses(loan) != loan.base


class Loans:
    """The pool outputs lent to eager pieces (one per pool, shared by its graphs).

    Attributes:
        lent: ``id(pool tensor)`` -> its :class:`_Lent` record, read by :class:`Borrower` on
            every call of an eager piece.
        moved: kept loans moved to memory of their own, in all.
    """

    def __init__(self, poison: bool):
        self.poison = poison and _POISON is not None
        self.lent: dict[int, _Lent] = {}
        self._loans: list[_Loan] = []
        self._at: dict[int, _Loan] = {}  # memory address -> its loan
        self.moved = 0

    def lend(self, outputs, order: int, graph_id: str, piece: str) -> None:
        """Lend ``outputs`` (tensors in the pool, ``graph_id``'s ``piece``'s own or views of an
        earlier piece's, of capture order ``order``, that eager pieces read) from now on;
        tensors over one pool storage share one loan, as they share memory."""
        groups: dict[int, list[torch.Tensor]] = {}
        for out in outputs:
            groups.setdefault(storage_ptr(out), []).append(out)
        for ptr, sources in groups.items():
            loan = _Loan(order, ptr, graph_id, piece, sources, [])
            self._fill(loan)
            self._loans.append(loan)
            self._at[ptr] = loan

    def _fill(self, loan: _Loan) -> None:
        """Give ``loan`` a fresh storage over its memory and views over it."""
        first = loan.sources[0]
        storage = torch._C._construct_storage_from_data_pointer(
            loan.ptr, first.device, first.untyped_storage().nbytes()
        )
        loan.views = [view_over(storage, source) for source in loan.sources]
        loan.storage, loan.cdata, loan.ref = storage, storage._cdata, StorageWeakRef(storage)
        del storage
        # (comprehensions: a loop variable left bound to a view would count in ``base``)
        loan.lent = [_Lent(s, v) for s, v in zip(loan.sources, loan.views, strict=True)]
        self.lent.update({id(lent.source): lent for lent in loan.lent})
        loan.base = _uses(loan)

    def live_refs(self) -> list[StorageWeakRef]:
        """Weak references to every loan's storage: what an eager op kept of the pool's memory
        keeps it alive when the pool goes (:meth:`EmulatedPool.outlive`)."""
        return [loan.ref for loan in self._loans]

    def kept(self) -> list[tuple[str, str]]:
        """``(graph, piece)`` of each loan something beyond fxsplit's own views still holds."""
        return [(loan.graph_id, loan.piece) for loan in self._loans if _kept(loan)]

    def settle(self) -> list[tuple[str, str]]:
        """A step begins: every loan an eager op kept moves to memory of its own (or is
        invalidated where this torch cannot move it). Returns ``(graph, piece)`` of each kept
        loan where neither is possible (warned about: the next replay overwrites it)."""
        unsafe = []
        for loan in self._loans:
            if _kept(loan) and not self._give_up(loan):
                unsafe.append((loan.graph_id, loan.piece))
        return unsafe

    def at(self, value: torch.Tensor) -> _Loan | None:
        """The loan over the memory ``value`` lies in (a view of a lent output that no loan
        view was made for), else None."""
        return self._at.get(storage_ptr(value)) if self._at else None

    def before_copy(self, ptr: int) -> None:
        """A copy outside any replay is about to write the memory at ``ptr``: loans over it
        that were kept leave it first."""
        for loan in self._loans:
            if loan.ptr == ptr and _kept(loan):
                self._give_up(loan)

    def release(self, order: int | None = None) -> None:
        """The graph of capture order ``order`` (every graph, for None) is being freed: kept
        loans over its memory leave it, and nothing is lent from it any more."""
        keep = []
        for loan in self._loans:
            if order is not None and loan.order != order:
                keep.append(loan)
                continue
            if _kept(loan):
                self._give_up(loan, refill=False)
            for source in loan.sources:
                self.lent.pop(id(source), None)
            if self._at.get(loan.ptr) is loan:
                del self._at[loan.ptr]
        self._loans = keep

    def kept_storage(self, ptr: int) -> torch.UntypedStorage | None:
        """The memory at ``ptr`` (a pool storage the graph returns) as an eager op kept it, if
        one did: it moves out of the pool now, so that the caller's tensor shares it with the
        op's, as eager's one tensor would (a hand-out or a copy of its own would miss the
        model's later writes to it, after a graph break or at the next step, ``x = model(x)``
        writing ``x``). None where no loan of it is kept, or where it cannot move."""
        loan = self._at.get(ptr)
        if loan is None or not _kept(loan) or not may_move():
            return None
        self.moved += 1
        move_out(loan.cdata)
        storage = loan.storage
        self._fill(loan)
        return storage

    def _give_up(self, loan: _Loan, refill: bool = True) -> bool:
        """The loan was kept: its storage leaves the pool (moved, or made to raise when read)
        and, with ``refill``, the pool tensors are lent anew. False where neither can be done
        (the loan stays, warned about)."""
        if may_move():
            self.moved += 1
            move_out(loan.cdata)
        elif self.poison:
            _POISON(loan.cdata, _kept_message(loan))
        else:
            return False
        if refill:
            self._fill(loan)
        return True


def _kept_message(loan: _Loan) -> str:
    return (
        f"fxsplit {loan.graph_id}: this tensor is an output of captured {loan.piece} that an "
        "eager op kept past the call that handed it; a later replay has overwritten it and this "
        "torch cannot move it to memory of its own. Clone it where it is kept (t.clone())"
    )


class Borrower:
    """An eager piece called with loans in place of the pool tensors it reads (see the module
    docstring): each call gets fresh tensors over the loans' storages. What it
    returns that is a loan it was handed goes on as the pool's own tensor, so later captured
    pieces read it where it lies.

    Args:
        piece: the eager :class:`~fxsplit.passes.materialise.PieceModule`.
        positions: indices of its inputs that captured pieces produce.
        views: indices of its inputs that other borrowers produce (views of their loans,
            found by address).
        loans: the pool's :class:`Loans`.
    """

    __slots__ = ("lent", "loans", "piece", "positions", "views")

    def __init__(self, piece, positions: tuple[int, ...], views: tuple[int, ...], loans: Loans):
        self.piece = piece
        self.positions = positions
        self.views = views
        self.loans = loans
        self.lent = loans.lent

    def __call__(self, *args):
        # the piece's forward, as the stitched module's call of it would run (it has no hooks)
        lent = self.lent
        if not lent:
            return self.piece.forward(*args)
        handed = None
        for i in self.positions:
            hit = lent.get(id(args[i]))
            if hit is not None and hit.source is args[i]:
                if handed is None:
                    handed, args = {}, list(args)
                args[i] = view = hit.view.detach()
                handed[id(view)] = hit.source
        for i in self.views:
            value = args[i]
            loan = self.loans.at(value) if isinstance(value, torch.Tensor) else None
            if loan is not None:
                if handed is None:
                    handed, args = {}, list(args)
                args[i] = view_over(loan.storage, value)
        out = self.piece.forward(*args)
        if handed is None:
            return out
        return _returned(out, handed)


def _returned(out, handed: dict):
    """``out`` with each loan view the piece was handed (``handed``: ``id`` -> the pool
    tensor it stands for) back as that pool tensor, or as a view of it where the piece changed
    the loan view's layout in place (``h.t_()``: the later pieces read what it returned)."""
    if isinstance(out, tuple):
        return tuple(_back(v, handed) if isinstance(v, torch.Tensor) else v for v in out)
    return _back(out, handed) if isinstance(out, torch.Tensor) else out


def _back(value: torch.Tensor, handed: dict) -> torch.Tensor:
    source = handed.get(id(value))
    if source is None:
        return value
    size, stride, offset = value.size(), value.stride(), value.storage_offset()
    if size == source.size() and stride == source.stride() and offset == source.storage_offset():
        return source
    return source.as_strided(size, stride, offset)


def borrower(
    module, kept: frozenset[int], nodes: dict, producer: dict, captured: list, stitched, loans
) -> Borrower | None:
    """A :class:`Borrower` running ``module`` (a piece of the stitched module ``stitched``)
    eagerly with loans in place of the captured outputs it reads and may keep (``kept``: their
    input positions, :func:`fxsplit.facts.keeping.kept_inputs`), and what other borrowers made
    of theirs (views of loans) over their loans too; None where it reads none. ``nodes``: the
    split graph's nodes by name; ``producer``: node -> the piece that makes it; ``captured``:
    the captured pieces made so far, whose ``lent`` outputs grow by what ``module`` reads."""
    by_name = {piece.name: piece for piece in captured}
    pieces = stitched.__dict__
    positions, views = [], []
    lent: dict[str, set[int]] = {}
    for i, name in enumerate(module.input_names):
        if i not in kept:
            continue
        made_by = producer.get(nodes[name])
        piece = by_name.get(made_by)
        if piece is not None:
            positions.append(i)
            lent.setdefault(piece.name, set()).add(piece.output_names.index(name))
        elif isinstance(pieces.get(made_by), Borrower):
            views.append(i)
    if not positions and not views:
        return None
    for name, outputs in lent.items():
        piece = by_name[name]
        piece.lent = tuple(sorted({*piece.lent, *outputs}))
    return Borrower(module, tuple(positions), tuple(views), loans)
