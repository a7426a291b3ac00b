"""The torch.compile backend: ``backend="fxsplit"`` and :class:`Backend` objects."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule

from fxsplit import cache, capture_off, counters, hooks, precompile, trace
from fxsplit.config import Config
from fxsplit.config_checks import ConfigChecks, WarnOnSecondCall
from fxsplit.distributed import check_ranks
from fxsplit.frame import Frame, read_frame
from fxsplit.passes import Split, inductor, inductor_startup, split
from fxsplit.passes.mark import Policy
from fxsplit.plan import SplitPlan
from fxsplit.runtime.piece import replay_watch
from fxsplit.runtime.step.graph_runtime import GraphRuntime
from fxsplit.runtime.step.session import CaptureSession
from fxsplit.size_input import size_inputs, traced_size

log = logging.getLogger("fxsplit")

# torch.compile's modes fxsplit takes: transformers' CompileConfig passes "reduce-overhead" (CUDA
# graphs) by default.
_MODES = (None, "default", "reduce-overhead")


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
        self._finishers: list[Callable[[], None]] = []  # what graph hooks finish later
        self._session = CaptureSession()
        # Outputs handed out of the pools must not outlive the pools' memory, also when the
        # backend is collected without a reset; not at exit, where nothing reads them again
        # (closing moves every held output to memory of its own).
        self._sessions = [self._session]
        weakref.finalize(self, _close_sessions, self._sessions).atexit = False
        self._count = 0
        self._lock = threading.Lock()
        self.checks = ConfigChecks()

    def __deepcopy__(self, memo) -> Backend:
        """The backend itself, not a copy: it owns the graphs, pools and plans its caller reads
        back. transformers deep-copies a ``CompileConfig`` (backend included) before it
        compiles; a copy would compile into a second backend the caller never sees."""
        return self

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

        A ``mode`` or ``options`` that fxsplit refuses returns a callable that raises the error
        at every call instead (see :class:`_Refused`; raised here while precompiling).

        Raises:
            TypeError: an unknown keyword from torch.
            fxsplit.distributed.RankMismatchError: ranks split the graph differently (with
                ``torch.distributed`` initialised and ``check_ranks`` on).
        """
        if kwargs:
            raise TypeError(
                f"fxsplit backend got unexpected keyword(s) {sorted(kwargs)}; it takes options=..."
            )
        try:
            config = self._compile_config(mode, options)
        except (TypeError, ValueError) as error:
            if precompile.active():
                raise
            return _Refused(error)
        frame = read_frame(gm)
        # Dynamo's setting while it traces this graph: off under torch.compile(dynamic=True)
        dynamic = not torch._dynamo.config.assume_static_by_default
        if not precompile.active():
            return self.build(gm, example_inputs, config, frame, dynamic=dynamic)
        precompile.restore_graphargs(gm, example_inputs)
        cuda = _cuda_device(example_inputs) is not None
        state = precompile.capture(gm, config, frame, cuda, dynamic)  # before the split edits gm
        compiled = self.build(gm, example_inputs, config, frame, dynamic=dynamic)
        precompile.add_pieces(state, self.compiled[-1].compiled_pieces)
        return precompile.Precompiled(compiled, state)

    def _compile_config(self, mode: str | None, options: dict | None) -> Config:
        """This backend's config with ``torch.compile``'s ``options`` applied.

        Raises:
            ValueError: ``mode`` other than "default" or "reduce-overhead" (which asks for
                CUDA graphs: fxsplit's own job, so it changes nothing), or a bad option.
            TypeError: an option of the wrong type.
        """
        if mode not in _MODES:
            raise ValueError(
                f"fxsplit does not take torch.compile(mode={mode!r}); it takes mode 'default' or "
                "'reduce-overhead' (CUDA graphs, which fxsplit captures per piece: its capture "
                "option decides), or leave mode unset and pass fxsplit's own settings as "
                "options={...}"
            )
        return Config.from_options(options, base=self.config) if options else self.config

    def build(
        self,
        gm: GraphModule,
        example_inputs: Sequence[object],
        config: Config,
        frame: Frame | None,
        bundle: dict[str, bytes | str] | None = None,
        *,
        dynamic: bool,
    ) -> Callable:
        """Split ``gm`` under ``config`` and return the callable that runs it (what
        :meth:`__call__` does once it has the options and the frame; a precompiled graph
        loads through it, with its ``bundle`` of compiled pieces). ``dynamic``: ``gm`` was
        traced under ``torch.compile(dynamic=True)``.

        Raises:
            fxsplit.distributed.RankMismatchError: see :meth:`__call__`.
        """
        mode, device = _run_mode(config, example_inputs)  # fail before any work
        capture_off.tell_once(config.capture, _cuda_device(example_inputs))
        graph_id = self._next_graph_id()
        graph_code = gm.code if config.dump_folder else ""  # the split edits the graph in place
        policy = _policy(config, frame)
        cuda = _cuda_device(example_inputs)
        if inductor.resolve(config.compile_pieces, cuda) == "inductor":
            inductor_startup.prepare(cuda)
        result = _split(gm, policy, config, graph_id, mode, example_inputs, frame, dynamic)
        self._compile_pieces(result, config, example_inputs, frame, bundle)
        self._record(result, policy, config)
        if config.check_ranks:  # before anything can capture
            check_ranks(graph_id, result.plan, result.graph_module, result.compiled_pieces)
        runtime = self._runtime(result, config, mode, device, example_inputs, frame)
        model = frame.model if frame is not None else None
        built = hooks.BuiltGraph(result, config, graph_code, example_inputs, model, runtime)
        finishers = hooks.built(built)
        if finishers:
            self._finishers += finishers
            _BACKENDS_WITH_FINISHERS.add(self)
        if runtime is not None:
            compiled = runtime
        else:
            compiled = capture_off.counted(result.stitched.forward, len(result.plan.captured))
        if self.checks.pending:
            return WarnOnSecondCall(compiled, self.checks.warn)
        return compiled

    def _next_graph_id(self) -> str:
        with self._lock:
            graph_id = f"graph_{self._count}"
            self._count += 1
        return graph_id

    def _compile_pieces(self, result: Split, config: Config, example_inputs, frame, bundle):
        """Compile the distinct captured pieces with Inductor where ``compile_pieces`` says so
        (from ``bundle`` when a precompiled graph loads)."""
        cuda = _cuda_device(example_inputs)
        if inductor.resolve(config.compile_pieces, cuda) != "inductor":
            return
        result.compiled_pieces = inductor.compile_pieces(
            result,
            cuda,
            cache.cache_dir(config.cache_dir),
            torch.is_grad_enabled(),
            *traced_size(result, example_inputs, frame, config),
            bundle=bundle,
        )

    def _record(self, result: Split, policy: Policy, config: Config) -> None:
        """Keep the plan, log it, count it and trace it."""
        plan = result.plan
        self.checks.note(policy, config, plan, result.marks)
        self.plans.append(plan)
        self.compiled.append(result)
        log.info(
            "%s: %d nodes -> %d %s (%d captured, %d eager) in %.1f ms",
            plan.graph_id,
            plan.num_nodes,
            len(plan.pieces),
            "piece" if len(plan.pieces) == 1 else "pieces",
            len(plan.captured),
            len(plan.eager),
            plan.split_seconds * 1e3,
        )
        counters.totals["graphs"] += 1
        counters.totals["pieces"] += len(plan.pieces)
        counters.totals["captured_pieces"] += len(plan.captured)
        counters.totals["eager_pieces"] += len(plan.eager)
        trace.emit_plan(result)

    def _runtime(self, result, config, mode, device, example_inputs, frame) -> GraphRuntime | None:
        """The graph's run time where anything is captured or checked, else None."""
        if mode == "off":
            return None
        runtime = GraphRuntime(
            result,
            config,
            mode,
            example_inputs,
            self._session.pool(mode, device) if mode != "check" else None,
            device,
            self._session,
            frame,
        )
        self.runtimes.append(runtime)
        _BACKENDS_WITH_RUNTIMES.add(self)
        return runtime

    @property
    def stats(self) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
        """Run-time figures: ``{graph_id: {piece: {capture key: {counter: value}}}}``.

        Counters: captures, replays, uncaptured_runs, input_copies, input_copy_bytes (bytes).
        """
        return {rt.graph_id: rt.stats() for rt in self.runtimes}

    def capture(self, model, inputs_by_size) -> None:
        """Capture every size up front: calls ``model(*inputs)`` for each size, largest first,
        ``max(warmup_runs, 1) + 1`` times, under one capture session (garbage collected once,
        collector frozen throughout) with a tqdm progress bar where tqdm is installed. A
        precompiled graph's compiled pieces load first (they would otherwise wait for their
        second call). Another thread's call meanwhile raises
        :class:`~fxsplit.runtime.step.session.ConcurrentCallError`.

        The leading dimension of every tensor argument whose size equals the capture size is
        marked dynamic first (``torch._dynamo.maybe_mark_dynamic``), so all sizes share one graph:
        otherwise Dynamo would specialise the first graph on the largest size and recompile at
        the next one, leaving that capture in a graph no later call uses. Not for a precompiled
        function (``torch.compiler.load_compiled_function``'s, or a ``functools.partial`` of
        it): it traces nothing, its shapes were settled when it was compiled, and its guards
        refuse a marked tensor.

        Args:
            model: the ``torch.compile``'d model using this backend, or a precompiled function
                of one.
            inputs_by_size: ``{size: args tuple}``, one entry per capture size (token count).
        """
        try:
            from tqdm import tqdm
        except ImportError:  # a bare GPU box: torch, pytest and numpy only
            tqdm = None

        sizes = sorted(inputs_by_size, reverse=True)
        runs = max(self.config.warmup_runs, 1) + 1  # compiled pieces warm up once on CUDA
        session = self._session
        session.own("capture")  # the whole capture, as one call: no other thread's in between
        try:
            inductor.load_deferred()  # a precompiled graph's pieces, loaded at once
            for size in sizes if not _precompiled(model) else ():
                for arg in inputs_by_size[size]:
                    if isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] == size:
                        torch._dynamo.maybe_mark_dynamic(arg, 0)
            with session(), torch.no_grad():
                progress = (
                    sizes
                    if tqdm is None  # shown where a terminal watches, never in logs or pipes
                    else tqdm(
                        sizes, desc="fxsplit capture", unit="size", disable=None, file=sys.stderr
                    )
                )
                session.up_front = True
                try:
                    for size in progress:
                        for _ in range(runs):
                            model(*inputs_by_size[size])
                finally:
                    session.up_front = False
        finally:
            session.disown()

    def write_runtime_stats(self) -> None:
        """Write the run-time figures of every dumped graph into its dump folder: run what the
        graph hooks left to finish (:mod:`fxsplit.hooks`; also done at reset and at process
        exit)."""
        for finish in self._finishers:
            finish()

    def log_replays(self) -> None:
        """Log one line per graph whose captured pieces ran: calls, replays (share), captures
        and uncaptured runs (``TORCH_LOGS=fxsplit``; also done at reset and at process exit)."""
        for runtime in self.runtimes:
            replay_watch.log_summary(runtime.graph_id, runtime.stats())

    def reset(self) -> None:
        """Forget every plan, compiled graph and memory pool; safe to call repeatedly."""
        self.write_runtime_stats()
        self.log_replays()
        self._finishers.clear()
        for runtime in self.runtimes:
            runtime.reset()
        self.runtimes.clear()
        _close_sessions(self._sessions)
        self._session = CaptureSession()
        self._sessions.append(self._session)
        self.plans.clear()
        self.compiled.clear()
        self._count = 0
        self.checks.reset()


