"""A captured piece at run time: one graph per capture key, bound inputs, replay.

Hot path per call (:meth:`CapturedPiece.__call__`): build the key, look up its entry, keep the
pool's replay order (a graph captured before one already replayed in this step is recaptured
first, see :mod:`fxsplit.runtime.memory.pool`), bind the inputs
(:mod:`fxsplit.runtime.inputs.binding`: copy a
changed value into fxsplit's own buffer, refuse a moved persistent tensor), invalidate the handed
out outputs the replay may overwrite, replay, write back what the piece writes, and rebuild
outputs that are views of an input over the caller's tensor. Parameters are not looked at here:
the graph runtime checks them once per step. What the piece writes and aliases is read from its
:class:`~fxsplit.facts.aliasing.PieceAliasing`, computed once at split time.

With capture off and ``input_binding="strict"``,
:class:`~fxsplit.runtime.piece.checked.CheckedPiece`
stands in instead: it checks what a capture would bind and never captures.
"""

from __future__ import annotations

import logging

import torch

from fxsplit import counters
from fxsplit.facts.aliasing import PieceAliasing
from fxsplit.runtime.inputs import binding
from fxsplit.runtime.inputs.binding import Bind, BindingError, InputSpec, Refused
from fxsplit.runtime.memory import provenance
from fxsplit.runtime.memory.storage import storage_ptr
from fxsplit.runtime.piece.capture import NO_KERNEL, NoKernel, capture, never_captured
from fxsplit.runtime.piece.entry import Entry, bound_function, flat, key_function, rebuild
from fxsplit.runtime.piece.replay_watch import Watch
from fxsplit.runtime.piece.stats import PieceStats, Repeat
from fxsplit.runtime.piece.verify import verified_replay
from fxsplit.warn import FxsplitRuntimeWarning, warn_at_caller

_TOTALS = counters.totals
_OWN, _ADDRESS, _PINNED = Bind.OWN, Bind.ADDRESS, Bind.PINNED
_increment_version = torch._C._increment_version  # a sequence of tensors

log = logging.getLogger("fxsplit")


class CaptureRefusedError(RuntimeError):
    """Under ``on_capture_error="raise"``: a piece would run uncaptured (the reason is the
    message: an input layout a captured graph cannot keep, a failed aliasing analysis, grad, the
    key limit)."""


