"""A captured piece at run time: one graph per capture key, bound inputs, replay.

Hot path per call (:meth:`CapturedPiece.__call__`): build the key, look up its entry, keep the
pool's replay order (a graph captured before one already replayed in this step is recaptured
first, see :mod:`fxsplit.runtime.pool`), bind the inputs (:mod:`fxsplit.runtime.binding`: copy a
changed value into fxsplit's own buffer, refuse a moved persistent tensor), invalidate the handed
out outputs the replay may overwrite, replay, write back what the piece writes, and rebuild
outputs that are views of an input over the caller's tensor. Parameters are not looked at here:
the graph runtime checks them once per step. What the piece writes and aliases is read from its
:class:`~fxsplit.facts.aliasing.PieceAliasing`, computed once at split time.

With capture off and ``input_binding="strict"`` the same object only checks: the call that would
capture fixes the addresses of the persistent inputs, later calls of that key are checked as a
replay would be, and the piece runs uncaptured (so a runner bug fails on a CPU machine as on a
GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit import counters
from fxsplit.facts.aliasing import PieceAliasing
from fxsplit.runtime import binding
from fxsplit.runtime.binding import Bind, BindingError, InputSpec
from fxsplit.runtime.replay_watch import Watch
from fxsplit.runtime.stats import PieceStats, StaticAddress
from fxsplit.runtime.storage import clone_sharing, storage_ptr
from fxsplit.warn import FxsplitRuntimeWarning, warn_at_caller

_TOTALS = counters.totals
_OWN, _ADDRESS, _PINNED = Bind.OWN, Bind.ADDRESS, Bind.PINNED
_increment_version = torch.autograd.graph.increment_version

log = logging.getLogger("fxsplit")


class VerifyError(RuntimeError):
    """``verify=True`` found a replay whose result differs from running the piece uncaptured."""


class CaptureRefusedError(RuntimeError):
    """Under ``on_capture_error="raise"``: a piece would run uncaptured (the reason is the
    message: an input layout a captured graph cannot keep, a failed aliasing analysis, grad, the
    key limit)."""


class _Refused(Exception):
    """This call's inputs cannot be captured with their aliasing kept; run it uncaptured."""


class _OwnBuffer:
    """fxsplit's static buffer for one view of a caller's tensor, shared by every capture key
    and piece of a graph that captured that view (a KV cache handed in as a plain argument is
    held once), or an earlier captured piece's output read where it lies (``pooled``: memory
    of the pool, whose handed-out outputs a copy into it must invalidate first); ``mark``
    remembers the value last copied in (see
    :meth:`~fxsplit.runtime.graph_runtime.CaptureSession.sync_mark`), never for a ``rebound``
    parameter (see :class:`~fxsplit.runtime.binding.InputSpec`): that one is copied every call."""

    __slots__ = ("mark", "pooled", "rebound", "region", "source", "static")

    def __init__(self, static, region, source, pooled: bool = False):
        self.static = static
        self.region = region  # the flat memory under an overlapping (expanded) buffer
        self.source = source  # weak reference to the caller's storage it mirrors
        self.pooled = pooled
        self.rebound = False
        self.mark = None

    def remember(self, session, value: torch.Tensor) -> None:
        """``value`` was just copied in: remember it, unless it is a rebound parameter."""
        self.mark = None if self.rebound else session.sync_mark(value)