def _run_mode(config: Config, example_inputs) -> tuple[str, torch.device | None]:
    """How the graph runs: ``"cuda"``, ``"emulate"``, ``"check"`` (capture off, strict binding
    checked as a capture would) or ``"off"``, and its device.

    Raises:
        RuntimeError: see :func:`_capture_mode`.
    """
    mode, device = _capture_mode(config.capture, example_inputs)
    if mode == "off" and config.binding == "strict":
        mode = "check"
    return mode, device


def _policy(config: Config, frame: Frame | None) -> Policy:
    """What the mark pass looks for, for the compiled frame's module."""
    policy = Policy.build(
        config.runner_policy,
        config.splitting_ops,
        config.module_regions,
        config.eager_modules,
        config.active_presets,
    )
    policy.set_root(frame.root if frame is not None else None)
    return policy


def _split(
    gm: GraphModule,
    policy: Policy,
    config: Config,
    graph_id: str,
    mode: str,
    example_inputs,
    frame: Frame | None,
    dynamic: bool,
) -> Split:
    """The split of ``gm`` (with the aliasing analysis where anything runs or is dumped)."""
    # The split allocates many small objects while a large graph is alive; cyclic GC passes
    # over that graph would dominate its cost.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return split(
            gm,
            policy,
            graph_id=graph_id,
            runner=config.runner_policy.name,
            grad_at_entry=torch.is_grad_enabled(),
            analyse=mode != "off" or bool(config.dump_folder),
            size_input=size_inputs(gm, example_inputs, frame, config),
            model_values=frame is not None and frame.model_values,
            dynamic=dynamic,
        )
    finally:
        if gc_was_enabled:
            gc.enable()