class CapturedPiece(torch.nn.Module):
    """Stands in for a captured :class:`~fxsplit.passes.materialise.PieceModule` in the stitched
    module when capture is on.

    Args:
        piece: the piece module (its ``forward`` is the uncaptured code).
        specs: one :class:`~fxsplit.runtime.inputs.binding.InputSpec` per input.
        key_reads: what the capture key reads (:func:`fxsplit.runtime.inputs.binding.key_reads`).
        aliasing: what the piece writes and aliases (:mod:`fxsplit.facts.aliasing`).
        plan_piece: the :class:`~fxsplit.plan.Piece` (regions for messages, devices).
        context: its graph's :class:`~fxsplit.runtime.step.context.GraphContext`.
        generators: the CUDA generators other than the default one its nodes draw from.
    """

    def __init__(
        self,
        piece,
        specs: list[InputSpec],
        key_reads,
        aliasing: PieceAliasing,
        plan_piece,
        context,
        generators: tuple = (),
        after_eager: bool = False,
    ):
        super().__init__()
        self.name = piece.name
        self.kind = piece.kind
        self.code = piece.code
        self.run_uncaptured = piece.forward
        # what its uncaptured runs call: lent what an op may keep, where the runtime lends
        self.run_eagerly = piece.forward
        # A compiled piece's kernels are invisible to the emulator: its capture legality is
        # checked on the piece's generated Python, run on fake tensors (nothing executes twice).
        self.check_uncompiled = getattr(piece.forward, "eager", None)
        # Triton compiles and autotunes a kernel on its first launch, which a CUDA capture
        # would record as a failure: a compiled piece runs once before it is captured (in the
        # emulator too, whose capture schedule must be CUDA's).
        compiled = self.check_uncompiled is not None
        self.min_warmups = max(context.warmup_runs, 1 if compiled else 0)
        self.specs = specs
        self.writes = any(spec.written for spec in specs)
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
        self.context = context
        # an eager piece that may write runs just before it, maybe where a caller's tensor's
        # version counter does not see it: what fxsplit copied of those tensors is stale
        self.after_eager = after_eager
        # graph arguments the eager pieces just before it write with torch's ops: what fxsplit
        # copied of their memory is stale (another tensor over it has a counter of its own)
        self.written_before: tuple[int, ...] = ()
        # its outputs that eager pieces read, lent to them (fxsplit.runtime.memory.lending)
        self.lent: tuple[int, ...] = ()
        self.entries: dict[tuple, Entry] = {}
        self.warmups: dict[tuple, int] = {}
        self.failed: str | None = never_captured(specs, aliasing, plan_piece.devices)
        self.warned: set[str] = set()
        if self.failed is not None:
            log.info("fxsplit: %s runs uncaptured: %s", self.name, self.failed)
        self.stats = PieceStats(Watch(self, key_reads))
        self.key = key_function(key_reads)

    def __call__(self, *inputs):
        context = self.context
        if self.after_eager:
            context.epoch += 1
        elif self.written_before:
            context.buffers.forget_eager_written()
        if not context.capture_step:
            return self._uncaptured(inputs, None)
        if self.failed is not None:
            if self.failed is NO_KERNEL:  # nothing to replay: its Python, counted nowhere
                out = self.run_eagerly(*inputs)
                if self.writes:  # a write of no element at the capture key may write at another
                    context.epoch += 1
                return out
            self._refuse(self.failed)
            return self._uncaptured(inputs, None)
        key = self.key(inputs)
        if context.repeat:
            key = Repeat(context.repeat, key)
        entry = self.entries.get(key)
        if entry is None:
            return self._miss(key, inputs)
        pool = context.pool
        if not pool.in_order(entry.order):
            return self._recapture(entry, inputs)
        try:
            self._bind(entry, inputs)
        except Refused as why:
            self._refuse(str(why))
            return self._uncaptured(inputs, key)
        if context.verify:
            return verified_replay(self, entry, inputs)
        pool.before_replay(entry.order)
        entry.graph.replay()
        entry.counts["replays"] += 1
        _TOTALS["replays"] += 1
        return self.results(entry, inputs)

    def _bind(self, entry: Entry, inputs) -> None:
        """Bring every OWN static buffer up to date and check every ADDRESS and PINNED one.

        Raises:
            BindingError: a persistent (strict) runner input moved.
            Refused: the aliasing of this call's inputs cannot be kept by the captured graph.
        """
        for i, j in entry.shared:
            a, b = inputs[i], inputs[j]
            if a is not b and (a.data_ptr() != b.data_ptr() or a.stride() != b.stride()):
                raise Refused(
                    f"inputs {self.specs[i].name!r} and {self.specs[j].name!r} were one tensor "
                    "at capture and share one static buffer, but this call hands two"
                )
        bound = entry.bound
        if bound is not None and not bound(inputs):
            raise self._unbound(entry, inputs)
        epoch = self.context.epoch
        for i, static, _, _, buffer in entry.owns:
            value = inputs[i]
            if value is static or buffer.holds(value, epoch):
                continue
            region = buffer.region
            if buffer.pooled:  # the earlier piece ran uncaptured: refill its output's memory
                pool = self.context.pool
                pool.ledger.before_copy(storage_ptr(static))
            if region is None:
                static.copy_(value)
            elif value.stride() == static.stride():
                region.copy_(value.as_strided(region.shape, (1,), value.storage_offset()))
            else:
                raise Refused(
                    f"input {self.specs[i].name!r} overlaps itself (e.g. expanded) and this "
                    "call's strides differ from the capture's"
                )
            buffer.remember(value, epoch)
            nbytes = value.nbytes
            counts = entry.counts
            counts["input_copies"] += 1
            counts["input_copy_bytes"] += nbytes
            _TOTALS["input_copies"] += 1
            _TOTALS["input_copy_bytes"] += nbytes
            self.stats.copies_by_input[self.specs[i].name] += 1
        if entry.alias_guard is not None:
            entry.alias_guard.check(self.specs, inputs)
        statics = entry.statics
        for view in entry.views:
            i = view.input
            if inputs[i] is not statics[i] and inputs[i].stride() != statics[i].stride():
                raise Refused(
                    f"an output is a view of input {self.specs[i].name!r}, whose strides differ "
                    "from the capture's, so the view cannot be rebuilt over it"
                )

    def _unbound(self, entry: Entry, inputs) -> Exception:
        """The error for the first ADDRESS or PINNED input ``entry.bound`` found moved."""
        for check in entry.checks:
            if check.bind is not _OWN and not bound_function((check,))(inputs):
                return self._moved(check.index, inputs[check.index], check.ptr, check.bind)
        raise AssertionError("entry.bound disagrees with its checks")

    def _check(self, entry: Entry, inputs) -> None:
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

    def results(self, entry: Entry, inputs):
        """After a replay: write back what the piece wrote, then rebuild views of inputs."""
        for i, static, buffer in entry.written:
            value = inputs[i]
            if value is not static:
                value.copy_(static)
                self.context.buffers.forget_over(value)
                buffer.remember(value, self.context.epoch)
            else:
                _increment_version((static,))
        if entry.bumped:
            # A CUDA graph's writes bypass the version counter; keep it truthful (inference
            # tensors, which have none, are skipped). No copy of that memory through another
            # tensor is remembered (WrittenMemory), so there is nothing to forget.
            _increment_version(entry.bumped)
        if not entry.views:
            return entry.outputs
        single = not isinstance(entry.outputs, tuple)
        outputs = [entry.outputs] if single else list(entry.outputs)
        for j, i, size, stride, offset, dtype, conj, neg, itself, fresh in entry.views:
            value = inputs[i]
            if fresh or value is not entry.statics[i]:
                outputs[j] = rebuild(value, size, stride, offset, dtype, conj, neg, itself)
        return outputs[0] if single else tuple(outputs)

    def _uncaptured(self, inputs, key):
        self.stats.add(self.stats.key(key), "uncaptured_runs")
        try:
            return self.run_eagerly(*inputs)
        finally:  # it ran on the caller's tensors, and may have written them
            self.context.epoch += 1

    def _refuse(self, why: str) -> None:
        """A call runs uncaptured for ``why``: counted per reason; raised under
        ``on_capture_error="raise"``, else warned once per reason.

        Raises:
            CaptureRefusedError: under ``on_capture_error="raise"``.
        """
        self.stats.refusals[why] += 1
        if self.context.on_capture_error == "raise":
            raise CaptureRefusedError(
                f"fxsplit {self.context.graph_id}: {self.name} cannot be captured: {why} "
                "(on_capture_error='raise'; 'fallback' runs it uncaptured)"
            )
        if why not in self.warned:
            self.warned.add(why)
            warn_at_caller(
                f"fxsplit {self.context.graph_id}: {self.name} runs uncaptured: {why}",
                FxsplitRuntimeWarning,
            )

    def _miss(self, key, inputs):
        context = self.context
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
        if len(self.entries) >= context.max_captured_keys:
            why = (
                f"max_captured_keys={context.max_captured_keys} reached; further keys run "
                "uncaptured"
            )
            if type(key) is Repeat:
                why += (
                    f" (call {key.call + 1} of this graph in one step, inside another graph's "
                    "call, has graphs of its own)"
                )
            self._refuse(why)
            return self._uncaptured(inputs, key)
        return self._first(key, inputs, before)

    def _first(self, key, inputs, before):
        """The first call of ``key`` past its warm-ups: capture its graph and return what the
        capture computed (``before``: the global state before the call)."""
        context = self.context
        try:
            entry = capture(self, key, inputs)
        except BindingError:
            raise
        except Refused as why:
            self._refuse(str(why))
            return self._uncaptured(inputs, key)
        except NoKernel:
            self.failed = NO_KERNEL
            log.info("fxsplit %s: %s %s", context.graph_id, self.name, NO_KERNEL)
            return self._uncaptured(inputs, key)
        except Exception as error:
            # A failed capture leaves nothing behind (see _capture). Running the piece uncaptured
            # tells a model error (it raises again, unchanged, and capture stays on for the next
            # input) from an op that cannot be captured (it runs). Capture rejects ops with a
            # RuntimeError (CaptureError, CUDA's errors); anything else that the plain run does
            # not raise again is fxsplit's own fault, and is never hidden as a refusal.
            out = self._uncaptured(inputs, key)
            if context.on_capture_error == "raise" or not isinstance(error, RuntimeError):
                raise
            self.failed = f"{type(error).__name__}: {error}"
            self._refuse(self.failed)
            return out
        self.entries[key] = entry
        if self.lent:
            # its own outputs and views of earlier pieces' (in the pool all the same)
            owners, outputs = context.pool.owners, flat(entry.outputs)
            lent = [
                outputs[j]
                for j in self.lent
                if isinstance(outputs[j], torch.Tensor) and storage_ptr(outputs[j]) in owners
            ]
            context.pool.ledger.loans.lend(lent, entry.order, context.graph_id, self.name)
        self.stats.add(entry.counts, "captures")
        self._check_global_state(before)
        return self.results(entry, inputs)

    def _check_global_state(self, before) -> None:
        """Never capture a piece whose run changed the global state Dynamo guards on
        (``torch.set_default_dtype`` called once, restored in a later graph): a replay runs
        none of its Python, so the state would stay as it was for everything after it."""
        if not before.check():
            reason = before.reason() if hasattr(before, "reason") else "global state"
            self.failed = f"it changes global state ({reason.strip()}) that a replay would not"

    def _recapture(self, entry: Entry, inputs):
        """Replace ``entry``'s graph by a new capture: it was captured before a graph already
        replayed in this step, so its replay could overwrite that graph's live outputs (see
        :mod:`fxsplit.runtime.memory.pool`)."""
        self._check(entry, inputs)  # a persistent input that moved is the runner's bug
        log.info(
            "fxsplit %s: %s recaptured for key %s so that replays keep capture order",
            self.context.graph_id,
            self.name,
            entry.key,
        )
        self.drop(entry)
        del self.entries[entry.key]
        self.stats.add(entry.counts, "reorders")
        self.stats.watch.reordered()
        return self._miss(entry.key, inputs)

    def drop(self, entry: Entry) -> None:
        """Free ``entry``'s graph; outputs of it that were handed out and are still held move to
        memory of their own (invalidated on torch 2.11)."""
        context = self.context
        context.buffers.written.remove(entry.bumped_spans)
        for ident, ptr in entry.owned:
            context.static_outputs.pop(ident, None)
            context.pool.owners.pop(ptr, None)
        context.pool.ledger.release_order(entry.order)
        entry.graph.reset()

    def _moved(self, i: int, value, ptr: int, bind) -> Exception:
        """The error for an ADDRESS or PINNED input that moved: a refusal where the value is
        fxsplit's own memory or a moved view of a parameter, else :class:`BindingError`."""
        spec = self.specs[i]
        if bind is _PINNED:
            return Refused(
                f"input {spec.name!r} is a view of a parameter or buffer, bound by address at "
                "capture, and this call hands another view"
            )
        if provenance.RECORD.produced(value):
            return Refused(
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


__all__ = ["BindingError", "CaptureRefusedError", "CapturedPiece", "binding"]
