"""PyTorch's precompile with fxsplit: a compiled graph saved whole, loaded without tracing.

``torch.compile(fn, backend="fxsplit", fullgraph=True).aot_compile(((args), {}))`` traces
``fn`` once and calls fxsplit's backend; the result saves with ``save_compiled_function(path)``
and loads in another process with ``torch.compiler.load_compiled_function`` (Dynamo's bytecode
and guards, PyTorch's precompile). Under it the backend returns a :class:`Precompiled`, the
:class:`torch._dynamo.aot_compile_types.SerializableCallable` PyTorch serialises: Dynamo's graph
as fxsplit received it (``torch.fx._graph_pickler.GraphPickler``: nodes, example values as fake
tensors, the shape environment), the options and what fxsplit knows of the frame, plus the
compiled pieces in one bundle (Inductor's artifacts). Loading splits that graph again (cheap
next to a Dynamo trace); each piece's artifact, keyed as the piece cache keys them, loads from
the bundle at the piece's second call, while its first runs the piece's generated Python and
Inductor's per-process start-up runs in the background
(:class:`fxsplit.passes.inductor.Deferred`); a piece missing from the bundle comes from the
piece cache or is compiled.

What loading runs is what was compiled: PyTorch checks its version and the device, fxsplit its
own version (:class:`PrecompileError` where they differ); a changed model (code, a config,
a custom pass) means precompiling again, as with any precompiled artifact.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field

import torch

try:
    from torch._dynamo.aot_compile_types import SerializableCallable
except ImportError:  # older torch keeps it in aot_compile, or has no precompile
    try:
        from torch._dynamo.aot_compile import SerializableCallable
    except ImportError:
        SerializableCallable = object

FORMAT = 3
# Node meta fxsplit reads after the split: example values, region annotations, module stacks,
# unbacked-symbol bindings, the stack trace (dumps). Dynamo's GraphArg is kept as _Arg.
_META = ("example_value", "val", "custom", "nn_module_stack", "unbacked_bindings", "stack_trace")


class PrecompileError(RuntimeError):
    """A precompiled graph that cannot be loaded here (another fxsplit version, a format it
    does not read)."""


def active() -> bool:
    """Whether the graph being compiled is being precompiled (``aot_compile``: PyTorch then
    bundles AOTAutograd's artifacts, its switch for precompile)."""
    return bool(getattr(torch._functorch.config, "bundled_autograd_cache", False))


@dataclass(frozen=True)
class _Arg:
    """What fxsplit reads of Dynamo's ``GraphArg`` on a placeholder, kept across processes."""

    source: object
    pass_arg_as_tensor: bool
    example: object = None


@dataclass
class State:
    """What a precompiled graph holds.

    Attributes:
        graph: Dynamo's graph as the backend received it (``GraphPickler`` bytes).
        config: the options (:class:`fxsplit.config.Config`).
        frame: :class:`fxsplit.frame.Frame`, or None.
        pieces: Inductor's artifact (binary format) per piece
            (:func:`fxsplit.passes.piece_key.identity`) and per compile of a piece for one
            token count (:func:`~fxsplit.passes.piece_key.sized_identity`), as the
            precompiling process compiled or loaded them (whatever its piece cache holds);
            for a piece Inductor failed on, why (a str: loading does not try it again).
        versions: torch and fxsplit versions it was compiled with.
        grad: grad mode when it was compiled (Dynamo's guards hold it to that mode).
        dynamic: traced under ``torch.compile(dynamic=True)`` (Dynamo's
            ``assume_static_by_default`` off), which decides which sizes are step sizes
            (:mod:`fxsplit.passes.step_sizes`): loading runs outside any trace.
        cuda: its tensors are on a CUDA/HIP device (else its compiled pieces are C++ kernels
            for the CPU, whose loading Inductor prepares per process).
    """

    graph: bytes
    config: object
    frame: object
    pieces: dict[str, bytes | str] = field(default_factory=dict)
    versions: tuple[str, str] = ("", "")
    grad: bool = True
    dynamic: bool = False
    cuda: bool = False


def restore_graphargs(gm: torch.fx.GraphModule, example_inputs) -> None:
    """Put back what fxsplit reads of Dynamo's ``GraphArg`` on each placeholder, where
    ``aot_compile`` handed the graph over without it (Dynamo drops it once the frame is
    traced): the source of each tensor from the tracing context's symbolic contexts, a float
    lifted to a 0-dim tensor by its ``FloatTensorSource``, a parameter or static address by
    its example value (the real tensor)."""
    from torch._dynamo.source import FloatTensorSource

    context = torch._guards.TracingContext.try_get()
    contexts = getattr(context, "tensor_to_context", {})
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for node, example in zip(placeholders, example_inputs, strict=False):
        if "grapharg" in node.meta or not isinstance(example, torch.Tensor):
            continue
        source = getattr(contexts.get(example), "tensor_source", None)
        floated = isinstance(source, FloatTensorSource)
        node.meta["grapharg"] = _Arg(source.base if floated else source, floated, example)
        if hasattr(example, "_dynamo_static_input_type"):
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}