class _Refused:
    """What Dynamo runs in place of a graph whose ``torch.compile`` arguments (``mode=``,
    ``options=``) fxsplit refuses: it raises that error at every call.

    torch hands a string backend its options only with the first graph Dynamo traced, and has
    no hook before. An error raised inside the backend reaches the user wrapped in
    ``BackendCompilerFailed``: its first line "backend='fxsplit' raised:", under Dynamo's
    frames, and its last asking for a bug report to PyTorch. Raised from the compiled frame,
    the user's own error is what they see, fxsplit's message its first line.
    """

    def __init__(self, error: Exception):
        self.error = error

    def __call__(self, *args):
        raise self.error.with_traceback(None)


def _close_sessions(sessions: list[CaptureSession]) -> None:
    for session in sessions:
        session.close()
    sessions.clear()


def _precompiled(model) -> bool:
    """Whether ``model`` is a loaded precompiled function (or a partial of one)."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
    except ImportError:  # a torch without precompile
        return False
    while isinstance(model, functools.partial):
        model = model.func
    return isinstance(model, AOTCompiledFunction)


def _cuda_device(example_inputs) -> torch.device | None:
    """The CUDA/HIP device of the graph's first tensor on one, or None."""
    tensors = (x for x in example_inputs if isinstance(x, torch.Tensor))
    return next((x.device for x in tensors if x.device.type == "cuda"), None)


def _capture_mode(capture: str, example_inputs) -> tuple[str, torch.device | None]:
    """Resolve the ``capture`` option against the graph's tensors: (mode, device).

    Raises:
        RuntimeError: ``capture="cuda"`` where no CUDA/HIP device is available or the graph's
            tensors are not on one.
    """
    device = _cuda_device(example_inputs)
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


_BACKENDS_WITH_FINISHERS: weakref.WeakSet[Backend] = weakref.WeakSet()
_BACKENDS_WITH_RUNTIMES: weakref.WeakSet[Backend] = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    for backend in list(_BACKENDS_WITH_FINISHERS):
        try:
            backend.write_runtime_stats()
        except OSError as error:  # a dump folder removed meanwhile must not fail the exit
            log.warning("fxsplit: could not write run-time figures: %s", error)
    for backend in list(_BACKENDS_WITH_RUNTIMES):
        backend.log_replays()


# The per-process object behind backend="fxsplit" (registered by the torch_dynamo_backends entry
# point, never by register_backend: both would fail with "duplicate name").
fxsplit_backend = Backend()


def plans() -> list[SplitPlan]:
    """Plans of every graph the string backend ``"fxsplit"`` compiled since the last reset."""
    return list(fxsplit_backend.plans)
