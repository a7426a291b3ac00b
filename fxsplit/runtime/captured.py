"""A captured piece at run time: one graph per capture key, bound inputs, replay.

Hot path per call (:meth:`CapturedPiece.__call__`): build the key, look up its entry, bind the
inputs (:mod:`fxsplit.runtime.binding`: copy a changed value into fxsplit's own buffer, refuse a
moved persistent tensor), replay, write back what the piece writes, and rebuild outputs that are
views of an input over the caller's tensor. Parameters are not looked at here: the graph runtime
checks them once per step. What the piece writes and aliases is read from its
:class:`~fxsplit.passes.aliasing.PieceAliasing`, computed once at split time.
"""

from __future__ import annotations

import logging

import torch

from fxsplit import counters
from fxsplit.passes.aliasing import PieceAliasing
from fxsplit.runtime import binding
from fxsplit.runtime.binding import Bind, BindingError, InputSpec
from fxsplit.runtime.graphs import new_graph
from fxsplit.runtime.replay_watch import Watch
from fxsplit.runtime.stats import PieceStats
from fxsplit.runtime.storage import clone_sharing

_TOTALS = counters.totals
_OWN, _ADDRESS = Bind.OWN, Bind.ADDRESS
_increment_version = torch.autograd.graph.increment_version

log = logging.getLogger("fxsplit")


class VerifyError(RuntimeError):
    """``verify=True`` found a replay whose result differs from running the piece uncaptured."""


class _Refused(Exception):
    """This call's inputs cannot be captured with their aliasing kept; run it uncaptured."""


class _Entry:
    """One capture key of a piece: its graph, static buffers, binding table and counters.

    ``checks`` holds ``(i, static, data_ptr, bind)`` per input bound OWN or ADDRESS; ``synced[i]``
    remembers the value last copied into an OWN buffer (weak reference, version, address), so
    an unchanged caller tensor is not copied again; ``written`` holds ``(i, static, bind)`` per
    input the piece writes; ``views`` holds ``(j, i, size, stride, offset, dtype, conj, neg)``
    per output that is a view of OWN input ``i`` (rebuilt over the caller's tensor after each
    replay); ``alias_guard`` checks shared storage per call (pieces that write an input);
    ``regions`` holds the flat memory under OWN buffers of inputs that overlap themselves.
    """

    __slots__ = (
        "alias_guard",
        "capture_ptrs",
        "checks",
        "counts",
        "graph",
        "key",
        "outputs",
        "regions",
        "statics",
        "synced",
        "views",
        "written",
    )

    def __init__(self, key, graph, statics, outputs, binds, views, counts, capture_ptrs):
        self.key = key
        self.graph = graph
        self.statics = statics
        self.outputs = outputs
        self.counts = counts
        self.capture_ptrs = capture_ptrs
        self.checks = tuple(
            (i, s, s.data_ptr(), b)
            for i, (s, b) in enumerate(zip(statics, binds, strict=True))
            if b in (_OWN, _ADDRESS)
        )
        self.synced: list = [None] * len(statics)
        self.views = views
        self.written: tuple = ()
        self.alias_guard: _AliasGuard | None = None
        self.regions: dict[int, torch.Tensor] = {}


