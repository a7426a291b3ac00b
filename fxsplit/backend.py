"""The torch.compile backend: ``backend="fxsplit"`` and :class:`Backend` objects."""

from __future__ import annotations

import atexit
import dataclasses
import difflib
import gc
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule

from fxsplit import counters, runners, trace
from fxsplit.config import Config
from fxsplit.passes import Split, split
from fxsplit.passes.mark import Policy
from fxsplit.plan import SplitPlan
from fxsplit.runtime.graph_runtime import CaptureSession, Frame, GraphRuntime
from fxsplit.runtime.graphs import DeviceCapture
from fxsplit.runtime.strict import StrictInputs
from fxsplit.tools import dump

log = logging.getLogger("fxsplit")


class Backend:
    """A torch.compile backend object; ``torch.compile(model, backend=fxsplit.Backend(**options))``.

    Takes the same keys as ``torch.compile(..., backend="fxsplit", options={...})`` (see
    :class:`fxsplit.config.Config`) and validates them here. Keeps its own plans, compiled graphs
    and memory pools; ``torch._dynamo.reset()`` calls :meth:`reset`.

    Attributes:
        config: the validated options.
        plans: one :class:`~fxsplit.plan.SplitPlan` per graph compiled since the last reset, in
            compile order (a recompile appends one).
        compiled: the matching :class:`fxsplit.passes.Split` results (stitched module, pieces,
            marks), for inspection and dumps.

    Raises:
        ValueError / TypeError: bad options (see :meth:`fxsplit.config.Config.from_options`).
    """

    def __init__(self, **options):
        self.config = Config.from_options(options)
        self.plans: list[SplitPlan] = []
        self.compiled: list[Split] = []
        self.runtimes: list[GraphRuntime] = []
        self._dumps: list[tuple[object, GraphRuntime | None]] = []
        self._captures: dict[torch.device, DeviceCapture] = {}
        self._session = CaptureSession()
        self._count = 0
        self._lock = threading.Lock()
        self._matched: set[str] = set()
        self._regions_seen: set[str] = set()
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        default = Config()
        changed = [
            f"{f.name}={getattr(self.config, f.name)!r}"
            for f in dataclasses.fields(Config)
            if getattr(self.config, f.name) != getattr(default, f.name)
        ]
        return f"fxsplit.Backend({', '.join(changed)})"

    def __call__(
        self,
        gm: GraphModule,
        example_inputs: Sequence[object],
        *,
        options: dict | None = None,
        mode: str | None = None,
        **kwargs,
    ) -> Callable:
        """Split ``gm`` and return the callable Dynamo runs in its place.

        Raises:
            ValueError: ``mode`` other than "default", or a bad option.
            TypeError: an unknown keyword from torch, or an option of the wrong type.
        """
        if kwargs:
            raise TypeError(
                f"fxsplit backend got unexpected keyword(s) {sorted(kwargs)}; it takes options=..."
            )
        if mode not in (None, "default"):
            raise ValueError(
                f"fxsplit does not take torch.compile(mode={mode!r}); leave mode unset and pass "
                "fxsplit's own settings as options={...}"
            )
        config = Config.from_options(options, base=self.config) if options else self.config
        mode, device = _capture_mode(config.capture, example_inputs)  # fail before any work
        with self._lock:
            graph_id = f"graph_{self._count}"
            self._count += 1
        dump_root = config.dump_folder
        graph_code = gm.code if dump_root else ""  # the split edits the graph in place
        runner = config.runner_policy
        policy = Policy.build(
            runner,
            config.splitting_ops,
            config.module_regions,
            config.eager_modules,
            config.active_presets,
        )
        frame = _frame()
        policy.set_root(frame.root if frame is not None else None)
        # The split allocates many small objects while a large graph is alive; cyclic GC passes
        # over that graph would dominate its cost.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            result = split(
                gm,
                policy,
                graph_id=graph_id,
                runner=runner.name,
                grad_at_entry=torch.is_grad_enabled(),
                analyse=mode != "off" or bool(dump_root),
            )
        finally:
            if gc_was_enabled:
                gc.enable()
        self._warn_unmatched(policy)
        self._warn_misspelt_regions(config, result.marks)
        plan = result.plan
        self._warn_no_region(plan, result.marks, runner)
        self.plans.append(plan)
        log.info(
            "%s: %d nodes -> %d pieces (%d captured, %d eager) in %.1f ms",
            graph_id,
            plan.num_nodes,
            len(plan.pieces),
            len(plan.captured),
            len(plan.eager),
            plan.split_seconds * 1e3,
        )
        self.compiled.append(result)
        counters.totals["graphs"] += 1
        counters.totals["pieces"] += len(plan.pieces)
        counters.totals["captured_pieces"] += len(plan.captured)
        counters.totals["eager_pieces"] += len(plan.eager)
        trace.emit_plan(result)
        runtime = None
        if mode != "off":
            runtime = GraphRuntime(
                result,
                config,
                mode,
                example_inputs,
                self._device_capture(mode, device),
                device,
                self._session,
                frame,
            )
            self.runtimes.append(runtime)
        if dump_root:
            folder = dump.write_dump(dump_root, result, graph_code, example_inputs=example_inputs)
            self._dumps.append((folder, runtime))
            _BACKENDS_WITH_DUMPS.add(self)
            log.info("fxsplit %s: dump in %s", graph_id, folder)
        if runtime is not None:
            return runtime
        stitched = result.materialised.stitched
        if config.binding == "strict" and not (frame is not None and frame.model_values):
            placeholders = list(stitched.graph.find_nodes(op="placeholder"))
            return StrictInputs(
                stitched.forward, placeholders, graph_id, config.warmup_runs, self._session
            )
        return stitched.forward

    def _warn_misspelt_regions(self, config: Config, marks) -> None:
        """Warn once per name when a configured region name (``eager_regions``, a
        ``module_regions`` value) is carried by no node so far and looks like a misspelling of
        a region fxsplit or a registered runner knows (``"attenion"``)."""
        self._regions_seen.update(r for names in marks.regions.values() for r in names)
        known = {r for name in runners.names() for r in runners.get(name).eager_regions}
        known |= self._regions_seen
        configured = set(config.eager_regions or ()) | set(config.module_regions.values())
        for name in sorted(configured - known):
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.8)
            if close and f"region:{name}" not in self._warned:
                self._warned.add(f"region:{name}")
                warnings.warn(
                    f"fxsplit: region {name!r} is carried by no node and no runner knows it; "
                    f"did you mean {' or '.join(map(repr, close))}?",
                    UserWarning,
                    stacklevel=3,
                )

    def _warn_no_region(self, plan: SplitPlan, marks, runner) -> None:
        """Warn once when a runner wants regions eager but nothing marks any: attention (if the
        graph has any) is then captured with everything else."""
        if not runner.eager_regions or marks.regions or plan.eager or "no-region" in self._warned:
            return
        self._warned.add("no-region")
        warnings.warn(
            f"fxsplit {plan.graph_id}: no node is in any region, so runner {runner.name!r} "
            f"(eager: {', '.join(sorted(runner.eager_regions))}) runs nothing eagerly and any "
            "attention in this graph is captured; mark it with fxsplit.region(...), "
            "module_regions={'<AttentionClass>': 'attention'} or splitting_ops=['ns::op']",
            UserWarning,
            stacklevel=3,
        )

    def _warn_unmatched(self, policy: Policy) -> None:
        matched = policy.splitting_ops.used | policy.module_regions.used
        self._matched |= matched | policy.eager_modules.used
        for pattern in policy.unused_patterns():
            if pattern not in self._matched and pattern not in self._warned:
                self._warned.add(pattern)
                warnings.warn(
                    f"fxsplit: {pattern!r} (splitting_ops / module_regions / eager_modules) "
                    "matched no node of the compiled graph",
                    UserWarning,
                    stacklevel=2,
                )

    def _device_capture(self, mode: str, device: torch.device) -> DeviceCapture | None:
        """The memory pool and capture stream shared by this backend's graphs on ``device``."""
        if mode != "cuda":
            return None
        shared = self._captures.get(device)
        if shared is None:
            shared = self._captures[device] = DeviceCapture(device)
        return shared

    @property
    def stats(self) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
        """Run-time figures: ``{graph_id: {piece: {capture key: {counter: value}}}}``.

        Counters: captures, replays, uncaptured_runs, input_copies, input_copy_bytes (bytes).
        """
        return {rt.graph_id: rt.stats() for rt in self.runtimes}

    def capture(self, model, inputs_by_size) -> None:
        """Capture every size up front: calls ``model(*inputs)`` for each size, largest first,
        ``warmup_runs + 1`` times, under one capture session (garbage collected once, collector
        frozen throughout) with a tqdm progress bar.

        The leading dimension of every tensor argument whose size equals the capture size is
        marked dynamic first (``torch._dynamo.maybe_mark_dynamic``), so all sizes share one graph:
        otherwise Dynamo would specialise the first graph on the largest size and recompile at
        the next one, leaving that capture in a graph no later call uses.

        Args:
            model: the ``torch.compile``'d model using this backend.
            inputs_by_size: ``{size: args tuple}``, one entry per capture size (token count).
        """
        from tqdm import tqdm

        sizes = sorted(inputs_by_size, reverse=True)
        runs = max(self.config.warmup_runs, 0) + 1
        for size in sizes:
            for arg in inputs_by_size[size]:
                if isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] == size:
                    torch._dynamo.maybe_mark_dynamic(arg, 0)
        with self._session(), torch.no_grad():
            for size in tqdm(sizes, desc="fxsplit capture", unit="size"):
                for _ in range(runs):
                    model(*inputs_by_size[size])

    def write_runtime_stats(self) -> None:
        """Write the run-time figures of every dumped graph into its dump folder (also done at
        reset and at process exit)."""
        for folder, runtime in self._dumps:
            if runtime is not None:
                dump.write_runtime_stats(folder, runtime.stats())

    def reset(self) -> None:
        """Forget every plan, compiled graph and memory pool; safe to call repeatedly."""
        self.write_runtime_stats()
        self._dumps.clear()
        for runtime in self.runtimes:
            runtime.reset()
        self.runtimes.clear()
        self._session.outputs.clear()
        self._captures.clear()
        self.plans.clear()
        self.compiled.clear()
        self._count = 0
        self._matched.clear()
        self._regions_seen.clear()
        self._warned.clear()


