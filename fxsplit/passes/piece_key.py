"""The cache key of a compiled piece: PyTorch's own AOTAutograd cache key, plus what it leaves
out.

PyTorch's key (``torch._inductor.standalone_compile.autograd_cache_key``, the key of
AOTAutograd's cache, which ``standalone_compile`` artifacts are stored under) covers the piece's
graph and the layouts of its inputs, every Inductor, AOTAutograd and Dynamo configuration
value, custom passes through their ``uuid()`` (a pass without one makes it refuse: Inductor's
caches bypass such a compile), the grad mode, default dtype, deterministic algorithms, the
device and the torch build (a hash of torch's sources). It is computed from the graph before
AOTAutograd, where a user op is a name: an op whose ``CompositeImplicitAutograd``
implementation (Python code, registered at run time) changes between runs would be served
from the old artifact, by fxsplit's cache and by AOTAutograd's own. So the code each such op
decomposes to (traced with ``make_fx`` on the piece's example values) enters PyTorch's key
itself, through its ``torch.compiler.config.cache_key_tag``, for the key and the compile alike;
so do the schema of each custom op and the layouts its fake kernel gave the traced call (a
fake kernel changed between runs changes the shapes compiled for: :func:`user_ops`).

fxsplit adds what standalone artifacts leave to their caller: what Dynamo's shape environment
assumes of the inputs' sizes (artifacts load without shape guards), which inputs share storage,
the global state Dynamo guards on (autocast among it) and fxsplit's version.

A piece PyTorch refuses to key (a user function in the graph, a custom pass without
``uuid()``) and a piece naming objects its code cannot identify (:func:`piece_graph.objects`)
get a key valid in this process only, so they are never stored on disk.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fxsplit.passes import piece_graph


@dataclass(frozen=True)
class Key:
    """Where a compiled piece is kept.

    Attributes:
        name: hex digest naming it in memory and on disk.
        portable: whether it identifies the piece in any process (may be stored on disk).
        why: why it is not portable; None when it is.
        tag: ``torch.compiler.config.cache_key_tag`` to compile it under (the decompositions
            of its ops with Python implementations; the configured tag where it has none).
    """

    name: str
    portable: bool
    why: str | None = None
    tag: str = ""

    def sized(self, n: int) -> Key:
        """The key of the compile for token count ``n`` (``compile_sizes``)."""
        return Key(_digest(self.name, f"size={n}"), self.portable, self.why, self.tag)

    def tagged(self):
        """A context in which PyTorch's caches key the piece's compile as this key does."""
        return torch.compiler.config.patch(cache_key_tag=self.tag)


def identity(code: str, layouts: object) -> str:
    """A piece within its graph: its canonical code and its inputs' layouts and shape
    assumptions (what groups identical pieces; a precompiled graph's bundle is indexed by
    it, since loading splits the same graph again)."""
    return _digest(code, repr(layouts))


def sized_identity(identity: str, n: int) -> str:
    """The compile of a piece (:func:`identity`) for token count ``n`` (``compile_sizes``)."""
    return _digest(identity, f"size={n}")


def key(piece: piece_graph.PieceGraph, dynamic: str, device: str, objects: tuple) -> Key:
    """The key of ``piece`` compiled with ``standalone_compile(dynamic_shapes=dynamic)`` for
    the device kind ``device`` (:func:`fxsplit.cache.device_kind`)."""
    from fxsplit import __version__

    extras = (
        repr(piece_graph.layouts(piece.examples)),
        repr(piece_graph.assumptions(piece.examples)),
        global_state(),
        device,
        __version__,
    )
    why = None
    decompositions = _decompositions(piece.graph_module)
    tag = torch.compiler.config.cache_key_tag
    if decompositions is None:
        why = "an op's CompositeImplicitAutograd implementation could not be traced"
    elif decompositions:
        tag = _digest(tag, *decompositions)
    ops = user_ops(piece.graph_module)
    if ops:  # for AOTAutograd's and Inductor's own caches too, which see the op as a name
        tag = _digest(tag, repr(ops))
    pytorch_key = None
    if not keys_for_disk():
        why = why or f"torch {torch.__version__} cannot compute PyTorch's key of a piece"
    else:
        try:
            with torch.compiler.config.patch(cache_key_tag=tag), standalone():
                pytorch_key = _pytorch_key(piece.graph_module, piece.examples, dynamic)
        except Exception as error:  # PyTorch refuses to key it: this process only
            first = next(iter(str(error).splitlines()), "")
            why = why or f"PyTorch's cache refuses it ({type(error).__name__}: {first})"
    if pytorch_key is None:
        pytorch_key = f"{piece.graph_module.code}\0{_config_identity()}\0{tag}"
    if why is None and objects:
        why = "it calls objects its code cannot identify (a user function, a submodule)"
    parts = (pytorch_key, *extras)
    if why is not None:
        parts += (repr(objects),)
    return Key(_digest(*parts), why is None, why, tag)


# What precompile switches on (aot_compile, loading a precompiled function), off again.
_PRECOMPILE_SWITCHES = (
    (torch._functorch.config, "bundled_autograd_cache"),
    (torch._functorch.config, "strict_autograd_cache"),
    (torch._functorch.config, "bypass_autograd_cache_key"),
    (torch._functorch.config, "force_autograd_cache"),
    (torch._functorch.config, "force_non_lazy_backward_lowering"),
    (torch._inductor.config, "enable_autograd_for_aot"),
)


@contextlib.contextmanager
def standalone() -> Iterator[None]:
    """Key and compile a piece as a standalone artifact, the same whether or not its frame is
    being precompiled or was loaded precompiled: ``aot_compile`` switches AOTAutograd's cache
    to bundled, strict entries with throwaway keys, and loading one turns on Inductor's
    ``enable_autograd_for_aot``; both would enter the key. (Settings this torch lacks are
    left alone.)"""
    with contextlib.ExitStack() as stack:
        for config, name in _PRECOMPILE_SWITCHES:
            if hasattr(config, name):
                stack.enter_context(config.patch(name, False))
        yield


@functools.cache
def keys_for_disk() -> bool:
    """Whether this torch computes PyTorch's key of a piece
    (``torch._inductor.standalone_compile.autograd_cache_key``; torch 2.11 has none): without
    it every piece is cached in memory only, and a new process compiles it again, through
    Inductor's own caches."""
    # the module: torch._inductor's attribute of that name is the function
    module = importlib.import_module("torch._inductor.standalone_compile")
    return hasattr(module, "autograd_cache_key")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _pytorch_key(graph_module, examples, dynamic: str) -> str:
    """AOTAutograd's cache key of the piece (raises where PyTorch refuses to key it)."""
    from torch._inductor.standalone_compile import autograd_cache_key

    found, _ = autograd_cache_key(graph_module, examples, dynamic_shapes=dynamic)
    return found


