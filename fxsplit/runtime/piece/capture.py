"""One capture of a captured piece at one key: bind its inputs to static buffers, run it under
the pool's graph capture (legality checked first for a compiled piece, whose kernels the
emulator cannot see), roll back what a failed capture wrote, and record the :class:`Entry`.
"""

from __future__ import annotations

import dataclasses

import torch

from fxsplit.facts.aliasing import PieceAliasing
from fxsplit.runtime.inputs import binding
from fxsplit.runtime.inputs.binding import Bind, InputSpec, Refused
from fxsplit.runtime.inputs.static_buffers import AliasGuard, OwnBuffer, memory_span
from fxsplit.runtime.memory import provenance
from fxsplit.runtime.memory.storage import storage_ptr
from fxsplit.runtime.piece.entry import Check, Entry, OutputView, Written, flat

__all__ = ["NO_KERNEL", "NoKernel", "analyse", "capture", "never_captured"]

_OWN, _ADDRESS, _PINNED = Bind.OWN, Bind.ADDRESS, Bind.PINNED

NO_KERNEL = "it launches no kernel (views and allocations only): it runs as its Python"


class NoKernel(Exception):
    """The capture recorded no kernel (a piece of views and ``empty`` allocations only): a
    replay would do nothing that the piece's Python does not do without copying its inputs,
    and CUDA warns about an empty graph."""


def capture(piece, key, inputs) -> Entry:
    """Capture ``key``; the returned entry's outputs hold this call's result.

    Raises:
        Refused: this call's inputs share storage in a way the static buffers cannot keep,
            or a compiled piece's legality could not be checked.
        NoKernel: the capture recorded no kernel (dropped).
        CaptureError / RuntimeError: an op illegal under capture, or outputs that require
            grad. Nothing the piece writes is left changed by a failed capture, and the device's
            generators are left as they were (``close_capture_state``).
    """
    context = piece.context
    if piece.aliasing.deferred:
        analyse(piece, inputs)
    pool = context.pool
    binds, statics, buffers = [], [], []
    for spec, value in zip(piece.specs, inputs, strict=True):
        buffer = None
        if not isinstance(value, torch.Tensor):
            bind = Bind.HOST
        elif spec.kind == binding.INTERNAL and id(value) in context.static_outputs:
            bind = _OWN  # an earlier captured piece's output: fxsplit's memory already
            buffer = OwnBuffer(value, None, None, pooled=True)
        elif spec.kind == binding.RUNNER and context.is_frozen_memory(value):
            bind = _PINNED  # a view of a parameter or buffer: its memory never moves
        else:
            bind = binding.bind(spec, context.binding, provenance.RECORD.produced(value))
            if bind is _OWN:
                buffer = context.buffers.get(value, context.epoch, spec.rebound)
        binds.append(bind)
        buffers.append(buffer)
        statics.append(buffer.static if buffer is not None else value)
    written = [i for i, spec in enumerate(piece.specs) if spec.written]
    guard = AliasGuard(statics, inputs, binds, written) if written else None
    if guard is not None:
        guard.check(piece.specs, inputs)
    for i, buffer in enumerate(buffers):
        if buffer is not None and buffer.static is not inputs[i] and buffer.mark is None:
            buffer.remember(inputs[i], context.epoch)
    graph = pool.new_graph(piece.generators)
    if context.mode == "emulate":
        graph.label = f"{context.graph_id} {piece.name}"
    context.session.collect_once()
    try:
        outputs = graph.capture_piece(
            piece.run_uncaptured, statics, written, piece.check_uncompiled, _refuse_grad
        )
    except BaseException:
        graph.reset()
        graph.close_capture_state()
        raise
    if graph.empty:
        graph.reset()
        raise NoKernel(NO_KERNEL)
    order = pool.next_order()
    bases = _output_bases(piece, outputs, statics)
    views = _views(piece, outputs, statics, binds, bases)
    owned = []
    inputs_memory = {storage_ptr(v) for v in statics if isinstance(v, torch.Tensor)}
    for out, base in zip(flat(outputs), bases, strict=True):
        if (
            isinstance(out, torch.Tensor)
            and base is None
            and out.untyped_storage().nbytes()
            # an empty view of an input has no base but is no memory of fxsplit's
            and storage_ptr(out) not in inputs_memory
        ):
            # fxsplit's own memory: later pieces read it where it is (a view of a caller's
            # tensor or parameter is never bound that way: a copy into it would write there)
            context.static_outputs[id(out)] = out
            ptr = storage_ptr(out)
            pool.owners[ptr] = order
            owned.append((id(out), ptr))
    checks = tuple(
        Check(i, statics[i], statics[i].data_ptr(), bind, buffers[i])
        for i, bind in enumerate(binds)
        if bind in (_OWN, _ADDRESS, _PINNED)
    )
    capture_ptrs = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else None for v in inputs)
    entry = Entry(key, graph, statics, outputs, checks, views, piece.stats.key(key), capture_ptrs)
    entry.order = order
    entry.owned = tuple(owned)
    written = [i for i in written if isinstance(statics[i], torch.Tensor)]
    entry.written = tuple(Written(i, statics[i], buffers[i]) for i in written if binds[i] is _OWN)
    entry.bumped = tuple(statics[i] for i in written if binds[i] is not _OWN)
    entry.bumped_spans = tuple(memory_span(static) for static in entry.bumped)
    # the capture wrote that memory: copies made of it through other tensors are stale
    context.buffers.written.add(entry.bumped_spans)
    context.buffers.forget_spans(entry.bumped_spans)
    entry.alias_guard = guard if guard is not None and guard.needed else None
    first: dict[int, int] = {}
    shared = []
    for i, buffer in enumerate(buffers):
        if buffer is not None and binds[i] is _OWN:
            j = first.setdefault(id(buffer), i)
            if j != i:
                shared.append((j, i))
    entry.shared = tuple(shared)
    return entry