class _Entry:
    """One capture key of a piece: its graph, static buffers, binding table and counters.

    ``checks`` holds ``(i, static, data_ptr, bind, buffer)`` per input bound OWN, ADDRESS or
    PINNED; ``written`` holds ``(i, static, bind, buffer)`` per input the piece writes;
    ``views`` holds ``(j, i, size, stride, offset, dtype, conj, neg)`` per output that is a view
    of OWN input ``i`` (rebuilt over the caller's tensor after each replay); ``shared`` the pairs
    of OWN inputs bound to one shared buffer (the same caller view at capture); ``alias_guard``
    checks shared storage per call (pieces that write an input); ``order`` is the graph's
    capture order in the pool; ``owned`` the ids and data pointers of the outputs in fxsplit's
    memory.
    """

    __slots__ = (
        "alias_guard",
        "capture_ptrs",
        "checks",
        "counts",
        "graph",
        "key",
        "order",
        "outputs",
        "owned",
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
        self.views = views
        self.written: tuple = ()
        self.alias_guard: _AliasGuard | None = None
        self.order = -1
        self.owned: tuple = ()
        self.shared: tuple = ()  # (i, j): OWN inputs bound to one buffer (one tensor at capture)


class CapturedPiece(torch.nn.Module):
    """Stands in for a captured :class:`~fxsplit.passes.materialise.PieceModule` in the stitched
    module when capture is on (or strict binding is checked with capture off).

    Args:
        piece: the piece module (its ``forward`` is the uncaptured code).
        specs: one :class:`~fxsplit.runtime.binding.InputSpec` per input.
        key_reads: what the capture key reads (:func:`fxsplit.runtime.binding.key_reads`).
        aliasing: what the piece writes and aliases (:mod:`fxsplit.facts.aliasing`).
        plan_piece: the :class:`~fxsplit.plan.Piece` (regions for messages, devices).
        runtime: the :class:`~fxsplit.runtime.graph_runtime.GraphRuntime` that owns it.
        generators: the CUDA generators other than the default one its nodes draw from.
    """

    def __init__(
        self,
        piece,
        specs: list[InputSpec],
        key_reads,
        aliasing: PieceAliasing,
        plan_piece,
        runtime,
        generators: tuple = (),
    ):
        super().__init__()
        self.name = piece.name
        self.kind = piece.kind
        self.code = piece.code
        self.run_uncaptured = piece.forward
        # A compiled piece's kernels are invisible to the emulator: its capture legality is
        # checked on the piece's generated Python, run on fake tensors (nothing executes twice).
        self.check_uncompiled = getattr(piece.forward, "eager", None)
        # Triton compiles and autotunes a kernel on its first launch, which a CUDA capture
        # would record as a failure: a compiled piece runs once before it is captured (in the
        # emulator too, whose capture schedule must be CUDA's).
        compiled = self.check_uncompiled is not None
        self.min_warmups = max(runtime.warmup_runs, 1 if compiled else 0)
        self.specs = specs
        self.aliasing = aliasing
        self.output_names = piece.output_names
        self.num_outputs = len(piece.output_names)
        self.generators = generators
        self.regions = frozenset(plan_piece.regions)
        self.random = plan_piece.random
        # outputs whose values the piece leaves unspecified: verify has nothing to compare
        self.unset = frozenset(
            j for j, name in enumerate(piece.output_names) if name in plan_piece.unset
        )
        self.runtime = runtime
        # its outputs that eager pieces read, lent to them (fxsplit.runtime.lending)
        self.lent: tuple[int, ...] = ()
        self.entries: dict[tuple, _Entry] = {}
        self.warmups: dict[tuple, int] = {}
        self.failed: str | None = _never_captured(specs, aliasing, plan_piece.devices)
        self._warned: set[str] = set()
        if self.failed is not None:
            log.info("fxsplit: %s runs uncaptured: %s", self.name, self.failed)
        self.stats = PieceStats(Watch(self, key_reads))
        self.key = _key_function(key_reads)

    def __call__(self, *inputs):
        runtime = self.runtime
        if not runtime.capture_step:
            return self._uncaptured(inputs, None)
        if self.failed is not None:
            self._refuse(self.failed)
            return self._uncaptured(inputs, None)
        key = self.key(inputs)
        entry = self.entries.get(key)
        if entry is None:
            return self._miss(key, inputs)
        if runtime.checking:
            self._check(entry, inputs)
            return self._uncaptured(inputs, key)
        pool = runtime.pool
        if not pool.in_order(entry.order):
            return self._recapture(entry, inputs)
        try:
            self._bind(entry, inputs)
        except _Refused as why:
            self._refuse(str(why))
            return self._uncaptured(inputs, key)
        if runtime.verify:
            return self._verified_replay(entry, inputs)
        pool.before_replay(entry.order)
        entry.graph.replay()
        entry.counts["replays"] += 1
        _TOTALS["replays"] += 1
        return self._results(entry, inputs)

    def _bind(self, entry: _Entry, inputs) -> None:
        """Bring every OWN static buffer up to date and check every ADDRESS and PINNED one.

        Raises:
            BindingError: a persistent (strict) runner input moved.
            _Refused: the aliasing of this call's inputs cannot be kept by the captured graph.
        """
        for i, j in entry.shared:
            a, b = inputs[i], inputs[j]
            if a is not b and (a.data_ptr() != b.data_ptr() or a.stride() != b.stride()):
                raise _Refused(
                    f"inputs {self.specs[i].name!r} and {self.specs[j].name!r} were one tensor "
                    "at capture and share one static buffer, but this call hands two"
                )
        for i, static, ptr, bind, buffer in entry.checks:
            value = inputs[i]
            if value is static:
                continue
            if bind is not _OWN:
                if value.data_ptr() == ptr and value.stride() == static.stride():
                    continue
                raise self._moved(i, value, ptr, bind)
            mark = buffer.mark
            if (
                mark is not None
                and mark[0]() is value
                and mark[1] == value._version
                and mark[2] == value.data_ptr()
            ):
                continue
            region = buffer.region
            if buffer.pooled:  # the earlier piece ran uncaptured: refill its output's memory
                pool = self.runtime.pool
                pool.ledger.before_copy(storage_ptr(static), pool.step)
            if region is None:
                static.copy_(value)
            elif value.stride() == static.stride():
                region.copy_(value.as_strided(region.shape, (1,), value.storage_offset()))
            else:
                raise _Refused(
                    f"input {self.specs[i].name!r} overlaps itself (e.g. expanded) and this "
                    "call's strides differ from the capture's"
                )
            buffer.remember(self.runtime.session, value)
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

    def _check(self, entry: _Entry, inputs) -> None:
        """Check the persistent (ADDRESS) inputs as a replay would bind them (with capture off,
        and before a recapture rebinds them).

        Raises:
            BindingError: a persistent (strict) runner input moved.
        """
        for i, _, ptr, bind, _ in entry.checks:
            value = inputs[i]
            if bind is _ADDRESS and value.data_ptr() != ptr:
                error = self._moved(i, value, ptr, bind)
                if isinstance(error, BindingError):
                    raise error

    def _results(self, entry: _Entry, inputs):
        """After a replay: write back what the piece wrote, then rebuild views of inputs."""
        session = self.runtime.session
        for i, static, bind, buffer in entry.written:
            value = inputs[i]
            if bind is _OWN and value is not static:
                value.copy_(static)
                buffer.remember(session, value)
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
        """A call runs uncaptured for ``why``: counted per reason; raised under
        ``on_capture_error="raise"``, else warned once per reason.

        Raises:
            CaptureRefusedError: under ``on_capture_error="raise"``.
        """
        self.stats.refusals[why] += 1
        if self.runtime.checking:  # capture off: nothing was going to be captured
            return
        if self.runtime.on_capture_error == "raise":
            raise CaptureRefusedError(
                f"fxsplit {self.runtime.graph_id}: {self.name} cannot be captured: {why} "
                "(on_capture_error='raise'; 'fallback' runs it uncaptured)"
            )
        if why not in self._warned:
            self._warned.add(why)
            warn_at_caller(
                f"fxsplit {self.runtime.graph_id}: {self.name} runs uncaptured: {why}",
                FxsplitRuntimeWarning,
            )

    def _miss(self, key, inputs):
        runtime = self.runtime
        done = self.warmups.get(key, 0)
        before = torch._C._dynamo.guards.GlobalStateGuard()
        if done < self.min_warmups:
            # not a warm-up: a precompiled graph's piece running its Python before its artifact
            # loads (asked before the call: another thread may load it meanwhile)
            ready = getattr(self.run_uncaptured, "ready", True)
            out = self._uncaptured(inputs, key)
            if ready:
                self.warmups[key] = done + 1
            self._check_global_state(before)
            return out
        if len(self.entries) >= runtime.max_captured_keys:
            self._refuse(
                f"max_captured_keys={runtime.max_captured_keys} reached; further keys run "
                "uncaptured"
            )
            return self._uncaptured(inputs, key)
        if runtime.checking:
            self.entries[key] = self._fix_addresses(key, inputs)
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
            # input) from an op that cannot be captured (it runs). Capture rejects ops with a
            # RuntimeError (CaptureError, CUDA's errors); anything else that the plain run does
            # not raise again is fxsplit's own fault, and is never hidden as a refusal.
            out = self._uncaptured(inputs, key)
            if runtime.on_capture_error == "raise" or not isinstance(error, RuntimeError):
                raise
            self.failed = f"{type(error).__name__}: {error}"
            self._refuse(self.failed)
            return out
        self.entries[key] = entry
        if self.lent:
            owned = {ident for ident, _ in entry.owned}
            outputs = _flat(entry.outputs)
            lent = [outputs[j] for j in self.lent if id(outputs[j]) in owned]
            runtime.pool.ledger.loans.lend(lent, entry.order, runtime.graph_id, self.name)
        self.stats.add(entry.counts, "captures")
        self._check_global_state(before)
        return self._results(entry, inputs)

    def _check_global_state(self, before) -> None:
        """Never capture a piece whose run changed the global state Dynamo guards on
        (``torch.set_default_dtype`` called once, restored in a later graph): a replay runs
        none of its Python, so the state would stay as it was for everything after it."""
        if not before.check():
            reason = before.reason() if hasattr(before, "reason") else "global state"
            self.failed = f"it changes global state ({reason.strip()}) that a replay would not"

    def _recapture(self, entry: _Entry, inputs):
        """Replace ``entry``'s graph by a new capture: it was captured before a graph already
        replayed in this step, so its replay could overwrite that graph's live outputs (see
        :mod:`fxsplit.runtime.pool`)."""
        self._check(entry, inputs)  # a persistent input that moved is the runner's bug
        log.info(
            "fxsplit %s: %s recaptured for key %s so that replays keep capture order",
            self.runtime.graph_id,
            self.name,
            entry.key,
        )
        self.drop(entry)
        del self.entries[entry.key]
        self.stats.add(entry.counts, "reorders")
        return self._miss(entry.key, inputs)

    def drop(self, entry: _Entry) -> None:
        """Free ``entry``'s graph; outputs of it that were handed out and are still held move to
        memory of their own (invalidated on torch 2.11)."""
        runtime = self.runtime
        for ident, ptr in entry.owned:
            runtime.static_outputs.pop(ident, None)
            runtime.pool.owners.pop(ptr, None)
        runtime.pool.ledger.release_order(entry.order, runtime.pool.step)
        entry.graph.reset()

    def _fix_addresses(self, key, inputs) -> _Entry:
        """Capture off, strict binding: the entry that fixes the persistent inputs' addresses
        (what a capture would bind), with no graph."""
        runtime = self.runtime
        produced = runtime.session.produced
        checks = []
        for i, (spec, value) in enumerate(zip(self.specs, inputs, strict=True)):
            if not isinstance(value, torch.Tensor):
                continue
            if spec.kind == binding.RUNNER and runtime.is_frozen_memory(value):
                continue  # a view of a parameter or buffer: bound by address, never an error
            if binding.bind(spec, "strict", produced(value)) is _ADDRESS:
                checks.append((i, value, value.data_ptr(), _ADDRESS, None))
        return _Entry(key, None, (), None, tuple(checks), (), self.stats.key(key), ())

    def _capture(self, key, inputs) -> _Entry:
        """Capture ``key``; the returned entry's outputs hold this call's result.

        Raises:
            _Refused: this call's inputs share storage in a way the static buffers cannot keep,
                or a compiled piece's legality could not be checked.
            CaptureError / RuntimeError: an op illegal under capture, or outputs that require
                grad. Nothing the piece writes is left changed by a failed capture.
        """
        runtime = self.runtime
        if self.aliasing.deferred:
            self._analyse(inputs)
        session = runtime.session
        pool = runtime.pool
        binds, statics, buffers = [], [], []
        for spec, value in zip(self.specs, inputs, strict=True):
            buffer = None
            if not isinstance(value, torch.Tensor):
                bind = Bind.HOST
            elif spec.kind == binding.INTERNAL and id(value) in runtime.static_outputs:
                bind = _OWN  # an earlier captured piece's output: fxsplit's memory already
                buffer = _OwnBuffer(value, None, None, pooled=True)
            elif spec.kind == binding.RUNNER and runtime.is_frozen_memory(value):
                bind = _PINNED  # a view of a parameter or buffer: its memory never moves
            else:
                bind = binding.bind(spec, runtime.binding, session.produced(value))
                if bind is _OWN:
                    buffer = runtime.own_buffer(value, spec.rebound)
            binds.append(bind)
            buffers.append(buffer)
            statics.append(buffer.static if buffer is not None else value)
        written = [i for i, spec in enumerate(self.specs) if spec.written]
        guard = _AliasGuard(statics, inputs, binds, written) if written else None
        if guard is not None:
            guard.check(self.specs, inputs)
        for i, buffer in enumerate(buffers):
            if buffer is not None and buffer.static is not inputs[i] and buffer.mark is None:
                buffer.remember(session, inputs[i])
        graph = pool.new_graph(self.generators)
        # The emulator runs the piece while recording; if the capture then fails, the fallback
        # run must find what the piece writes as it was (a CUDA capture executes nothing).
        emulated = runtime.mode == "emulate"
        saved = (
            [
                (statics[i], statics[i].clone())
                for i in written
                if isinstance(statics[i], torch.Tensor)
            ]
            if emulated
            else None
        )
        # an opaque op (no tag says it draws) may draw random numbers before the capture fails
        rng = torch.get_rng_state() if emulated else None
        session.collect_once()
        try:
            run = self.run_uncaptured
            if emulated and self.check_uncompiled is not None:
                _check_legality(graph, self.check_uncompiled, statics)
                # Inductor's CPU kernels bypass the dispatcher: record the piece as one unit
                run = functools.partial(_opaque, self.run_uncaptured)
            outputs = graph.capture(run, *statics)
            _refuse_grad(outputs)
        except BaseException:
            for static, copy in saved or ():
                static.copy_(copy)
            if rng is not None:  # the fallback run draws what eager draws
                torch.set_rng_state(rng)
            graph.reset()
            raise
        order = pool.next_order()
        bases = self._output_bases(outputs, statics)
        views = self._views(outputs, statics, binds, bases)
        owned = []
        inputs_memory = {storage_ptr(v) for v in statics if isinstance(v, torch.Tensor)}
        for out, base in zip(_flat(outputs), bases, strict=True):
            if (
                isinstance(out, torch.Tensor)
                and base is None
                and out.untyped_storage().nbytes()
                # an empty view of an input has no base but is no memory of fxsplit's
                and storage_ptr(out) not in inputs_memory
            ):
                # fxsplit's own memory: later pieces read it where it is (a view of a caller's
                # tensor or parameter is never bound that way: a copy into it would write there)
                runtime.static_outputs[id(out)] = out
                ptr = storage_ptr(out)
                pool.owners[ptr] = order
                owned.append((id(out), ptr))
        checks = tuple(
            (i, statics[i], statics[i].data_ptr(), bind, buffers[i])
            for i, bind in enumerate(binds)
            if bind in (_OWN, _ADDRESS, _PINNED)
        )
        capture_ptrs = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else None for v in inputs)
        entry = _Entry(
            key, graph, statics, outputs, checks, views, self.stats.key(key), capture_ptrs
        )
        entry.order = order
        entry.owned = tuple(owned)
        entry.written = tuple(
            (i, statics[i], binds[i], buffers[i])
            for i in written
            if isinstance(statics[i], torch.Tensor)
        )
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

    def _analyse(self, inputs) -> None:
        """The aliasing analysis deferred to the first capture (data-dependent input sizes), on
        this call's inputs; a piece it cannot run on is never captured.

        Raises:
            _Refused: the analysis failed (the piece runs uncaptured from now on).
        """
        from fxsplit.facts import aliasing

        python = self.check_uncompiled or self.run_uncaptured
        facts = aliasing.analyse(python, list(inputs), self.num_outputs)
        self.aliasing = facts
        self.specs = [
            dataclasses.replace(spec, written=i in facts.written)
            for i, spec in enumerate(self.specs)
        ]
        self.failed = _never_captured(self.specs, facts, ())
        if self.failed is not None:
            raise _Refused(self.failed)

    def _output_bases(self, outputs, statics) -> list[int | None]:
        """Per output, the input whose static buffer it shares memory with at this capture key,
        else None: the analysis's answer where the memory confirms it, else the memory's (a view
        may be a copy at another size: ``reshape``, ``contiguous``)."""
        facts = self.aliasing.output_bases
        owners: dict[int, int] = {}
        for i, static in enumerate(statics):
            if isinstance(static, torch.Tensor) and static.numel():
                owners.setdefault(storage_ptr(static), i)
        bases: list[int | None] = []
        for j, out in enumerate(_flat(outputs)):
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

    def _moved(self, i: int, value, ptr: int, bind) -> Exception:
        """The error for an ADDRESS or PINNED input that moved: a refusal where the value is
        fxsplit's own memory or a moved view of a parameter, else :class:`BindingError`."""
        spec = self.specs[i]
        if bind is _PINNED:
            return _Refused(
                f"input {spec.name!r} is a view of a parameter or buffer, bound by address at "
                "capture, and this call hands another view"
            )
        if self.runtime.session.produced(value):
            return _Refused(
                f"input {spec.name!r} is bound to the caller's persistent tensor, but this call "
                "hands it a value fxsplit produced"
            )
        return binding.moved_error(
            f"{self.name} (regions: {', '.join(sorted(self.regions)) or '-'})",
            spec.name,
            spec.source,
            value.data_ptr(),
            ptr,
            "the captured graph reads",
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
        pool = self.runtime.pool
        pool.before_replay(entry.order)
        if self.random and self.runtime.mode != "emulate":
            # A CUDA graph draws from its own RNG offsets: an uncaptured run cannot repeat them.
            if "verify-random" not in self._warned:
                self._warned.add("verify-random")
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
        pairs = [
            pair
            for j, pair in enumerate(zip(_flat(got), _flat(expected), strict=True))
            if j not in self.unset
        ]
        pairs += [(inputs[i], snapshots[i]) for i in written]
        exact = self.runtime.mode == "emulate"
        how = "" if exact else " beyond torch.testing.assert_close's tolerances"
        for a, b in pairs:
            if isinstance(a, torch.Tensor) and not _same(a, b, exact):
                raise VerifyError(
                    f"verify: replay of {self.name} (regions: "
                    f"{', '.join(sorted(self.regions)) or '-'}) differs from running it "
                    f"uncaptured{how}; inputs whose address changed since capture: "
                    f"{', '.join(moved) or 'none'}"
                )
        return got


def _opaque(fn, *args):
    from fxsplit.runtime.emulator import call_opaque

    return call_opaque(fn, args)


def _check_legality(graph, fn, statics) -> None:
    """Run ``fn`` (a compiled piece's generated Python) on fake copies of ``statics`` under the
    emulator's capture checks: what CUDA capture would reject raises, and nothing runs for real
    (no random number drawn, no collective issued, no input written).

    Raises:
        CaptureError: an op illegal under capture.
        _Refused: the check itself could not run on fake tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxsplit.runtime.emulator import CaptureError

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in statics]
            graph.check(fn, *fakes)
    except CaptureError:
        raise
    except Exception as error:
        raise _Refused(
            f"its capture legality could not be checked on fake tensors ({type(error).__name__}:"
            f" {error})"
        ) from error


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


def buffer_key(value: torch.Tensor) -> tuple:
    """What makes two caller tensors the same view for :class:`_OwnBuffer` sharing: the storage
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


def new_own_buffer(value: torch.Tensor) -> _OwnBuffer:
    """A :class:`_OwnBuffer` mirroring ``value``."""
    static, region = own_buffer(value)
    return _OwnBuffer(static, region, StorageWeakRef(value.untyped_storage()))


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
        _Refused: naming the two inputs that share storage."""
        if self.wide:
            written = self.written
            seen: dict[int, int] = {}
            for i, value in enumerate(inputs):
                if isinstance(value, torch.Tensor) and value.numel():
                    j = seen.setdefault(storage_ptr(value), i)
                    # two inputs only read may share storage: their copies keep the values
                    if j != i and (i in written or j in written) and (j, i) not in self.paired:
                        raise _Refused(_shared(specs, j, i))
            return
        fixed = self.fixed
        for i in self.own:
            value = inputs[i]
            if value.numel():  # empty tensors all report storage address 0
                j = fixed.get(storage_ptr(value))
                if j is not None and (j, i) not in self.paired:
                    raise _Refused(_shared(specs, j, i))


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


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Equal: bit for bit with NaN equal to NaN where ``exact`` (the emulator replays the same
    kernels), else within ``torch.testing.assert_close``'s default tolerances for the dtype (a
    CUDA graph may launch other cuBLAS algorithms or workspaces than an uncaptured run)."""
    if not exact:
        try:
            torch.testing.assert_close(a, b, equal_nan=True)
        except AssertionError:
            return False
        return True
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or not (a.is_floating_point() or a.is_complex()):
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(
        a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    )


def _key_function(reads):
    """``inputs -> capture key``: every host value the piece reads, told apart exactly (by type:
    ``True`` / ``1`` / ``1.0``; by text: ``0.0`` / ``-0.0``, while NaN matches NaN), and each
    distinct dynamic size of its tensor inputs (see :func:`fxsplit.runtime.binding.key_reads`).
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


def _flat(value):
    return value if isinstance(value, tuple) else (value,)


__all__ = ["BindingError", "CaptureRefusedError", "CapturedPiece", "VerifyError", "binding"]