class CapturedPiece(torch.nn.Module):
    """Stands in for a captured :class:`~fxsplit.passes.materialise.PieceModule` in the stitched
    module when capture is on.

    Args:
        piece: the piece module (its ``forward`` is the uncaptured code).
        specs: one :class:`~fxsplit.runtime.binding.InputSpec` per input.
        key_reads: what the capture key reads (:func:`fxsplit.runtime.binding.key_reads`).
        aliasing: what the piece writes and aliases (:mod:`fxsplit.passes.aliasing`).
        plan_piece: the :class:`~fxsplit.plan.Piece` (regions for messages, devices).
        runtime: the :class:`~fxsplit.runtime.graph_runtime.GraphRuntime` that owns it.
    """

    def __init__(
        self, piece, specs: list[InputSpec], key_reads, aliasing: PieceAliasing, plan_piece, runtime
    ):
        super().__init__()
        self.name = piece.name
        self.kind = piece.kind
        self.code = piece.code
        self.run_uncaptured = piece.forward
        # A compiled piece's kernels are invisible to the emulator: its legality is checked on
        # the piece's generated Python, whose ops the emulator sees.
        self.check_uncompiled = getattr(piece.forward, "eager", None)
        # Triton compiles and autotunes a kernel on its first launch, which a CUDA capture
        # would record as a failure: a compiled piece runs once before it is captured.
        compiled = self.check_uncompiled is not None and runtime.mode == "cuda"
        self.min_warmups = max(runtime.warmup_runs, 1 if compiled else 0)
        self.specs = specs
        self.aliasing = aliasing
        self.regions = frozenset(plan_piece.regions)
        self.random = plan_piece.random
        self.runtime = runtime
        self.entries: dict[tuple, _Entry] = {}
        self.warmups: dict[tuple, int] = {}
        self.failed: str | None = _never_captured(specs, aliasing, plan_piece.devices)
        if self.failed is not None:
            log.warning("fxsplit: %s runs uncaptured: %s", self.name, self.failed)
        self._refusals: set[str] = set()
        self.stats = PieceStats(Watch(self, key_reads))
        self.key = _key_function(key_reads)

    def __call__(self, *inputs):
        runtime = self.runtime
        if not runtime.capture_step or self.failed is not None:
            return self._uncaptured(inputs, None)
        key = self.key(inputs)
        entry = self.entries.get(key)
        if entry is None:
            return self._miss(key, inputs)
        try:
            self._bind(entry, inputs)
        except _Refused as why:
            self._refuse(str(why))
            return self._uncaptured(inputs, key)
        if runtime.verify:
            return self._verified_replay(entry, inputs)
        entry.graph.replay()
        entry.counts["replays"] += 1
        _TOTALS["replays"] += 1
        return self._results(entry, inputs)

    def _bind(self, entry: _Entry, inputs) -> None:
        """Bring every OWN static buffer up to date and check every ADDRESS one.

        Raises:
            BindingError: a persistent (strict) runner input moved.
            _Refused: the aliasing of this call's inputs cannot be kept by the captured graph.
        """
        synced = entry.synced
        for i, static, ptr, bind in entry.checks:
            value = inputs[i]
            if value is static:
                continue
            if bind == _ADDRESS:
                if value.data_ptr() == ptr and value.stride() == static.stride():
                    continue
                if self.runtime.session.produced(value):
                    raise _Refused(
                        f"input {self.specs[i].name!r} is bound to the caller's persistent "
                        "tensor, but this call hands it a value fxsplit produced"
                    )
                raise self._moved(i, value, ptr)
            mark = synced[i]
            if (
                mark is not None
                and mark[0]() is value
                and mark[1] == value._version
                and mark[2] == value.data_ptr()
            ):
                continue
            region = entry.regions.get(i)
            if region is None:
                static.copy_(value)
            elif value.stride() == static.stride():
                region.copy_(value.as_strided(region.shape, (1,), value.storage_offset()))
            else:
                raise _Refused(
                    f"input {self.specs[i].name!r} overlaps itself (e.g. expanded) and this "
                    "call's strides differ from the capture's"
                )
            synced[i] = self.runtime.session.sync_mark(value)
            counts = entry.counts
            counts["input_copies"] += 1
            counts["input_copy_bytes"] += value.nbytes
            _TOTALS["input_copies"] += 1
            _TOTALS["input_copy_bytes"] += value.nbytes
            self.stats.copies_by_input[self.specs[i].name] += 1
        if entry.alias_guard is not None:
            entry.alias_guard.check(self.specs, inputs)
        statics = entry.statics
        for view in entry.views:
            i = view[1]
            if inputs[i] is not statics[i] and inputs[i].stride() != statics[i].stride():
                raise _Refused(
                    f"an output is a view of input {self.specs[i].name!r}, whose strides differ "
                    "from the capture's, so the view cannot be rebuilt over it"
                )

    def _results(self, entry: _Entry, inputs):
        """After a replay: write back what the piece wrote, then rebuild views of inputs."""
        for i, static, bind in entry.written:
            value = inputs[i]
            if bind == _OWN and value is not static:
                value.copy_(static)
                entry.synced[i] = self.runtime.session.sync_mark(value)
            elif not static.is_inference():
                # A CUDA graph's writes bypass the version counter; keep it truthful.
                _increment_version(static)
        if not entry.views:
            return entry.outputs
        single = not isinstance(entry.outputs, tuple)
        outputs = [entry.outputs] if single else list(entry.outputs)
        for j, i, size, stride, offset, dtype, conj, neg in entry.views:
            value = inputs[i]
            if value is not entry.statics[i]:
                outputs[j] = _rebuild(value, size, stride, offset, dtype, conj, neg)
        return outputs[0] if single else tuple(outputs)

    def _uncaptured(self, inputs, key):
        self.stats.add(self.stats.key(key), "uncaptured_runs")
        return self.run_uncaptured(*inputs)

    def _refuse(self, why: str) -> None:
        if why not in self._refusals:
            self._refusals.add(why)
            log.info("fxsplit: %s runs uncaptured for this call: %s", self.name, why)

    def _miss(self, key, inputs):
        runtime = self.runtime
        done = self.warmups.get(key, 0)
        if done < self.min_warmups:
            self.warmups[key] = done + 1
            return self._uncaptured(inputs, key)
        if len(self.entries) >= runtime.max_captured_keys:
            runtime.warn_key_limit(self)
            return self._uncaptured(inputs, key)
        try:
            entry = self._capture(key, inputs)
        except BindingError:
            raise
        except _Refused as why:
            self._refuse(str(why))
            return self._uncaptured(inputs, key)
        except Exception as error:
            # A failed capture leaves nothing behind (see _capture). Running the piece uncaptured
            # tells a model error (it raises again, unchanged, and capture stays on for the next
            # input) from an op that cannot be captured (it runs).
            out = self._uncaptured(inputs, key)
            if runtime.on_capture_error == "raise":
                raise
            self.failed = f"{type(error).__name__}: {error}"
            log.warning("fxsplit: %s runs uncaptured from now on: %s", self.name, self.failed)
            return out
        self.entries[key] = entry
        self.stats.add(entry.counts, "captures")
        return self._results(entry, inputs)

    def _capture(self, key, inputs) -> _Entry:
        """Capture ``key``; the returned entry's outputs hold this call's result.

        Raises:
            _Refused: this call's inputs share storage in a way the static buffers cannot keep.
            CaptureError / RuntimeError: an op illegal under capture, or outputs that require
                grad. Nothing the piece writes is left changed by a failed capture.
        """
        runtime = self.runtime
        session = runtime.session
        binds, statics, regions = [], [], {}
        for spec, value in zip(self.specs, inputs, strict=True):
            if not isinstance(value, torch.Tensor):
                binds.append(Bind.HOST)
                statics.append(value)
                continue
            if spec.kind == binding.INTERNAL and id(value) in runtime.static_outputs:
                bind = _OWN  # an earlier captured piece's output buffer: fxsplit's already
            else:
                bind = binding.bind(spec, runtime.binding, session.produced(value))
            binds.append(bind)
            if bind == _OWN and id(value) not in runtime.static_outputs:
                static, region = _own_buffer(value)
                if region is not None:
                    regions[len(statics)] = region
                statics.append(static)
            else:
                statics.append(value)
        written = [i for i, spec in enumerate(self.specs) if spec.written]
        guard = _AliasGuard(inputs, binds, written) if written and _OWN in binds else None
        if guard is not None:
            guard.check(self.specs, inputs)
        graph = new_graph(runtime.mode, runtime.device_capture)
        # The emulator runs the piece while recording; if the capture then fails, the fallback
        # run must find what the piece writes as it was (a CUDA capture executes nothing).
        saved = (
            [
                (statics[i], statics[i].clone())
                for i in written
                if isinstance(statics[i], torch.Tensor)
            ]
            if runtime.mode == "emulate"
            else None
        )
        runtime.capture_session.collect_once()
        try:
            if saved is not None and self.check_uncompiled is not None:
                check = new_graph("emulate")
                check.capture(self.check_uncompiled, *statics)
                check.reset()
                for static, copy in saved:
                    static.copy_(copy)
            outputs = graph.capture(self.run_uncaptured, *statics)
            _refuse_grad(outputs)
        except BaseException:
            for static, copy in saved or ():
                static.copy_(copy)
            graph.reset()
            raise
        bases = self._output_bases(outputs, statics)
        views = self._views(outputs, statics, binds, bases)
        for out, base in zip(_flat(outputs), bases, strict=True):
            if isinstance(out, torch.Tensor) and base is None:
                # fxsplit's own memory: later pieces read it where it is (a view of a caller's
                # tensor or parameter is never bound that way: a copy into it would write there)
                runtime.static_outputs[id(out)] = out
                session.own(runtime, out)
        capture_ptrs = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else None for v in inputs)
        entry = _Entry(
            key, graph, statics, outputs, binds, views, self.stats.key(key), capture_ptrs
        )
        entry.written = tuple(
            (i, statics[i], binds[i]) for i in written if isinstance(statics[i], torch.Tensor)
        )
        entry.alias_guard = guard
        entry.regions = regions
        for i, bind in enumerate(binds):
            if bind == _OWN and inputs[i] is not statics[i]:
                entry.synced[i] = session.sync_mark(inputs[i])
        return entry

    def _output_bases(self, outputs, statics) -> list[int | None]:
        """Per output, the input whose static buffer it shares memory with at this capture key,
        else None: the analysis's answer where the memory confirms it, else the memory's (a view
        may be a copy at another size: ``reshape``, ``contiguous``)."""
        facts = self.aliasing.output_bases
        owners: dict[int, int] = {}
        for i, static in enumerate(statics):
            if isinstance(static, torch.Tensor) and static.numel():
                owners.setdefault(_storage(static), i)
        bases: list[int | None] = []
        for j, out in enumerate(_flat(outputs)):
            if not isinstance(out, torch.Tensor) or not out.numel():
                bases.append(None)
                continue
            ptr = _storage(out)
            fact = facts[j] if j < len(facts) else None
            if fact is not None and _storage(statics[fact]) == ptr:
                bases.append(fact)
            else:
                bases.append(owners.get(ptr))
        return bases

    def _views(self, outputs, statics, binds, bases) -> tuple:
        """``(j, i, size, stride, offset, dtype, conj, neg)`` per output that is a view of an
        OWN input ``i``: eagerly it aliases the caller's tensor, so each replay rebuilds it over
        that tensor (:func:`_rebuild`). ``offset`` counts elements of the output's dtype from
        the input's start; ``dtype`` is None where the view keeps the input's dtype."""
        views = []
        for j, (out, i) in enumerate(zip(_flat(outputs), bases, strict=True)):
            if i is None or binds[i] != _OWN or not isinstance(out, torch.Tensor):
                continue
            static = statics[i]
            start = out.storage_offset() * out.element_size()
            offset = (start - static.storage_offset() * static.element_size()) // out.element_size()
            dtype = None if out.dtype == static.dtype else out.dtype
            if dtype is not None and (static.is_conj() or static.is_neg()):
                raise RuntimeError(
                    f"{self.name}: an output views input {self.specs[i].name!r} (conjugate or "
                    "negative bit set) in another dtype; it cannot be rebuilt over the caller's "
                    "tensor"
                )
            shape, strides = tuple(out.shape), tuple(out.stride())
            views.append((j, i, shape, strides, offset, dtype, out.is_conj(), out.is_neg()))
        return tuple(views)

    def _moved(self, i: int, value, ptr: int) -> BindingError:
        spec = self.specs[i]
        return BindingError(
            f"{self.name} (regions: {', '.join(sorted(self.regions)) or '-'}): input "
            f"{spec.name!r} from {spec.source} is at 0x{value.data_ptr():x}, but the captured "
            f"graph reads 0x{ptr:x}; with input_binding='strict' a runner must hand the same "
            "tensor every step (use persistent buffers, or input_binding='copy')"
        )

    def _verified_replay(self, entry: _Entry, inputs):
        # Snapshots of every input, sharing memory as the inputs do: the uncaptured re-run must
        # read what the replay read, writes through aliases included.
        snapshots = clone_sharing(inputs)
        written = [i for i, spec in enumerate(self.specs) if spec.written]
        moved = [
            self.specs[i].name
            for i, ptr in enumerate(entry.capture_ptrs)
            if ptr is not None and inputs[i].data_ptr() != ptr
        ]
        if self.random and self.runtime.mode != "emulate":
            # A CUDA graph draws from its own RNG offsets: an uncaptured run cannot repeat them.
            if "verify-random" not in self._refusals:
                self._refusals.add("verify-random")
                log.info("fxsplit: verify skips %s: it draws random numbers", self.name)
            entry.graph.replay()
            self.stats.add(entry.counts, "replays")
            return self._results(entry, inputs)
        before = torch.get_rng_state()
        entry.graph.replay()
        self.stats.add(entry.counts, "replays")
        got = self._results(entry, inputs)
        after = torch.get_rng_state()
        torch.set_rng_state(before)  # the emulator replays on the CPU generator: draw the same
        try:
            expected = self.run_uncaptured(*snapshots)
        finally:
            torch.set_rng_state(after)
        pairs = list(zip(_flat(got), _flat(expected), strict=True))
        pairs += [(inputs[i], snapshots[i]) for i in written]
        for a, b in pairs:
            if isinstance(a, torch.Tensor) and not _same(a, b):
                raise VerifyError(
                    f"verify: replay of {self.name} (regions: "
                    f"{', '.join(sorted(self.regions)) or '-'}) differs from running it "
                    f"uncaptured; inputs whose address changed since capture: "
                    f"{', '.join(moved) or 'none'}"
                )
        return got


