"""Run time of one compiled graph with capture on: per-step checks around the stitched module.

Per step (:meth:`GraphRuntime.__call__`): decide whether this step may capture/replay (capture
sizes, grad mode), check parameter addresses once (a move invalidates every captured graph of
this graph and recaptures), then run the stitched module, whose captured pieces are
:class:`~fxsplit.runtime.captured.CapturedPiece` objects.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from dataclasses import dataclass

import torch

from fxsplit import counters
from fxsplit.config import Config
from fxsplit.passes import Split, materialise
from fxsplit.passes.aliasing import PieceAliasing
from fxsplit.runtime import binding
from fxsplit.runtime.captured import CapturedPiece
from fxsplit.runtime.stats import PieceStats
from fxsplit.runtime.storage import clone_sharing
from fxsplit.warn import warn_at_caller

log = logging.getLogger("fxsplit")


class CaptureSession:
    """What a backend's compiled graphs share at run time: garbage collection once per capture
    session, and which memory fxsplit produced.

    Capturing many pieces (or many sizes) with a ``gc.collect()`` per piece made capture take
    seconds per size. A session is a step of a compiled graph, or ``Backend.capture`` around many
    steps; the first capture inside it collects and freezes, the session's end unfreezes.

    Memory fxsplit produced is never the caller's (see :mod:`fxsplit.runtime.binding`): the
    storages of every graph's outputs on its last call (a graph Dynamo resumes after a graph
    break reads them as inputs) and of every static output buffer (replays overwrite them
    without touching their version counters).
    """

    def __init__(self):
        self.depth = 0
        self.frozen = False
        self.outputs: dict[int, frozenset[int]] = {}  # graph -> storages of its last outputs
        self.storages: dict[int, set[int]] = {}  # graph -> storages of its static outputs

    def produced(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in memory fxsplit produced (see the class docstring)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr in s for s in self.outputs.values()) or any(
            ptr in s for s in self.storages.values()
        )

    def own(self, graph: object, tensor: torch.Tensor) -> None:
        """Record ``tensor`` (a static output of ``graph``) as fxsplit's memory."""
        self.storages.setdefault(id(graph), set()).add(tensor.untyped_storage().data_ptr())

    def owned(self, graph: object) -> set[int]:
        """Storages of ``graph``'s static outputs (a live set)."""
        return self.storages.setdefault(id(graph), set())

    def forget(self, graph: object) -> None:
        """Drop what is recorded for ``graph`` (its captured graphs were freed)."""
        self.storages.pop(id(graph), None)
        self.outputs.pop(id(graph), None)

    def sync_mark(self, tensor: torch.Tensor) -> tuple | None:
        """``(weak reference, version, data pointer)`` of a value just copied into a static
        buffer, telling the next call whether it changed since; None where the version counter
        cannot tell (inference tensors have none; fxsplit's own buffers change by replay,
        unseen)."""
        if tensor.is_inference():
            return None
        ptr = tensor.untyped_storage().data_ptr()
        if any(ptr in s for s in self.storages.values()):
            return None
        return weakref.ref(tensor), tensor._version, tensor.data_ptr()

    def enter(self) -> None:
        """Open a (possibly nested) session; collects nothing yet."""
        self.depth += 1

    def exit(self) -> None:
        """Close a session; the outermost one unfreezes the collector if a capture froze it."""
        self.depth -= 1
        if self.depth == 0 and self.frozen:
            self.frozen = False
            gc.unfreeze()

    def collect_once(self) -> None:
        """Called before each capture: collect and freeze on the session's first capture."""
        if not self.frozen:
            gc.collect()
            if self.depth > 0:
                gc.freeze()
                self.frozen = True

    @contextlib.contextmanager
    def __call__(self):
        self.enter()
        try:
            yield
        finally:
            self.exit()