def capture(gm: torch.fx.GraphModule, config, frame, cuda: bool, dynamic: bool) -> State:
    """The state of a graph before the split edits it (``cuda`` and ``dynamic``: see
    :class:`State`).

    Raises:
        PrecompileError: the graph holds something that does not pickle (a local function or
            class, a closure), naming it.
    """
    from torch.fx._graph_pickler import Options

    from fxsplit import __version__

    kept = {}
    for node in gm.graph.nodes:
        kept[node] = node.meta
        meta = {k: node.meta[k] for k in _META if k in node.meta}
        grapharg = node.meta.get("grapharg")
        if grapharg is not None:
            # parameters stay recognisable (fxsplit's static inputs) without their tensors
            parameter = isinstance(getattr(grapharg, "example", None), torch.nn.Parameter)
            if parameter or "_dynamo_static_input_type" in node.meta.get("tensor_dict", {}):
                meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
            source = getattr(grapharg, "source", None)
            meta["grapharg"] = _Arg(source, getattr(grapharg, "pass_arg_as_tensor", False))
        node.meta = meta
    try:
        graph = _pickler().dumps(gm, Options(ops_filter=None, node_metadata_key_filter=None))
    except Exception as error:
        raise PrecompileError(
            f"fxsplit cannot precompile this graph: {type(error).__name__}: {error}"
        ) from error
    finally:
        for node, meta in kept.items():
            node.meta = meta
    versions = (torch.__version__, __version__)
    return State(
        graph, config, frame, versions=versions, grad=torch.is_grad_enabled(), dynamic=dynamic
    )


def _pickler():
    """``GraphPickler`` that also leaves out the fake-tensor mode of a view's base (PyTorch
    leaves out the view's own, and puts both back when unpickling; a mode does not pickle)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx._graph_pickler import GraphPickler

    class Pickler(GraphPickler):
        def reducer_override(self, obj):
            reduced = super().reducer_override(obj)
            if isinstance(obj, FakeTensor):
                data = reduced[1][0]
                base = data.metadata.base
                if base is not None and base.fake_mode is not None:
                    base = dataclasses.replace(base, fake_mode=None)
                    data.metadata = dataclasses.replace(data.metadata, base=base)
            return reduced

    return Pickler


def add_pieces(state: State, records) -> None:
    """Bundle the artifacts of the compiled pieces of one graph, their compiles for single
    token counts (``compile_sizes``) included, as this process compiled or loaded them, and
    why Inductor failed on a piece."""
    from fxsplit.passes import inductor, piece_key

    for record in records or ():
        if record.outcome == inductor.EAGER:
            if record.identity is not None:  # Inductor failed on it
                state.pieces.setdefault(record.identity, record.reason)
            continue
        keys = {record.identity: record.key}
        keys.update(
            (piece_key.sized_identity(record.identity, n), k) for n, k in record.sized.items()
        )
        for identity, key in keys.items():
            payload = inductor.payload(key) if key is not None else None
            if payload is not None:
                state.pieces.setdefault(identity, payload)


class Precompiled(SerializableCallable):
    """fxsplit's compiled graph as PyTorch's precompile serialises it: calls ``forward``."""

    def __init__(self, forward, state: State) -> None:
        self.forward = forward
        self.state = state

    def __call__(self, *args):
        return self.forward(*args)

    def finalize_loading(self, *args, **kwargs) -> None:
        """Load now the compiled pieces of this process that wait for their second call,
        this graph's among them (:func:`fxsplit.passes.inductor.load_deferred`). Engines call
        it once a precompiled function is loaded (vLLM's AOT compile cache calls
        ``finalize_loading(vllm_config)``); the arguments are the engine's and are not read."""
        from fxsplit.passes import inductor

        inductor.load_deferred()

    @classmethod
    def serialize_compile_artifacts(cls, fn: Precompiled) -> bytes:
        buffer = io.BytesIO()
        pickle.dump((FORMAT, fn.state), buffer)
        return buffer.getvalue()

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Precompiled:
        """Split the graph again; its compiled pieces load from the bundle at their second
        call.

        Raises:
            PrecompileError: another fxsplit version or format.
        """
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        from fxsplit import __version__
        from fxsplit.backend import fxsplit_backend
        from fxsplit.passes import inductor_startup

        found, state = pickle.loads(data)
        if found != FORMAT or state.versions[1] != __version__:
            raise PrecompileError(
                f"precompiled with fxsplit {state.versions[1]} (format {found}); this is "
                f"fxsplit {__version__} (format {FORMAT}): precompile again"
            )
        if state.pieces and not state.cuda:
            inductor_startup.prepare(None)  # overlaps the unpickling and the split
        gm = GraphPickler.loads(state.graph, FakeTensorMode(shape_env=ShapeEnv()))
        examples = [node.meta["example_value"] for node in gm.graph.find_nodes(op="placeholder")]
        with torch.set_grad_enabled(state.grad):
            forward = fxsplit_backend.build(
                gm, examples, state.config, state.frame, state.pieces, dynamic=state.dynamic
            )
        if state.pieces:
            inductor_startup.warm()  # beside the first call, which runs generated Python
        return cls(forward, state)