def _config_identity() -> str:
    """Every Inductor configuration value, objects (custom passes) by identity: keys pieces
    PyTorch refuses to key, within this process."""
    import torch._inductor.config as inductor_config

    values = inductor_config.get_config_copy()
    return repr(
        sorted(
            (name, v if isinstance(v, (int, float, str, bool, type(None))) else id(v))
            for name, v in values.items()
        )
    )


def _decompositions(graph_module) -> tuple[str, ...] | None:
    """The code of each op in the graph that has a ``CompositeImplicitAutograd`` kernel, as
    it decomposes on the piece's example values; None when one cannot be traced."""
    from torch.fx.experimental.proxy_tensor import make_fx

    found = []
    for node in graph_module.graph.nodes:
        target = node.target
        if node.op != "call_function" or not _decomposes(target):
            continue
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), _example)
        try:
            traced = make_fx(functools.partial(target, **kwargs))(*args)
        except Exception:
            return None
        found.append(f"{target}: {traced.code}")
    return tuple(found)


def user_ops(graph_module) -> tuple[tuple[str, str, tuple], ...]:
    """Each call of an op that is not torch's own (a custom op), with the op's schema and the
    layouts its fake kernel gave the traced call (Dynamo's example value of the node). To
    PyTorch's key such an op is a name, and its fake kernel decides the shapes and strides
    Inductor compiles for: an artifact compiled under another fake kernel would be served
    for the same graph, and fail at its first call (or worse)."""
    found = []
    for node in graph_module.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(
            target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
        ):
            continue
        if isinstance(target, torch._ops.OpOverload):
            overloads = (target,)
        else:
            overloads = tuple(getattr(target, name) for name in target.overloads())
        if not overloads or overloads[0].namespace in ("aten", "prims"):
            continue
        schema = "; ".join(str(op._schema) for op in overloads)
        value = node.meta.get("example_value")
        values = value if isinstance(value, (tuple, list)) else (value,)
        found.append((str(target), str(schema), piece_graph.layouts(values)))
    return tuple(found)


def _example(node):
    return node.meta["example_value"]


def _decomposes(target) -> bool:
    """Whether an op (or an overload of an op packet) has a CompositeImplicitAutograd kernel."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, name) for name in target.overloads()]
    elif isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    else:
        return False
    return any(
        torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        for op in overloads
    )


def global_state() -> str:
    """The global state Dynamo guards on, as its ``GlobalStateGuard`` serialises it, less the
    thread count (a run-time setting, not one a compile depends on)."""
    state = json.loads(torch._C._dynamo.guards.GlobalStateGuard().__getstate__())
    state.pop("num_threads", None)
    return json.dumps(state, sort_keys=True)