def _never_captured(specs: list[InputSpec], aliasing: PieceAliasing, devices) -> str | None:
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


def _own_buffer(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        buffer, region = _own_buffer(plain)
        return (buffer.conj() if value.is_conj() else torch._neg_view(buffer)), region
    pad = value.storage_offset() % 512
    extent = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride(), strict=True))
    extent = extent if value.numel() else 0
    flat = torch.empty(pad + extent, dtype=value.dtype, device=value.device)
    region = None
    with torch.no_grad():
        buffer = flat.as_strided(value.size(), value.stride(), pad)
        if _overlaps(value):
            region = flat[pad:]
            region.copy_(value.as_strided((extent,), (1,), value.storage_offset()))
        else:
            buffer.copy_(value)
    # A piece that enables grad must see what eager sees, so its capture can refuse.
    return buffer.requires_grad_(value.requires_grad), region


def _rebuild(value, size, stride, offset, dtype, conj, neg) -> torch.Tensor:
    """The view an output had of its input at capture, over the caller's tensor ``value``
    instead of fxsplit's copy: a real view (shared version counter), in the output's dtype,
    with its conjugate and negative bits."""
    base = value if dtype is None else value.view(dtype)
    if offset == 0 and size == base.shape and stride == base.stride():
        view = base
    else:
        view = base.as_strided(size, stride, base.storage_offset() + offset)
    if view.is_conj() != conj:
        view = view.conj()
    if view.is_neg() != neg:
        view = torch._neg_view(view)
    return view


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


