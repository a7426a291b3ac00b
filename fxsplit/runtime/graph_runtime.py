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
import warnings

import torch

from fxsplit import counters
from fxsplit.config import Config
from fxsplit.passes import Split, materialise
from fxsplit.runtime import binding
from fxsplit.runtime.captured import CapturedPiece
from fxsplit.runtime.stats import PieceStats

log = logging.getLogger("fxsplit")


class CaptureSession:
    """Collects garbage at most once per capture session and keeps the collector frozen in it.

    Capturing many pieces (or many sizes) with a ``gc.collect()`` per piece made capture take
    seconds per size. A session is a step of a compiled graph, or ``Backend.capture`` around many
    steps; the first capture inside it collects and freezes, the session's end unfreezes.
    """

    def __init__(self):
        self.depth = 0
        self.frozen = False
        # Data pointers of the tensors each graph of the backend returned on its last call: a
        # graph Dynamo resumes after a graph break reads values the model computed, which are
        # graph inputs but not runner inputs, so strict binding copies them instead of refusing.
        self.outputs: dict[int, frozenset[int]] = {}

    def produced(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is at the address of a tensor a compiled graph last returned."""
        ptr = tensor.data_ptr()
        return any(ptr in ptrs for ptrs in self.outputs.values())

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


class GraphRuntime:
    """The callable Dynamo runs for one graph when capture is ``"cuda"`` or ``"emulate"``.

    Args:
        split: the split graph (its stitched module's captured pieces are replaced here).
        config: the options it was compiled with.
        mode: ``"cuda"`` or ``"emulate"``.
        example_inputs: Dynamo's example inputs (locate the token-count input and parameters).
        pool: memory pool handle shared by the backend's graphs on this device (CUDA only).
        device: the device of the graph's tensors.
        session: the backend's :class:`CaptureSession`.

    Attributes:
        pieces: the :class:`CapturedPiece` objects, in order.
    """

    def __init__(self, split: Split, config: Config, mode, example_inputs, pool, device, session):
        self.split = split
        self.graph_id = split.plan.graph_id
        self.mode = mode
        self.pool = pool
        self.device = device
        self.capture_session = self.session = session
        runner = config.runner_policy
        self.persistent_inputs = runner.persistent_inputs
        self.binding = config.binding
        self.warmup_runs = config.warmup_runs
        self.max_captured_keys = config.max_captured_keys
        self.on_capture_error = config.on_capture_error
        self.verify = config.verify
        self.clone_outputs = config.clone_outputs
        self.capture_sizes = frozenset(config.capture_sizes) if config.capture_sizes else None
        self.capture_step = False
        self.static_outputs: dict[int, torch.Tensor] = {}
        self.static_ptrs: set[int] = set()  # data pointers of outputs in fxsplit's buffers
        self.static_storages: set[int] = set()  # and their storages
        self._warned_limit = False
        self._warned_grad = False
        self._logged_sizes: set[int] = set()

        stitched = split.materialised.stitched
        placeholders = list(stitched.graph.find_nodes(op="placeholder"))
        self._params = [i for i, n in enumerate(placeholders) if binding._is_static_input(n)]
        self._runner_inputs = [
            i
            for i, value in enumerate(example_inputs)
            if isinstance(value, torch.Tensor) and i not in self._params
        ]
        self._param_ptrs: tuple | None = None
        self._size_index = next(
            (
                i
                for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=False))
                if isinstance(value, torch.Tensor) and i not in self._params and value.dim() > 0
            ),
            None,
        )
        self.pieces = self._install(split, stitched)
        self._forward = stitched.forward
        self._warn_unreachable_sizes(placeholders)

    def _warn_unreachable_sizes(self, placeholders) -> None:
        """A graph whose token count is static (``dynamic=False``, or not yet dynamic) can only
        ever capture that one size."""
        if self.capture_sizes is None or self._size_index is None:
            return
        value = placeholders[self._size_index].meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            return
        size = value.shape[0]
        if isinstance(size, int) and size not in self.capture_sizes:
            warnings.warn(
                f"fxsplit {self.graph_id}: the token count of this graph is fixed at {size} "
                f"(a static graph), which is not in capture_sizes={sorted(self.capture_sizes)}; "
                "it never captures. Compile with dynamic=True, or add the size.",
                UserWarning,
                stacklevel=4,
            )

    def _install(self, split: Split, stitched) -> list[CapturedPiece]:
        nodes = {n.name: n for n in split.graph_module.graph.nodes}
        producer = {}
        pieces = []
        for part, module, plan_piece in zip(
            split.parts, split.materialised.pieces, split.plan.pieces, strict=True
        ):
            if part.kind == "captured":
                inputs = [nodes[name] for name in module.input_names]
                specs = binding.classify(part.nodes, inputs, producer)
                reads = binding.key_reads(specs, inputs)
                captured = CapturedPiece(module, specs, reads, plan_piece.regions, self)
                materialise.bind_piece(stitched, captured)
                pieces.append(captured)
            for name in module.output_names:
                producer[nodes[name]] = module.name
        return pieces

    def __call__(self, *args):
        self.capture_step = self._may_capture(args)
        if self.capture_step:
            if self._params:
                self._check_params(args)
            static_ptrs = self.static_ptrs
            for i in self._runner_inputs:
                if args[i].data_ptr() in static_ptrs:
                    # A previous output handed back in: this step's replays overwrite it before
                    # it is read, so read it from a private copy.
                    args = (*args[:i], args[i].clone(), *args[i + 1 :])
        session = self.capture_session
        session.enter()
        try:
            out = self._forward(*args)
        finally:
            session.exit()
        if self.binding == "strict":
            session.outputs[id(self)] = frozenset(
                o.data_ptr() for o in out if isinstance(o, torch.Tensor)
            )
        if self.clone_outputs:
            # Only outputs in fxsplit's static buffers are overwritten by the next replay; others
            # (views of the caller's tensors, eager results) keep eager aliasing.
            owned = self.static_storages
            out = tuple(
                o.clone()
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in owned
                else o
                for o in out
            )
        return out

    def _may_capture(self, args) -> bool:
        if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            if not self._warned_grad:
                self._warned_grad = True
                warnings.warn(
                    f"fxsplit {self.graph_id}: grad is enabled and an input requires grad, so "
                    "pieces run uncaptured (a replay returns outputs without grad_fn); run "
                    "inference under torch.no_grad() or torch.inference_mode()",
                    UserWarning,
                    stacklevel=3,
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
        elif ptrs != self._param_ptrs:
            self._param_ptrs = ptrs
            dropped = self.reset()
            log.info(
                "fxsplit %s: parameters or buffers moved since capture; dropped %d captured "
                "graphs, recapturing",
                self.graph_id,
                dropped,
            )
            if dropped:
                counters.totals["recaptures"] += 1

    def warn_key_limit(self, piece: CapturedPiece) -> None:
        """Warn once that ``piece`` reached ``max_captured_keys``."""
        if not self._warned_limit:
            self._warned_limit = True
            warnings.warn(
                f"fxsplit {self.graph_id}: {piece.name} reached max_captured_keys="
                f"{self.max_captured_keys}; further keys run uncaptured",
                UserWarning,
                stacklevel=4,
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
        self.static_ptrs.clear()
        self.static_storages.clear()
        return dropped


__all__ = ["CaptureSession", "GraphRuntime", "PieceStats"]