def analyse(piece, inputs) -> None:
    """The aliasing analysis deferred to the first capture (data-dependent input sizes), on
    this call's inputs; a piece it cannot run on is never captured.

    Raises:
        Refused: the analysis failed (the piece runs uncaptured from now on).
    """
    from fxsplit.facts import aliasing

    python = piece.check_uncompiled or piece.run_uncaptured
    facts = aliasing.analyse(python, list(inputs), piece.num_outputs)
    piece.aliasing = facts
    piece.specs = [
        dataclasses.replace(spec, written=i in facts.written) for i, spec in enumerate(piece.specs)
    ]
    piece.failed = never_captured(piece.specs, facts, ())
    if piece.failed is not None:
        raise Refused(piece.failed)


def _output_bases(piece, outputs, statics) -> list[int | None]:
    """Per output, the input whose static buffer it shares memory with at this capture key,
    else None: the analysis's answer where the memory confirms it, else the memory's (a view
    may be a copy at another size: ``reshape``, ``contiguous``)."""
    facts = piece.aliasing.output_bases
    owners: dict[int, int] = {}
    for i, static in enumerate(statics):
        if isinstance(static, torch.Tensor) and static.numel():
            owners.setdefault(storage_ptr(static), i)
    bases: list[int | None] = []
    for j, out in enumerate(flat(outputs)):
        if not isinstance(out, torch.Tensor) or not out.numel():
            bases.append(None)
            continue
        ptr = storage_ptr(out)
        fact = facts[j] if j < len(facts) else None
        if fact is not None and storage_ptr(statics[fact]) == ptr:
            bases.append(fact)
        else:
            bases.append(owners.get(ptr))
    return bases


def _views(piece, outputs, statics, binds, bases) -> tuple:
    """An :class:`~fxsplit.runtime.piece.entry.OutputView` per output that is a view of an OWN
    input, or a view without autograd history of an input that requires grad."""
    views = []
    for j, (out, i) in enumerate(zip(flat(outputs), bases, strict=True)):
        if i is None or not isinstance(out, torch.Tensor):
            continue
        fresh = out.requires_grad and _leaf_view(out)
        if binds[i] != _OWN and not fresh:
            continue
        static = statics[i]
        start = out.storage_offset() * out.element_size()
        offset = (start - static.storage_offset() * static.element_size()) // out.element_size()
        dtype = None if out.dtype == static.dtype else out.dtype
        if dtype is not None and (static.is_conj() or static.is_neg()):
            raise RuntimeError(
                f"{piece.name}: an output views input {piece.specs[i].name!r} (conjugate or "
                "negative bit set) in another dtype; it cannot be rebuilt over the caller's "
                "tensor"
            )
        shape, strides = tuple(out.shape), tuple(out.stride())
        conj, neg = out.is_conj(), out.is_neg()
        views.append(
            OutputView(j, i, shape, strides, offset, dtype, conj, neg, out is static, fresh)
        )
    return tuple(views)


def never_captured(specs: list[InputSpec], aliasing: PieceAliasing, devices) -> str | None:
    """Why a piece can never be captured, from its facts; None when it can."""
    accelerators = [d for d in devices if d != "cpu"]
    if len(accelerators) > 1:
        return (
            f"its tensors span devices {', '.join(accelerators)}; a graph captures the work of "
            "one device, so the others' work would be missing from every replay"
        )
    if aliasing.error is not None:
        return aliasing.error
    if aliasing.metadata_written:
        names = ", ".join(repr(specs[i].name) for i in sorted(aliasing.metadata_written))
        return (
            f"it changes the size or stride of input(s) {names} in place; a replay would not "
            "(CUDA graphs replay kernels, not metadata)"
        )
    return None


def _refuse_grad(outputs) -> None:
    for out in flat(outputs):
        # A view of a parameter taken without grad requires grad but has no autograd history
        # (a leaf's views keep requires_grad): no grad_fn a replay could return stale, and each
        # replay makes the view anew (_views), as eager does.
        if isinstance(out, torch.Tensor) and out.requires_grad and not _leaf_view(out):
            raise RuntimeError(
                "an output requires grad (grad is enabled inside the piece); a replay would "
                "return it with the capture step's grad_fn"
            )


def _leaf_view(out: torch.Tensor) -> bool:
    """Whether ``out`` is a view, without autograd history, of a leaf (a parameter)."""
    base = out._base
    return out.grad_fn is None and base is not None and base.grad_fn is None