class _AliasGuard:
    """Refuses a call whose inputs share storage where the static buffers could not keep it: an
    input bound to fxsplit's own copy (OWN) sharing storage with an input the piece writes (the
    copy would not see the write, or the write would not reach the caller's other view).

    Inputs bound by address keep their capture-time storage on every replay (a move raises,
    refuses or recaptures first), so the storages of the written ones are fixed here and each
    call looks up only the OWN inputs' storages; only a piece that writes an OWN input compares
    every pair.
    """

    __slots__ = ("fixed", "own", "wide")

    def __init__(self, inputs, binds, written: list[int]):
        self.own = tuple(i for i, b in enumerate(binds) if b == _OWN)
        self.wide = any(binds[i] == _OWN for i in written)
        self.fixed = {
            _storage(inputs[i]): i for i in written if binds[i] != _OWN and inputs[i].numel()
        }

    def check(self, specs, inputs) -> None:
        """Raises:
        _Refused: naming the two inputs that share storage."""
        if self.wide:
            seen: dict[int, int] = {}
            for i, value in enumerate(inputs):
                if isinstance(value, torch.Tensor) and value.numel():
                    j = seen.setdefault(_storage(value), i)
                    if j != i:
                        raise _Refused(_shared(specs, j, i))
            return
        fixed = self.fixed
        for i in self.own:
            value = inputs[i]
            if value.numel():  # empty tensors all report storage address 0
                j = fixed.get(_storage(value))
                if j is not None:
                    raise _Refused(_shared(specs, j, i))