@dataclass(frozen=True)
class Frame:
    """The Python frame a graph was compiled from.

    Attributes:
        arg_names: its argument names in signature order (where the size input is looked up).
        resumed: a frame Dynamo resumes after a graph break: its arguments are the live values
            of the model at the break, not tensors the caller handed in.
        root: the class of the ``nn.Module`` whose method the frame runs, if any.
        model: the root's class name, else the function's name (for dump folder names).
        nested: a frame called by model code that runs eagerly (Dynamo gave up on an enclosing
            frame: a graph break, a recompile limit): its arguments were computed by the model,
            not handed in by the caller.
    """

    arg_names: tuple[str, ...]
    resumed: bool = False
    root: type | None = None
    model: str | None = None
    nested: bool = False

    @property
    def model_values(self) -> bool:
        """Its tensor arguments are the model's own values (resumed or nested), fxsplit's to
        copy under every binding."""
        return self.resumed or self.nested


class GraphRuntime:
    """The callable Dynamo runs for one graph when capture is ``"cuda"`` or ``"emulate"``.

    Args:
        split: the split graph, with its pieces' aliasing facts (its stitched module's captured
            pieces are replaced here).
        config: the options it was compiled with.
        mode: ``"cuda"`` or ``"emulate"``.
        example_inputs: Dynamo's example inputs (locate the size input and parameters).
        device_capture: the memory pool and capture stream shared by the backend's graphs on
            this device (:class:`~fxsplit.runtime.graphs.DeviceCapture`; CUDA only, else None).
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
        device_capture,
        device,
        session,
        frame: Frame | None = None,
    ):
        self.split = split
        self.graph_id = split.plan.graph_id
        self.mode = mode
        self.device_capture = device_capture
        self.device = device
        self.capture_session = self.session = session
        self.binding = config.binding
        self.warmup_runs = config.warmup_runs
        self.max_captured_keys = config.max_captured_keys
        self.on_capture_error = config.on_capture_error
        self.verify = config.verify
        self.clone_outputs = config.clone_outputs
        self.capture_sizes = frozenset(config.capture_sizes) if config.capture_sizes else None
        self.capture_step = False
        self.static_outputs: dict[int, torch.Tensor] = {}
        self._warned: set[str] = set()
        self._logged_sizes: set[int] = set()
        self._steps = 0
        self._recaptures: list[int] = []  # steps at which a parameter move dropped the graphs
        self._moves: dict[int, int] = {}  # placeholder index -> the last step it moved on

        stitched = split.materialised.stitched
        self._placeholders = list(stitched.graph.find_nodes(op="placeholder"))
        self._volatile: set[str] = set()
        self._params = [i for i, n in enumerate(self._placeholders) if binding.is_static_input(n)]
        self._runner_inputs = [
            i
            for i, value in enumerate(example_inputs)
            if isinstance(value, torch.Tensor) and i not in self._params
        ]
        self._param_ptrs: tuple | None = None
        self._size_index = size_input_index(
            self._placeholders,
            example_inputs,
            self._params,
            frame.arg_names if frame is not None else None,
            config.size_input,
        )
        self._resumed = frame is not None and frame.model_values
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

    def _install(self) -> list[CapturedPiece]:
        split = self.split
        nodes = {n.name: n for n in split.graph_module.graph.nodes}
        producer = {}
        pieces = []
        volatile = frozenset(self._volatile)
        for part, module, plan_piece, facts in zip(
            split.parts, split.materialised.pieces, split.plan.pieces, split.aliasing, strict=True
        ):
            if part.kind == "captured":
                if facts is None:
                    facts = PieceAliasing(error="the split ran without the aliasing analysis")
                inputs = [nodes[name] for name in module.input_names]
                specs = binding.classify(
                    inputs, producer, facts.written, volatile, resumed=self._resumed
                )
                reads = binding.key_reads(specs, inputs)
                captured = CapturedPiece(module, specs, reads, facts, plan_piece, self)
                materialise.bind_piece(self._stitched, captured)
                pieces.append(captured)
            for name in module.output_names:
                producer[nodes[name]] = module.name
        return pieces

    def __call__(self, *args):
        self._steps += 1
        handed = None
        self.capture_step = self._may_capture(args)
        if self.capture_step:
            if self._params:
                self._check_params(args)
            owned = self.session.owned(self)
            if owned:
                back = [
                    i for i in self._runner_inputs if args[i].untyped_storage().data_ptr() in owned
                ]
                if back:
                    # Earlier outputs (or views of them) handed back in: this step's replays
                    # overwrite them before they are read, so the step reads and writes private
                    # copies (sharing memory as the originals do), handed back afterwards.
                    copies = clone_sharing([args[i] for i in back])
                    handed = [(args[i], c) for i, c in zip(back, copies, strict=True)]
                    args = list(args)
                    for i, c in zip(back, copies, strict=True):
                        args[i] = c
                    args = tuple(args)
        session = self.capture_session
        session.enter()
        try:
            out = self._forward(*args)
        finally:
            session.exit()
        if handed is not None:
            out = _hand_back(out, handed)
        session.outputs[id(self)] = frozenset(
            o.untyped_storage().data_ptr() for o in out if isinstance(o, torch.Tensor)
        )
        if self.clone_outputs:
            out = _clone_owned(out, self.session.owned(self))
        return out

    def _may_capture(self, args) -> bool:
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            self._warn_once(
                "grad",
                f"fxsplit {self.graph_id}: grad is enabled and an input requires grad, so "
                "pieces run uncaptured (a replay returns outputs without grad_fn); run "
                "inference under torch.no_grad() or torch.inference_mode()",
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

    def _check_params(self, args) -> None:
        ptrs = tuple(args[i].data_ptr() for i in self._params)
        if self._param_ptrs is None:
            self._param_ptrs = ptrs
            return
        if ptrs == self._param_ptrs:
            return
        moved = [i for i, a, b in zip(self._params, ptrs, self._param_ptrs, strict=True) if a != b]
        self._param_ptrs = ptrs
        rebound = []
        for i in moved:
            # The model rebinding a buffer moves it on consecutive steps; reloading weights
            # (load_state_dict(assign=True)) moves them once in a while.
            if self._moves.get(i) == self._steps - 1:
                rebound.append(i)
            self._moves[i] = self._steps
        if rebound:
            self._rebind(rebound)
            return
        dropped = self.reset()
        log.info(
            "fxsplit %s: parameters or buffers moved since capture (%s); dropped %d captured "
            "graphs, recapturing",
            self.graph_id,
            ", ".join(self._placeholders[i].name for i in moved),
            dropped,
        )
        if dropped:
            counters.totals["recaptures"] += 1
            self._note_recapture("parameters or buffers moved (load_state_dict(assign=True)?)")

    def _rebind(self, indices: list[int]) -> None:
        """Static inputs that moved on two consecutive steps are rebound by the model itself
        (``self.t = self.t + 1``): from now on they are fxsplit's to copy, like runner inputs."""
        names = [self._placeholders[i].name for i in indices]
        self._warn_once(
            "rebound:" + ",".join(names),
            f"fxsplit {self.graph_id}: the model rebinds {', '.join(names)} (a parameter or "
            "buffer assigned a new tensor in forward) every step; fxsplit now copies it like a "
            "runner input instead of recapturing. Update it in place (copy_) to avoid the copy.",
        )
        self._volatile.update(names)
        self._params = [i for i in self._params if i not in indices]
        self._runner_inputs = sorted({*self._runner_inputs, *indices})
        self._param_ptrs = None
        self.reset()
        self.pieces = self._install()

    def _note_recapture(self, reason: str) -> None:
        """Warn once when the graph recaptured more than a few times within a few steps."""
        steps = self._steps
        self._recaptures = [s for s in self._recaptures if s > steps - 10] + [steps]
        if len(self._recaptures) > 3:
            self._warn_once(
                "storm",
                f"fxsplit {self.graph_id}: recaptured {len(self._recaptures)} times in the last "
                f"10 steps: {reason}; every recapture costs a capture of every piece",
            )

    def warn_key_limit(self, piece: CapturedPiece) -> None:
        """Warn once that ``piece`` reached ``max_captured_keys``."""
        self._warn_once(
            "keys",
            f"fxsplit {self.graph_id}: {piece.name} reached max_captured_keys="
            f"{self.max_captured_keys}; further keys run uncaptured",
        )

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{piece: {key: counters}}`` for every captured piece."""
        return {p.name: p.stats.as_dict() for p in self.pieces}

    def reset(self) -> int:
        """Free every captured graph and static buffer (keys start over with warmup); returns
        how many graphs were dropped."""
        dropped = 0
        for piece in self.pieces:
            for entry in piece.entries.values():
                entry.graph.reset()
            dropped += len(piece.entries)
            piece.entries.clear()
            piece.warmups.clear()
        self.static_outputs.clear()
        self.session.forget(self)
        if dropped and self.device_capture is not None:
            self.device_capture.renew(f"{self.graph_id} reset")
        return dropped


def size_input_index(
    placeholders, example_inputs, params, arg_names, size_input, warn: bool = True
) -> int | None:
    """Index of the graph input whose leading dim is the token count: the first tensor argument
    of the compiled frame in its signature's order (Dynamo orders graph inputs by first use, so
    a model that reads ``block_table`` first would key on the number of sequences), or the
    argument named by ``size_input`` (a name matching none warns, where ``warn``)."""
    candidates = [
        i
        for i, value in enumerate(example_inputs)
        if isinstance(value, torch.Tensor) and i not in params and value.dim() > 0
    ]
    if not candidates:
        return None
    names = {i: _argument(placeholders[i]) for i in candidates}
    if size_input is not None:
        for i in candidates:
            if names[i] == size_input:
                return i
    if size_input is not None and warn:
        warn_at_caller(
            f"fxsplit: size_input={size_input!r} names no tensor argument of this graph "
            f"(tensor arguments: {', '.join(sorted(n for n in names.values() if n)) or 'none'}); "
            "using the first tensor argument"
        )
    if arg_names:
        order = {name: k for k, name in enumerate(arg_names)}
        ranked = sorted(candidates, key=lambda i: (order.get(names[i], len(order)), i))
        return ranked[0]
    return candidates[0]


def _argument(node) -> str | None:
    """The frame argument a placeholder comes from: ``x`` for source ``L['x']``."""
    grapharg = node.meta.get("grapharg")
    name = getattr(getattr(grapharg, "source", None), "name", None)
    name = name() if callable(name) else name
    if isinstance(name, str) and name.startswith("L['") and name.endswith("']"):
        return name[3:-2]
    return None


def _hand_back(out: tuple, handed: list) -> tuple:
    """After a step that read private copies of earlier outputs handed back in: outputs that
    live in the same buffers are cloned (the caller or the model may hold the handed-in
    tensor, e.g. a buffer Dynamo re-assigns), then each handed-in tensor gets its copy's value
    back, the model's writes to it included, as eager would leave it."""
    storages = {original.untyped_storage().data_ptr() for original, _ in handed}
    out = tuple(
        o.clone()
        if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in storages
        else o
        for o in out
    )
    for original, copy in handed:
        original.copy_(copy)
    return out


def _clone_owned(out: tuple, owned: set[int]) -> tuple:
    """Clones of the outputs in fxsplit's static buffers (the next replay overwrites those),
    keeping eager's aliasing between them; other outputs (views of the caller's tensors, eager
    results) are returned as they are."""
    mine = [
        i
        for i, o in enumerate(out)
        if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in owned
    ]
    if not mine:
        return out
    result = list(out)
    for i, copy in zip(mine, clone_sharing([out[i] for i in mine]), strict=True):
        result[i] = copy
    return tuple(result)


__all__ = ["CaptureSession", "Frame", "GraphRuntime", "PieceStats"]
