"""One capture key of a captured piece: its graph, static buffers and binding table (an
:class:`Entry`), the capture key of a call, and the views of inputs an entry rebuilds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from fxsplit.runtime.inputs import binding
from fxsplit.runtime.inputs.binding import Bind
from fxsplit.runtime.piece.stats import StaticAddress

if TYPE_CHECKING:
    from fxsplit.runtime.inputs.static_buffers import AliasGuard, OwnBuffer

__all__ = [
    "Check",
    "Entry",
    "OutputView",
    "Written",
    "bound_function",
    "flat",
    "key_function",
    "rebuild",
]


class Check(NamedTuple):
    """An input bound OWN, ADDRESS or PINNED: what each replay checks (or refills) first."""

    index: int  # among the piece's inputs
    static: torch.Tensor  # what the graph reads
    ptr: int  # ``static``'s data pointer at capture
    bind: Bind
    buffer: OwnBuffer | None  # fxsplit's own buffer, for OWN


class Written(NamedTuple):
    """An OWN input the piece writes: after each replay, copied back to the caller's tensor."""

    index: int
    static: torch.Tensor
    buffer: OwnBuffer


class OutputView(NamedTuple):
    """An output that views OWN input ``input``: eagerly it aliases the caller's tensor, so
    each replay rebuilds it over that tensor (:func:`rebuild`). ``fresh``: a view, without
    autograd history, of an input that requires grad (a weight): eager makes it anew each call,
    with the weight's version of then, so each replay rebuilds it whatever the binding."""

    output: int  # position among the piece's outputs
    input: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements of the output's dtype from the input's start
    dtype: torch.dtype | None  # None where the view keeps the input's dtype
    conj: bool
    neg: bool
    itself: bool  # the output is the input tensor itself (an in-place op's result), no view
    fresh: bool


class Entry:
    """One capture key of a piece: its graph, static buffers, binding table and counters.

    ``checks`` holds a :class:`Check` per input bound OWN, ADDRESS or PINNED (``owns`` the OWN
    ones, ``bound`` tells in one call whether every other one is where capture found it);
    ``written`` a :class:`Written` per OWN input the piece writes, ``bumped`` the other written
    inputs, whose version counters each replay bumps (``bumped_spans``: their storages' byte
    ranges, registered in the graph's
    :class:`~fxsplit.runtime.inputs.static_buffers.WrittenMemory` while the entry lives);
    ``views`` an :class:`OutputView` per output that is a view of an OWN input (hot loops
    unpack them as tuples); ``shared`` the pairs of OWN inputs bound to one shared buffer (the
    same caller view at capture); ``alias_guard`` checks shared storage per call (pieces that
    write an input); ``order`` is the graph's capture order in the pool; ``owned`` the ids and
    data pointers of the outputs in fxsplit's memory.
    """

    __slots__ = (
        "alias_guard",
        "bound",
        "bumped",
        "bumped_spans",
        "capture_ptrs",
        "checks",
        "counts",
        "graph",
        "key",
        "order",
        "outputs",
        "owned",
        "owns",
        "shared",
        "statics",
        "views",
        "written",
    )

    def __init__(self, key, graph, statics, outputs, checks, views, counts, capture_ptrs):
        self.key = key
        self.graph = graph
        self.statics = statics
        self.outputs = outputs
        self.counts = counts
        self.capture_ptrs = capture_ptrs
        self.checks = checks
        self.owns = tuple(check for check in checks if check.bind is Bind.OWN)
        self.bound = bound_function(check for check in checks if check.bind is not Bind.OWN)
        self.views = views
        self.written: tuple[Written, ...] = ()
        self.bumped: tuple[torch.Tensor, ...] = ()
        self.bumped_spans: tuple[tuple[int, int], ...] = ()
        self.alias_guard: AliasGuard | None = None
        self.order = -1
        self.owned: tuple = ()
        self.shared: tuple = ()  # (i, j): OWN inputs bound to one buffer (one tensor at capture)


def rebuild(value, size, stride, offset, dtype, conj, neg, itself) -> torch.Tensor:
    """The view an output had of its input at capture, over the caller's tensor ``value``
    instead of fxsplit's copy: a real view (shared version counter), in the output's dtype,
    with its conjugate and negative bits; ``value`` itself where the output was the input
    tensor itself. A view of the same layout is still a tensor of its own, as in eager
    (``x.expand_as(x)``): an in-place change of its layout must not reach ``value``."""
    if itself:
        return value
    base = value if dtype is None else value.view(dtype)
    if offset == 0 and size == base.shape and stride == base.stride():
        view = base.view_as(base)
    else:
        view = base.as_strided(size, stride, base.storage_offset() + offset)
    if view.is_conj() != conj:
        view = view.conj()
    if view.is_neg() != neg:
        view = torch._neg_view(view)
    return view


def key_function(reads):
    """``inputs -> capture key``: every host value the piece reads, told apart exactly (by type:
    ``True`` / ``1`` / ``1.0``; by text: ``0.0`` / ``-0.0``, while NaN matches NaN), and each
    distinct dynamic size of its tensor inputs (see
    :func:`fxsplit.runtime.inputs.binding.key_reads`).
    Generated as one tuple expression because this runs on every call."""
    parts = [
        f"(a[{i}].__class__, a[{i}] if a[{i}] == a[{i}] and a[{i}] != 0 else repr(a[{i}]))"
        if d is None
        else f"_Address(a[{i}].data_ptr())"
        if d == binding.ADDRESS_READ
        else f"a[{i}].shape"
        if d < 0
        else f"a[{i}].shape[{d}]"
        for i, d in reads
    ]
    return eval(f"lambda a: ({''.join(p + ', ' for p in parts)})", {"_Address": StaticAddress})


def bound_function(checks):
    """``inputs -> bool`` (None for no ``checks``): whether every ADDRESS or PINNED input in
    ``checks`` is bound as at capture, the object captured at its data pointer (``x.set_(new)``
    gives the same object other memory), or another tensor there with the capture's strides.
    Generated as one expression because this runs on every replay; a ``False`` is explained
    by the caller."""
    names: dict[str, torch.Tensor] = {}
    parts = []
    for i, static, ptr, _, _ in checks:
        names[f"s{i}"] = static
        same = f"a[{i}] is s{i} or a[{i}].stride() == {static.stride()}"
        parts.append(f"a[{i}].data_ptr() == {ptr} and ({same})")
    if not parts:
        return None
    return eval(f"lambda a: {' and '.join(f'({p})' for p in parts)}", names)


def flat(value):
    return value if isinstance(value, tuple) else (value,)