def _storage(value: torch.Tensor) -> int:
    return value.untyped_storage().data_ptr()


def _shared(specs, j: int, i: int) -> str:
    return (
        f"inputs {specs[j].name!r} and {specs[i].name!r} share storage and the piece writes one "
        "of them; separate static buffers would not keep that aliasing"
    )


def _refuse_grad(outputs) -> None:
    for out in _flat(outputs):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            raise RuntimeError(
                "an output requires grad (grad is enabled inside the piece); a replay would "
                "return it with the capture step's grad_fn"
            )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal, NaN equal to NaN (verify compares a replay with a plain run)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or not (a.is_floating_point() or a.is_complex()):
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(
        a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    )


def _exact(value):
    """A capture-key part that tells apart what ``==`` does not: ``True`` / ``1`` / ``1.0`` (by
    type), ``0.0`` / ``-0.0`` (by their text), while NaN matches NaN (by its text).
    :func:`_key_function` inlines the same expression."""
    return (value.__class__, value if value == value and value != 0 else repr(value))


def _key_function(reads):
    """``inputs -> capture key``: every host value the piece reads (exactly, as
    :func:`_exact`) and each distinct dynamic size of its tensor inputs (see
    :func:`fxsplit.runtime.binding.key_reads`). Generated as one tuple expression because this
    runs on every call."""
    parts = [
        f"(a[{i}].__class__, a[{i}] if a[{i}] == a[{i}] and a[{i}] != 0 else repr(a[{i}]))"
        if d is None
        else f"a[{i}].shape"
        if d < 0
        else f"a[{i}].shape[{d}]"
        for i, d in reads
    ]
    return eval(f"lambda a: ({''.join(p + ', ' for p in parts)})")


def _flat(value):
    return value if isinstance(value, tuple) else (value,)


__all__ = ["BindingError", "CapturedPiece", "VerifyError", "binding"]