def _frame() -> Frame | None:
    """The frame Dynamo is compiling (the backend runs inside Dynamo's translation of it);
    None outside Dynamo or where its internals differ."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code = tx.f_code
        receiver = tx.f_locals.get("self")
    except Exception:  # not under Dynamo (a direct backend call), or another torch layout
        return None
    count = code.co_argcount + code.co_kwonlyargcount
    # Dynamo names the functions that resume a frame after a graph break this way.
    resumed = code.co_name.startswith("torch_dynamo_resume_in_")
    root = type(receiver) if isinstance(receiver, torch.nn.Module) else None
    return Frame(tuple(code.co_varnames[:count]), resumed, root, _called_by_eager_code())


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DYNAMO_DIR = os.path.join(_TORCH_DIR, "_dynamo") + os.sep
_ENTRY = os.path.join(_DYNAMO_DIR, "eval_frame.py")


def _called_by_eager_code() -> bool:
    """Whether the frame Dynamo is compiling was called by code outside torch running eagerly.

    The Python stack at compile time holds the callers of that frame: from the outside in, the
    ``torch.compile`` wrapper (``torch/_dynamo/eval_frame.py``), the callers of the compiled
    frame, then Dynamo's own frames. For the frame the caller entered through, the callers in
    between are torch's (``nn.Module.__call__``); for a frame Dynamo compiles inside a frame it
    gave up on (a graph break, a recompile limit), model code runs eagerly in between.
    """
    stack = []
    frame = sys._getframe(1)
    while frame is not None:
        stack.append(frame.f_code.co_filename)
        frame = frame.f_back
    stack.reverse()  # outermost first
    entry = None
    for i, filename in enumerate(stack):
        if filename == _ENTRY:
            entry = i
        elif filename.startswith(_DYNAMO_DIR):
            break
    else:
        return False
    callers = stack[entry + 1 : i] if entry is not None else []
    return any(not f.startswith(_TORCH_DIR) for f in callers)


def _capture_mode(capture: str, example_inputs) -> tuple[str, torch.device | None]:
    """Resolve the ``capture`` option against the graph's tensors: (mode, device).

    Raises:
        RuntimeError: ``capture="cuda"`` where no CUDA/HIP device is available or the graph's
            tensors are not on one.
    """
    device = next(
        (
            x.device
            for x in example_inputs
            if isinstance(x, torch.Tensor) and x.device.type == "cuda"
        ),
        None,
    )
    if capture == "auto":
        return ("cuda", device) if device is not None else ("off", None)
    if capture == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "fxsplit option capture='cuda' needs a CUDA or ROCm device, and torch sees none; "
                "use capture='emulate' (the CPU capture emulator) or capture='off'"
            )
        if device is None:
            raise RuntimeError(
                "fxsplit option capture='cuda': the graph's tensors are not on a CUDA device; "
                "move the model and inputs to 'cuda', or use capture='emulate' / 'off'"
            )
        return "cuda", device
    if capture == "emulate":
        return "emulate", torch.device("cpu") if device is None else device
    return "off", None


_BACKENDS_WITH_DUMPS: weakref.WeakSet[Backend] = weakref.WeakSet()


@atexit.register
def _write_dumps_at_exit() -> None:
    for backend in list(_BACKENDS_WITH_DUMPS):
        try:
            backend.write_runtime_stats()
        except OSError as error:  # a dump folder removed meanwhile must not fail the exit
            log.warning("fxsplit: could not write run-time figures: %s", error)


# The per-process object behind backend="fxsplit" (registered by the torch_dynamo_backends entry
# point, never by register_backend: both would fail with "duplicate name").
fxsplit_backend = Backend()


def plans() -> list[SplitPlan]:
    """Plans of every graph the string backend ``"fxsplit"`` compiled since the last reset."""
    return list(fxsplit_backend.plans)
