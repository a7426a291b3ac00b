"""Run time of one compiled graph with capture on: per-step checks around the stitched module.

Per step (:meth:`GraphRuntime.__call__`): decide whether this step may capture/replay (capture
sizes, grad mode), check parameter addresses once (a move invalidates every captured graph of
this graph and recaptures), then run the stitched module, whose captured pieces are
:class:`~fxsplit.runtime.piece.captured.CapturedPiece` objects.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from fxsplit import counters
from fxsplit.config import Config
from fxsplit.facts import keeping, op_facts
from fxsplit.facts.aliasing import PieceAliasing
from fxsplit.facts.inputs import is_static_argument
from fxsplit.runtime.inputs import binding
from fxsplit.runtime.inputs.static_inputs import FIRST, REBOUND, SAME, SETTLED, StaticInputs
from fxsplit.runtime.memory import lending, provenance
from fxsplit.runtime.memory.hand_out import hand_back, hand_out, take_over, with_copies
from fxsplit.runtime.memory.pool import MemoryPool
from fxsplit.runtime.piece.captured import CapturedPiece, CaptureRefusedError
from fxsplit.runtime.piece.checked import CheckedPiece
from fxsplit.runtime.step.context import GraphContext
from fxsplit.runtime.step.session import CaptureSession
from fxsplit.size_input import size_input_index
from fxsplit.warn import warn_at_caller

if TYPE_CHECKING:
    from fxsplit.frame import Frame
    from fxsplit.split_result import Split

log = logging.getLogger("fxsplit")

_GRAD = "grad is enabled and an input requires grad"
# torch's message for a resize_ of a storage over memory it does not own (a pool's)
_NOT_RESIZABLE = "Trying to resize storage that is not resizable"


class GraphRuntime:
    """The callable Dynamo runs for one graph when capture is ``"cuda"`` or ``"emulate"``, or
    when strict binding is checked with capture off (``"check"``).

    Per call: start a step where this graph starts one, refuse invalidated outputs handed back
    in, decide whether this step may capture or replay (capture sizes, grad mode), check
    parameter addresses once (a move invalidates every captured graph of this graph and
    recaptures), copy earlier steps' outputs handed back in (this step's replays may overwrite
    them), run the stitched module, and hand its outputs out of the memory pool
    (:mod:`fxsplit.runtime.memory.output_lifetime`).

    Args:
        split: the split graph, with its pieces' aliasing facts (its stitched module's captured
            pieces are replaced here).
        config: the options it was compiled with.
        mode: ``"cuda"``, ``"emulate"`` or ``"check"``.
        example_inputs: Dynamo's example inputs (locate the size input and parameters).
        pool: the :class:`~fxsplit.runtime.memory.pool.MemoryPool` the graph's captures share with
            the backend's other graphs on this device; None for ``"check"``.
        device: the device of the graph's tensors.
        session: the backend's :class:`CaptureSession`.
        frame: the compiled :class:`Frame`; None when unknown.

    Attributes:
        pieces: the :class:`CapturedPiece` objects, in order.
    """

    def __init__(
        self,
        split: Split,
        config: Config,
        mode,
        example_inputs,
        pool: MemoryPool | None,
        device,
        session,
        frame: Frame | None = None,
    ):
        self.split = split
        self.graph_id = split.plan.graph_id
        self.mode = mode
        self.checking = mode == "check"
        self.pool = pool
        if pool is not None and frame is not None:
            for slot in frame.state_outputs:
                pool.ledger.keep_as_state(self.graph_id, slot)
        self.device = device
        self.session = session
        self.on_capture_error = config.on_capture_error
        self.clone_outputs = config.clone_outputs
        self.capture_sizes = frozenset(config.capture_sizes) if config.capture_sizes else None
        self._warned: set[str] = set()
        self._logged_sizes: set[int] = set()
        self._inside = 0  # calls of this graph under way (2: called inside its own call)
        self._recaptures: list[int] = []  # steps at which a parameter move dropped the graphs
        # compiled from the frame the caller entered: a call starts a step of the model
        self.entered = frame is None or frame.entered

        stitched = split.stitched
        self._placeholders = list(stitched.graph.find_nodes(op="placeholder"))
        # a marked cache handed in as an argument is read by address through the capture key
        self._static_arguments = frozenset(
            n.name for n in self._placeholders if is_static_argument(n)
        )
        # parameters only eager pieces read (a cache that runs with attention) are followed by
        # nobody: their moves concern no capture
        captured_reads = {
            name
            for each in split.pieces
            if each.part.kind == "captured"
            for name in each.module.input_names
        }
        self.statics = StaticInputs(
            self._placeholders, example_inputs, self._static_arguments, captured_reads
        )
        self.context = GraphContext(
            self.graph_id,
            mode,
            config.binding,
            config.warmup_runs,
            config.max_captured_keys,
            config.on_capture_error,
            config.verify,
            self.capture_sizes,
            pool,
            session,
            split,
            self.statics,
        )
        self._size_index = size_input_index(
            self._placeholders,
            example_inputs,
            self.statics.params,
            frame.arg_names if frame is not None else None,
            config.size_input,
        )
        self._resumed = frame is not None and frame.model_values
        self._made = keeping.made_outputs(split.graph_module.graph)
        self._stitched = stitched
        self.pieces = self._install()
        self._forward = stitched.forward
        self._warn_unreachable_sizes()

    def _warn_unreachable_sizes(self) -> None:
        """A graph whose size input is static (``dynamic=False``, or not yet dynamic) can only
        ever capture that one size; one with no size input never captures under
        ``capture_sizes``."""
        if self.capture_sizes is None:
            return
        if self._size_index is None:
            self._warn_once(
                "no-size",
                f"fxsplit {self.graph_id}: capture_sizes={sorted(self.capture_sizes)} is set but "
                "the graph has no tensor argument to read the size from; it never captures",
            )
            return
        value = self._placeholders[self._size_index].meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            return
        size = value.shape[0]
        if isinstance(size, int) and size not in self.capture_sizes:
            self._warn_once(
                "static-size",
                f"fxsplit {self.graph_id}: the size input of this graph "
                f"({self._placeholders[self._size_index].name}) is fixed at {size} (a static "
                f"graph), which is not in capture_sizes={sorted(self.capture_sizes)}; it never "
                "captures. Compile with dynamic=True, or add the size.",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_at_caller(message)

    def _reinstall(self) -> None:
        """Drop every capture and make the pieces anew (their bindings read the state as it is
        now); each new piece's figures start from its old one's, so ``Backend.stats`` tells
        the whole run, as the process-wide counters do."""
        self.reset()
        before = {piece.name: piece.stats for piece in self.pieces}
        self.pieces = self._install()
        for piece in self.pieces:
            piece.stats.carry_over(before[piece.name])

    def _install(self) -> list[CapturedPiece]:
        split = self.split
        nodes = {n.name: n for n in split.graph_module.graph.nodes}
        producer = {}
        pieces = []
        volatile = frozenset(self.statics.volatile)
        # marked caches handed in as arguments, and views of them a captured piece hands on
        statics = set(self._static_arguments)
        # what the eager pieces between the last captured piece and this one write: None where
        # unseen by version counters (a new copy epoch), else the graph arguments whose memory
        # they write with torch's own ops (an aliasing tensor's counter would not see it)
        written: set[int] | None = set()
        arguments: dict[int, list[int]] = {}  # storage -> the graph arguments over it
        for i, placeholder in enumerate(self._placeholders):
            for memory in keeping.storages(placeholder) or ():
                arguments.setdefault(memory, []).append(i)

        def lend(module, kept):
            loans = self.pool.ledger.loans
            return lending.borrower(module, kept, nodes, producer, pieces, self._stitched, loans)

        for each in split.pieces:
            part, module, facts = each.part, each.module, each.aliasing
            if part.kind == "captured":
                if facts is None:
                    facts = PieceAliasing(error="the split ran without the aliasing analysis")
                inputs = [nodes[name] for name in module.input_names]
                specs = binding.classify(
                    inputs,
                    producer,
                    facts.written,
                    volatile,
                    resumed=self._resumed,
                    statics=statics,
                )
                for j, base in enumerate(facts.output_bases):
                    if base is not None and inputs[base].name in statics:
                        statics.add(module.output_names[j])
                reads = binding.key_reads(specs, inputs)
                kind = CheckedPiece if self.checking else CapturedPiece
                captured = kind(
                    module,
                    specs,
                    reads,
                    facts,
                    each.plan,
                    self.context,
                    op_facts.generators(part.nodes, "cuda" if self.mode == "cuda" else "cpu"),
                    written is None,
                )
                captured.written_before = tuple(sorted(written or ()))
                written = set()
                if self.pool is not None:
                    # its uncaptured runs (warm-ups, refusals) are eager code that an op of it
                    # (a custom op) may keep what it reads in: lent, as to an eager piece
                    kept = keeping.kept_inputs(inputs, part.nodes, ())
                    borrower = lend(module, kept)
                    if borrower is not None:
                        captured.run_eagerly = borrower
                # the stitched module's generated code calls it through its instance dict
                self._stitched.register_module(captured.name, captured)
                object.__setattr__(self._stitched, captured.name, captured)
                pieces.append(captured)
            else:
                memory = keeping.written_storages(part.nodes)
                if memory is None or written is None:
                    written = None
                else:
                    written.update(i for m in memory for i in arguments.get(m, ()))
                if self.pool is not None:
                    outputs = [nodes[name] for name in module.output_names]
                    inputs = [nodes[name] for name in module.input_names]
                    kept = keeping.kept_inputs(inputs, part.nodes, outputs)
                    borrower = lend(module, kept)
                    if borrower is not None:
                        object.__setattr__(self._stitched, module.name, borrower)
            for name in module.output_names:
                producer[nodes[name]] = module.name
        self.context.buffers.eager_written = tuple(
            sorted({i for piece in pieces for i in piece.written_before})
        )
        return pieces

    def __call__(self, *args):
        session = self.session
        session.own(self.graph_id)
        try:
            context = self.context
            outer = context.capture_step, context.repeat
            context.repeat = session.begin_call(self, self.entered)
            self._inside += 1
            try:
                return self._call(session, args)
            finally:
                self._inside -= 1
                context.capture_step, context.repeat = outer
                session.end_call()
        finally:
            session.disown()

    def _call(self, session: CaptureSession, args: tuple):
        context = self.context
        context.calls += 1
        context.epoch += 1
        pool = self.pool
        if pool is not None:
            pool.ledger.check_inputs(args, self.graph_id)
        handed = None
        self.context.capture_step = capture = self._may_capture(args)
        if capture and self._inside > 1:
            # Called inside its own call (by an eager piece's op): the outer call's values are
            # in its captured graphs' memory, which any replay of this graph writes; run through.
            capture = self.context.capture_step = False
            if "inside" not in self._warned:
                self._warned.add("inside")
                log.info("fxsplit %s: called inside its own call; runs uncaptured", self.graph_id)
        if capture:
            statics = self.statics
            if statics.volatile and pool is not None:
                self._keep_state(args)
            # Earlier outputs handed back in are read before anything (a parameter move's
            # recapture included) may invalidate their memory.
            if pool is not None:
                handed = take_over(pool, args, statics.runner_inputs)
                args = with_copies(args, handed)
            if statics.params:
                rebound = self._follow_params(args)
                if rebound:  # buffers the model rebinds to its outputs, copied before the reset
                    args = with_copies(args, rebound)
                    handed = [*(handed or ()), *rebound]
            if statics.volatile:
                self._check_settled(args)
        session.enter()
        outer = context.buffers.bind_call(args)
        out = ()
        try:
            out = self._forward(*args)
        except BaseException as error:
            if isinstance(error, RuntimeError) and _NOT_RESIZABLE in str(error):
                raise RuntimeError(
                    f"fxsplit {self.graph_id}: the model resized (resize_) a tensor in a "
                    "capture memory pool, an output of a captured piece; pool memory cannot "
                    "grow. Resize a clone (t = t.clone(); t.resize_(...)), or run the op that "
                    "resizes it eagerly (splitting_ops) with the work making that tensor"
                ) from error
            raise
        finally:
            context.buffers.end_call(outer)  # holds no caller's tensor past the call
            session.exit()
            if handed:  # also when the model raised: the caller's tensors leave the pool
                out = hand_back(out, handed, self.graph_id)
                provenance.RECORD.forget_taken(handed)
        if pool is not None:
            out = hand_out(out, pool, self.graph_id, self.clone_outputs)
        provenance.RECORD.record_outputs(session, self, out, self._made, args)
        return out

    def is_frozen_memory(self, value: torch.Tensor) -> bool:
        """Whether ``value`` lives in a parameter's or buffer's storage of this graph."""
        return self.statics.is_frozen_memory(value)

    def _may_capture(self, args) -> bool:
        if not self.pieces:  # every piece runs eagerly: nothing to capture, nothing to refuse
            return False
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            if self.on_capture_error == "raise" and not self.checking:
                raise CaptureRefusedError(
                    f"fxsplit {self.graph_id}: grad is enabled and an input requires grad, so "
                    "pieces cannot be captured (on_capture_error='raise'); run inference under "
                    "torch.no_grad() or torch.inference_mode()"
                )
            for piece in self.pieces:
                piece.stats.refusals[_GRAD] += 1
            if self.checking:  # capture off: nothing was going to be captured
                return False
            self._warn_once(
                "grad",
                f"fxsplit {self.graph_id}: {_GRAD}, so pieces run uncaptured (a replay returns "
                "outputs without grad_fn); run inference under torch.no_grad() or "
                "torch.inference_mode()",
            )
            return False
        if self.capture_sizes is None or self._size_index is None:
            return True
        size = args[self._size_index].shape[0]
        if size in self.capture_sizes:
            return True
        if size not in self._logged_sizes:
            self._logged_sizes.add(size)
            log.info(
                "fxsplit %s: size %s is not a capture size; runs uncaptured", self.graph_id, size
            )
        return False

    def _follow_params(self, args) -> list | None:
        """Follow the parameters and buffers (:meth:`StaticInputs.follow`): recapture where
        weights moved, or make those the model rebinds runner inputs; returns the private
        copies taken of rebound ones that are earlier outputs
        (:func:`~fxsplit.runtime.memory.hand_out.take_over`), or None."""
        what, indices = self.statics.follow(args, self.context.calls)
        if what in (FIRST, REBOUND):
            return self._rebind(indices, args) if indices else None
        if what == SAME:
            return None
        dropped = self.reset()
        log.info(
            "fxsplit %s: parameters or buffers moved since capture (%s); dropped %d captured "
            "graphs, recapturing",
            self.graph_id,
            ", ".join(self.statics.names(indices)),
            dropped,
        )
        if dropped:
            counters.totals["recaptures"] += 1
            self._note_recapture("parameters or buffers moved (load_state_dict(assign=True)?)")
        return None

    def _rebind(self, indices: list[int], args) -> list | None:
        """Parameters the model rebinds are fxsplit's to copy from now on
        (:meth:`StaticInputs.rebind`); those that are earlier outputs are copied first
        (returned, see :func:`~fxsplit.runtime.memory.hand_out.take_over`): the reset releases what
        this graph handed out (moved, or invalidated on torch 2.11), and this step still reads
        them."""
        names = self.statics.names(indices)
        self._warn_once(
            "rebound:" + ",".join(names),
            f"fxsplit {self.graph_id}: {', '.join(names)} (a parameter or buffer) moved on "
            "consecutive calls or is an output of a compiled graph, so fxsplit now copies it "
            "like a runner input, every call until it holds still, instead of recapturing. "
            "Either the model rebinds it in forward (update it in place with copy_ to avoid the "
            "copy), or several instances of one module class call this compiled graph (compile "
            "each with its own fxsplit.Backend).",
        )
        self.statics.rebind(indices, args)
        taken = None
        if self.pool is not None:
            self._keep_state(args)
            taken = take_over(self.pool, args, indices)
        self._reinstall()
        return taken

    def _keep_state(self, args) -> None:
        """The outputs the model rebinds its parameters or buffers to are its state: tell the
        ledger which graph output each came from (:meth:`OutputLedger.keep_as_state`)."""
        ledger = self.pool.ledger
        for i in self.statics.rebound():
            handed = ledger.handed_out(args[i])
            if handed is not None:
                found = handed.graph_id, handed.slot
            else:
                found = provenance.RECORD.output_slot(self.session, args[i])
            if found is not None:
                ledger.keep_as_state(*found)

    def _check_settled(self, args) -> None:
        """Rebound parameters that held still are read by address again
        (:meth:`StaticInputs.settled`): recapture."""
        settled = self.statics.settled(args)
        if not settled:
            return
        log.info(
            "fxsplit %s: %s held still for %d calls: read by address again, recapturing",
            self.graph_id,
            ", ".join(self.statics.names(settled)),
            SETTLED,
        )
        self._reinstall()

    def _note_recapture(self, reason: str) -> None:
        """Warn once when the graph recaptured more than a few times within a few steps."""
        steps = self.context.calls
        self._recaptures = [s for s in self._recaptures if s > steps - 10] + [steps]
        if len(self._recaptures) > 3:
            self._warn_once(
                "storm",
                f"fxsplit {self.graph_id}: recaptured {len(self._recaptures)} times in the last "
                f"10 steps: {reason}; every recapture costs a capture of every piece",
            )

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{piece: {key: counters}}`` for every captured piece."""
        return {p.name: p.stats.as_dict() for p in self.pieces}

    def reset(self) -> int:
        """Free every captured graph and static buffer (keys start over with warmup); outputs
        handed out of them and still held move to memory of their own
        (:meth:`~fxsplit.runtime.memory.output_lifetime.OutputLedger.release_order`). Returns how
        many
        graphs were dropped."""
        dropped = 0
        for piece in self.pieces:
            for entry in piece.entries.values():
                if entry.graph is not None:
                    piece.drop(entry)
                    dropped += 1
            piece.entries.clear()
            piece.warmups.clear()
        self.context.static_outputs.clear()
        self.context.buffers.clear()
        self.session.forget(self)
        if dropped and self.pool is not None and self.pool.cuda is not None:
            self.pool.cuda.renew(f"{self.graph_id} reset")
        return dropped


__all__ = ["GraphRuntime"]
