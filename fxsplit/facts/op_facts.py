"""What PyTorch says about an op: whether CUDA/HIP graph capture accepts it, whether it only
allocates, whether its result is a view, whether it draws random numbers.

One module answers for every reader: the mark pass asks about FX nodes (:func:`unsafe`,
:func:`is_allocation`, :func:`is_view`, :func:`is_random`), the CPU capture emulator about
calls as the dispatcher or a torch-function mode sees them (:func:`capture_refusal`,
:func:`host_read`, :data:`ALLOCATIONS`, :func:`sync_entry_points`).

The answers come from the op's tags and schema:

- capture: ``torch.Tag.cudagraph_unsafe``, ``dynamic_output_shape`` (the output shape depends on
  tensor values: a sync, and no shape to freeze) and ``data_dependent_output`` (a host value read
  from a tensor: ``item``, ``equal``, ``allclose``);
- views: every overload's returns alias an argument without writing it (``Tensor(a)`` in the
  schema); on an FX node with Dynamo's example values, the result must also share its
  argument's storage (``reshape``, ``contiguous`` and ``to`` alias only when no copy is needed);
- random numbers: ``torch.Tag.nondeterministic_seeded``.

Three facts have no tag, and their lists live here, each with the reason:

- host reads that never reach the dispatcher for CPU tensors (``Tensor.tolist``,
  ``Tensor.numpy``, ``if t:``, printing, ...) and the ``synchronize`` entry points, which are
  not torch functions at all (:data:`HOST_READS`, :func:`sync_entry_points`);
- pinned-memory allocation (``pin_memory`` ops and the ``pin_memory=True`` argument);
- allocations that launch no kernel: the ``empty`` family, whose results hold unspecified values
  (``zeros``, ``ones`` and ``full`` launch a fill kernel; they are not allocations here).

Ops whose ``dynamic_output_shape`` tag speaks for the worst case only (``x[mask]`` versus
``x[idx]``, ``repeat_interleave`` without ``output_size``, ``one_hot`` without
``num_classes``) are decided from the call's arguments at dispatch; on an FX node, Dynamo's fake
run decides them (an unbacked size, which the mark pass reads).
"""

from __future__ import annotations

import inspect
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxsplit.facts.ops import dispatched_op_name, op_name, op_names

__all__ = [
    "ALLOCATIONS",
    "HOST_READS",
    "capture_refusal",
    "generators",
    "host_read",
    "is_allocation",
    "is_pure",
    "is_random",
    "is_torch_op",
    "is_view",
    "may_write",
    "sync_entry_points",
    "unsafe",
    "writes_out",
    "writes_unseen",
    "written_arguments",
]

aten = torch.ops.aten

# Why CUDA capture rejects a call (the ``reason`` of fxsplit.CaptureError).
SYNC = (
    "it reads a device value on the host (a device-to-host copy that synchronises the capturing "
    "stream); keep the value on the device or compute it before capture"
)
BRANCH = (
    "Python control flow on a tensor value needs the value on the host (a device-to-host copy and "
    "stream sync); use torch.where / masking, or decide on the host before capture"
)
DYNAMIC_SHAPE = (
    "its output shape depends on tensor values, so the host must read the data back (a sync) and "
    "the shape could not be frozen in a graph anyway; use a static-shape formulation"
)
PRINT = "formatting a tensor reads its values on the host (a device-to-host copy and sync)"
PINNED = "pinned host memory cannot be allocated while a stream is capturing"
STREAM_SYNC = "synchronising a stream or device is not permitted while a stream is capturing"
TAGGED_UNSAFE = "the op is tagged torch.Tag.cudagraph_unsafe"

# --------------------------------------------------------------------------------------------
# Host reads below the dispatcher's reach, and other facts without a tag
# --------------------------------------------------------------------------------------------

_T = torch.Tensor
# Python-level reads of a tensor's values: on a CPU tensor they never reach the dispatcher, so
# no tag can speak for them; a torch-function mode (the emulator) and the FX node's target (the
# mark pass: ``x.tolist()`` is a ``call_method`` node) both see these callables.
HOST_READS: dict[Any, tuple[str, str]] = {
    _T.item: ("aten::_local_scalar_dense (.item())", SYNC),
    _T.tolist: ("Tensor.tolist()", SYNC),
    _T.numpy: ("Tensor.numpy()", SYNC),
    _T.__array__: ("Tensor.__array__ (numpy conversion)", SYNC),
    _T.cpu: ("Tensor.cpu() (device-to-host copy)", SYNC),
    _T.pin_memory: ("Tensor.pin_memory()", PINNED),
    _T.__bool__: ("Tensor.__bool__ (Python branching on a tensor value, e.g. `if t:`)", BRANCH),
    _T.__int__: ("Tensor.__int__ (int(t) on a tensor value)", SYNC),
    _T.__float__: ("Tensor.__float__ (float(t) on a tensor value)", SYNC),
    _T.__complex__: ("Tensor.__complex__ (complex(t) on a tensor value)", SYNC),
    _T.__index__: ("Tensor.__index__ (a tensor value used as a Python index)", SYNC),
    _T.__contains__: ("Tensor.__contains__ (`v in t`)", BRANCH),
    _T.__repr__: ("Tensor.__repr__ (printing a tensor)", PRINT),
    _T.__format__: ("Tensor.__format__ (formatting a tensor)", PRINT),
    _T.equal: ("aten::equal (Tensor.equal / torch.equal)", SYNC),
    torch.equal: ("aten::equal (Tensor.equal / torch.equal)", SYNC),
    _T.allclose: ("Tensor.allclose / torch.allclose", SYNC),
    torch.allclose: ("Tensor.allclose / torch.allclose", SYNC),
    _T.is_nonzero: ("aten::is_nonzero (Tensor.is_nonzero)", SYNC),
    torch.is_nonzero: ("aten::is_nonzero (Tensor.is_nonzero)", SYNC),
}

# Device and stream synchronisation: methods of modules and classes, not torch functions.
_SYNC_ENTRY_POINTS = (
    (torch.cuda, "synchronize", "torch.cuda.synchronize()"),
    (torch.cpu, "synchronize", "torch.cpu.synchronize()"),
    (getattr(torch, "accelerator", None), "synchronize", "torch.accelerator.synchronize()"),
    (getattr(torch.cuda, "Stream", None), "synchronize", "torch.cuda.Stream.synchronize()"),
    (getattr(torch.cuda, "Event", None), "synchronize", "torch.cuda.Event.synchronize()"),
)


def sync_entry_points() -> list[tuple[Any, str, str]]:
    """``(owner, attribute, label)`` of every ``synchronize`` this torch has, for the emulator to
    patch while it captures (no mode sees them)."""
    return [(obj, attr, label) for obj, attr, label in _SYNC_ENTRY_POINTS if hasattr(obj, attr)]


# Read at import, before any capture patches them.
_SYNC_CALLABLES = frozenset(getattr(obj, attr) for obj, attr, _ in sync_entry_points())

# Pinned host memory has no tag; its ops are named for it.
_PINNING = frozenset(
    getattr(aten, name).default for name in ("_pin_memory", "pin_memory") if hasattr(aten, name)
)

# The empty family: native_functions.yaml names every factory whose result holds unspecified
# values ``empty*`` (``new_empty*``, ``_empty_*quantized``); no tag marks them.
_EMPTY = re.compile(r"^aten::(?:new_|_)?empty(?:_\w+)?(?:\.\w+)?$")


def _allocations() -> frozenset:
    found = set()
    for name in torch._C._dispatch_get_all_op_names():
        if not _EMPTY.match(name):
            continue
        packet_name, _, overload = name[len("aten::") :].partition(".")
        op = getattr(getattr(aten, packet_name), overload or "default", None)
        if op is not None and not op._schema.is_mutable:  # not the out= forms
            found.add(op)
    return frozenset(found)


#: Overloads that only allocate: no kernel runs, so a CUDA graph replays nothing for them and
#: their memory keeps its previous contents.
ALLOCATIONS: frozenset = _allocations()

# --------------------------------------------------------------------------------------------
# Dispatch level: one call with its arguments
# --------------------------------------------------------------------------------------------

_BOOL_INDEX_DTYPES = (torch.bool, torch.uint8)
# ``x[mask] = v``: index_put carries no tag, but CUDA expands a boolean mask with nonzero (a
# sync), except for the one-element value it turns into masked_fill_.
_INDEX_PUT_OPS = frozenset(
    op
    for op in (
        aten.index_put_.default,
        aten.index_put.default,
        getattr(getattr(aten, "_index_put_impl_", None), "default", None),
    )
    if op is not None
)


def _has_bool_index(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in _BOOL_INDEX_DTYPES for i in (indices or ())
    )


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


# The tag speaks for the worst case of these overloads; the arguments say whether it applies.
_SHAPE_FROM_ARGUMENTS: dict[Any, Callable[[tuple, dict], bool]] = {
    aten.index.Tensor: lambda a, k: _has_bool_index(_arg(a, k, 1, "indices", ())),
    aten.repeat_interleave.Tensor: lambda a, k: _arg(a, k, 1, "output_size", None) is None,
    aten.one_hot.default: lambda a, k: _arg(a, k, 1, "num_classes", -1) == -1,
}


def capture_refusal(func: Any, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """Why CUDA capture would reject this call of an op as the dispatcher runs it, as
    ``(what ran, reason)``; None when it can be captured.

    Args:
        func: an ``OpOverload`` (or another dispatched callable, which is never refused).
        args / kwargs: the call's arguments (real or fake tensors, Python values).
    """
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return dispatched_op_name(func), SYNC
    if func in _PINNING:
        return dispatched_op_name(func), PINNED
    if kwargs.get("pin_memory"):
        return f"{dispatched_op_name(func)} (pin_memory=True)", PINNED
    if func in _INDEX_PUT_OPS and _has_bool_index(_arg(args, kwargs, 1, "indices", ())):
        value = _arg(args, kwargs, 2, "values", None)
        if (
            _arg(args, kwargs, 3, "accumulate", False)
            or not isinstance(value, torch.Tensor)
            or value.numel() != 1
        ):
            return f"{dispatched_op_name(func)} (boolean-mask assignment, x[mask] = v)", (
                DYNAMIC_SHAPE
            )
        return None
    if torch.Tag.dynamic_output_shape in tags:
        applies = _SHAPE_FROM_ARGUMENTS.get(func)
        if applies is not None and not applies(args, kwargs):
            return None
        if func is aten.index.Tensor:
            return "aten::index.Tensor (boolean-mask indexing, x[mask])", DYNAMIC_SHAPE
        return dispatched_op_name(func), DYNAMIC_SHAPE
    if torch.Tag.cudagraph_unsafe in tags:
        return dispatched_op_name(func), TAGGED_UNSAFE
    return None


def host_read(func: Any, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """Why CUDA capture would reject this Python-level call (a torch function or Tensor method,
    as a torch-function mode sees it), as ``(what ran, reason)``; None when it is no host read.

    ``Tensor.to`` counts as a device-to-host copy only with the host named by a string
    (``"cpu"``): ``t.to(x.device)``, the device-generic idiom, names the tensor's own device.
    """
    try:
        hit = HOST_READS.get(func)
    except TypeError:  # an unhashable callable
        return None
    if hit is not None:
        return hit
    if func is _T.to and _names_host(args, kwargs):
        return 'Tensor.to("cpu") (device-to-host copy)', SYNC
    return None


def _names_host(args: tuple, kwargs: dict) -> bool:
    for candidate in (*args[1:], kwargs.get("device")):
        if isinstance(candidate, str):
            try:
                if torch.device(candidate).type == "cpu":
                    return True
            except (RuntimeError, ValueError):
                continue
    return False


# --------------------------------------------------------------------------------------------
# FX node level: the op a node calls, whatever form Dynamo recorded it in
# --------------------------------------------------------------------------------------------


def _overloads(names: tuple[str, str | None]) -> tuple:
    """The overloads a node named ``names`` may call: the one it names, else every overload of
    its op."""
    base, overload = names
    ns, _, op = base.partition("::")
    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return ()
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return ()
    found = (
        getattr(packet, name, None) for name in ([overload] if overload else packet.overloads())
    )
    return tuple(op for op in found if op is not None)


def _makes_tensors(op: Any) -> bool:
    """Whether an overload returns tensors and writes none of its arguments (not an ``out=`` or
    in-place form, nor one of TorchScript's list and string overloads: ``aten::split.str``)."""
    schema = op._schema
    return not schema.is_mutable and any(
        isinstance(r.type, torch.TensorType)
        or (
            isinstance(r.type, torch.ListType)
            and isinstance(r.type.getElementType(), torch.TensorType)
        )
        for r in schema.returns
    )


@dataclass(frozen=True)
class _Facts:
    """What the tags and schemas of an op's overloads say, for an op named without arguments.

    Attributes:
        refuses_capture: an overload's tags refuse capture whatever its arguments.
        allocation: every overload that makes tensors is in :data:`ALLOCATIONS`.
        view: every overload that makes tensors returns views of its arguments.
        random: an overload is tagged ``nondeterministic_seeded``.
        writes: the op may write an argument: an in-place op (``add_``, ``index_put_``) has no
            overload that leaves its arguments alone, where a functional one's only writing
            overloads are its ``out=`` forms; unknown ops may.
        inplace_view: every overload is tagged ``inplace_view``: it changes its first
            argument's sizes, strides or storage in place and returns it.
    """

    refuses_capture: bool
    allocation: bool
    view: bool
    random: bool
    writes: bool
    inplace_view: bool


_BY_NAMES: dict[tuple[str, str | None], _Facts] = {}
_NO_OP = _Facts(False, False, False, False, False, False)


def _facts(node: Node) -> _Facts:
    """The facts of the op ``node`` calls (all false when it calls none), cached per op
    name."""
    names = op_names(node)
    if names is None:
        return _NO_OP
    try:
        return _BY_NAMES[names]
    except KeyError:
        pass
    overloads = _overloads(names)
    fresh = [op for op in overloads if _makes_tensors(op)]
    found = _BY_NAMES[names] = _Facts(
        refuses_capture=any(_tag_refuses(op) for op in overloads),
        allocation=bool(fresh) and all(op in ALLOCATIONS for op in fresh),
        view=bool(fresh) and all(_returns_views(op) for op in fresh),
        random=any(torch.Tag.nondeterministic_seeded in op.tags for op in overloads),
        writes=not overloads
        or all(
            op._schema.is_mutable
            for op in overloads
            if not any(a.is_out for a in op._schema.arguments)
        ),
        inplace_view=bool(overloads) and all(torch.Tag.inplace_view in op.tags for op in overloads),
    )
    return found


def _tag_refuses(op: Any) -> bool:
    """Whether the op's tags refuse capture whatever its arguments."""
    tags = op.tags
    if torch.Tag.dynamic_output_shape in tags:
        return op not in _SHAPE_FROM_ARGUMENTS
    return (
        torch.Tag.data_dependent_output in tags
        or torch.Tag.cudagraph_unsafe in tags
        or op in _PINNING
    )


def _returns_views(op: Any) -> bool:
    returns = op._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _python_callable(node: Node) -> Any:
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target, None)
    return node.target if node.op == "call_function" else None


def unsafe(node: Node) -> str | None:
    """The op name if ``node`` can never be captured in a CUDA/HIP graph, else None.

    Unsafe: ops whose tags refuse capture (``cudagraph_unsafe``, ``dynamic_output_shape``,
    ``data_dependent_output``; a packet or Tensor method when any of its overloads does),
    in-place layout changes (:func:`changes_layout`: a graph replays kernels, never a change of
    a tensor's sizes or strides, and it hands out the same tensor objects at every replay),
    pinned allocation, Python-level host reads (:data:`HOST_READS`) and ``synchronize``.
    Decided from the target alone; the mark pass adds the node-level rules (unbacked sizes,
    work on host tensors in a graph on a GPU).
    """
    if op_names(node) is None:
        return None
    callable_ = _python_callable(node)
    try:
        python_level = callable_ in HOST_READS or callable_ in _SYNC_CALLABLES
    except TypeError:  # an unhashable target
        python_level = False
    facts = _facts(node)
    refused = python_level or facts.refuses_capture or facts.inplace_view
    return op_name(node) if refused else None


def is_allocation(node: Node) -> bool:
    """Whether ``node`` only allocates (the ``empty`` family, see :data:`ALLOCATIONS`)."""
    return _facts(node).allocation


def is_view(node: Node) -> bool:
    """Whether ``node``'s result is a view of an argument: its op's schema says its result
    aliases an argument, and, where Dynamo's example values are known, the result shares the
    storage of one of the node's tensor arguments (``reshape``, ``contiguous``, ``to`` may
    copy)."""
    if not _facts(node).view:
        return False
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return True  # no example values (a plain torch.fx graph): the schema speaks
    try:
        storage = value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage to compare
        return True
    for arg in node.all_input_nodes:
        other = arg.meta.get("example_value")
        if isinstance(other, torch.Tensor):
            try:
                if other.untyped_storage()._cdata == storage:
                    return True
            except (RuntimeError, NotImplementedError):
                continue
    return False


# Namespaces whose ops are torch's own: their kernels are native code doing what the schema
# and tags say. Any other op (a custom op, an ``allow_in_graph`` function) runs code of the
# user's, which may draw random numbers or change Python state without any schema saying so.
_TORCH_NAMESPACES = frozenset({"aten", "prims"})
# Host arithmetic Dynamo records on SymInts and Python numbers (``n - 1``, ``sym_max``).
_HOST_MODULES = frozenset({"_operator", "math", "builtins", "torch"})
_NUMBERS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def is_pure(node: Node) -> bool:
    """Whether ``node``'s value depends on its arguments alone and computing it changes nothing
    else, by torch's own facts, so it may run anywhere between its inputs and its first user:

    - not impure for FX (:meth:`torch.fx.Node.is_impure`, which asks
      ``torch._library.utils.is_impure``: a mutable schema, an effect registered with
      ``torch.library._register_effectful_op``, torch's side-effectful functions, random
      ops);
    - its op is torch's own (``aten``, ``prims``) and no overload it may call draws random
      numbers (``nondeterministic_seeded``) or writes an argument; a Tensor method with no aten
      op of its name (``x.float()``) dispatches only to such ops;
    - or it is host arithmetic on Python values and SymInts (``operator``, ``math``, ``sym_*``).

    A user's op (a custom op, an ``allow_in_graph`` function) is never pure here: its Python
    body may draw from the generator or bump a counter, which no schema declares. Nor is a call
    with an ``out=`` argument (``torch.add(a, b, out=buf)``): a node names no overload, and its
    op's functional overloads write nothing where the call writes ``buf``.
    """
    if node.op not in ("call_function", "call_method") or node.is_impure() or writes_out(node):
        return False
    names = op_names(node)
    if names is None:  # a Python operator on host values, or a call of no op at all
        return node.op == "call_function" and _host_arithmetic(node)
    if names[0].partition("::")[0] not in _TORCH_NAMESPACES:
        return False
    overloads = _overloads(names)
    if not overloads:
        if node.op == "call_method":
            ops = _method_ops(node)
            return ops is not None and all(_pure_op(op) for op in ops)
        return _host_arithmetic(node)
    facts = _facts(node)
    return not (facts.random or facts.writes)


def is_torch_op(node: Node) -> bool:
    """Whether ``node`` calls an op of torch's own (``aten``, ``prims``) that the dispatcher
    knows, or is host arithmetic: a kernel that holds no reference to its arguments past the
    call, writing them in place or not (what it returns may view them: an in-place op returns
    its ``self``, a view op its base)."""
    if node.op not in ("call_function", "call_method"):
        return False
    names = op_names(node)
    if names is None:
        return node.op == "call_function" and _host_arithmetic(node)
    if names[0].partition("::")[0] not in _TORCH_NAMESPACES:
        return False
    if _overloads(names):
        return True
    if node.op == "call_method":
        ops = _method_ops(node)
        return ops is not None and all(
            isinstance(op, torch._ops.OpOverload) and op.namespace in _TORCH_NAMESPACES
            for op in ops
        )
    return _host_arithmetic(node)


def _pure_op(op: Any) -> bool:
    """A dispatched overload of torch's own that writes nothing and draws nothing."""
    return (
        isinstance(op, torch._ops.OpOverload)
        and op.namespace in _TORCH_NAMESPACES
        and not op._schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in op.tags
    )


def _host_arithmetic(node: Node) -> bool:
    """A function of torch, ``operator``, ``math`` or the builtins making a Python number or
    SymInt from host values only (no tensor among its inputs; a setter returns nothing)."""
    module = (getattr(node.target, "__module__", None) or "").partition(".")[0]
    if module not in _HOST_MODULES or not isinstance(node.meta.get("example_value"), _NUMBERS):
        return False
    return not any(
        isinstance(a.meta.get("example_value"), torch.Tensor) for a in node.all_input_nodes
    )


def writes_out(node: Node) -> bool:
    """Whether the call hands an ``out=`` argument (``torch.add(a, b, out=buf)``,
    ``torch.cat(xs, out=buf)``): it writes ``buf`` whatever its op's functional overloads say
    (a node with a torch function or Tensor method as its target names no overload); or calls
    an out= overload by name, whose outputs may have other names
    (``torch.ops.aten.sort.values(x, values=a, indices=i)``)."""
    if node.kwargs.get("out") is not None:
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(
        a.is_out for a in target._schema.arguments
    )


def changes_layout(node: Node) -> bool:
    """Whether the op ``node`` calls changes its first argument's sizes, strides or storage in
    place and returns it: every overload is tagged ``torch.Tag.inplace_view`` (``t_``,
    ``transpose_``, ``unsqueeze_``, ``as_strided_``, ``resize_``, ``set_``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    return _facts(node).inplace_view


def may_write(node: Node, dispatch: bool = False) -> bool:
    """Whether the op ``node`` calls may write one of its arguments, from its schemas (an
    ``out=`` argument included, :func:`writes_out`). A node
    that calls no op the dispatcher knows may; with ``dispatch``, a Tensor method with no aten
    op of its name (``x.float()``, ``x.long()``) is asked which ops it runs
    (:func:`_method_writes`)."""
    names = op_names(node)
    if names is None or writes_out(node):
        return True
    if dispatch and not _overloads(names):
        return _method_writes(node)
    return _facts(node).writes


def written_arguments(node: Node) -> tuple[Node, ...]:
    """The argument nodes ``node`` writes in place, by its op's schemas: those annotated
    ``Tensor(a!)`` in any overload it may call that is not an ``out=`` form (``self`` of
    ``index_copy_``, a custom op's ``mutates_args``), and the ``out=`` argument it hands
    (:func:`writes_out`). ``x[i] = v`` (``operator.setitem``, which Dynamo records as a Python
    operator, named after the view it indexes through) writes ``x``; an attribute read and a
    Python operator on host values or tuples write nothing. A call of no op the dispatcher
    knows (a user's function) may write any of its arguments: all of them; a Tensor method
    with no aten op of its name (``x.float()``) is asked which ops it runs
    (:func:`_method_writes`).

    Args:
        node: an FX node of any kind (placeholders and outputs write nothing).

    Returns:
        The written argument nodes in argument order, each once; a write through a view names
        the view's node, not its base.
    """
    if node.op not in ("call_function", "call_method"):
        return ()
    if node.op == "call_function" and node.target is operator.setitem:
        # Python's item assignment writes its container: the language says so, not a schema
        return tuple(a for a in node.args[:1] if isinstance(a, Node))
    if node.op == "call_function" and node.target is getattr:
        return ()  # an attribute read (``w.T``, ``w.mT``: Dynamo may keep it as ``getattr``)
    found: dict[Node, None] = {}
    if writes_out(node):
        found.update(dict.fromkeys(_flat_nodes(node.kwargs.get("out"))))
    names = op_names(node)
    if names is None and getattr(node.target, "__module__", None) == "_operator":
        return tuple(found)  # a Python operator on host values or tuples (``pair[0]``)
    positions = _written_positions(names) if names is not None else None
    if positions is None and names is not None and node.op == "call_method":
        positions = () if not _method_writes(node) else None
    if positions is None:
        found.update(dict.fromkeys(node.all_input_nodes))
        return tuple(found)
    for i, name in positions:
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        found.update(dict.fromkeys(_flat_nodes(value)))
    return tuple(found)


_WRITTEN: dict[tuple[str, str | None], tuple[tuple[int, str], ...] | None] = {}


def _written_positions(names: tuple[str, str | None]) -> tuple[tuple[int, str], ...] | None:
    """``(position, name)`` of the arguments annotated ``Tensor(a!)`` in the overloads a node
    named ``names`` may call, ``out=`` forms left out unless named (an explicit
    ``aten.topk.values`` call writes its ``values=`` and ``indices=``); None where the op has no
    overload (unknown). Cached per op name."""
    try:
        return _WRITTEN[names]
    except KeyError:
        pass
    overloads = _overloads(names)
    found: dict[tuple[int, str], None] | None = {} if overloads else None
    for op in overloads:
        arguments = op._schema.arguments
        # an out= form writes only where the call names it (``aten.sort.values(x, values=a)``):
        # a torch function or a packet calling the functional form writes nothing of these
        if names[1] is None and any(a.is_out for a in arguments):
            continue
        for i, argument in enumerate(arguments):
            alias = argument.alias_info
            if alias is not None and alias.is_write:
                found[(i, argument.name)] = None
    positions = _WRITTEN[names] = tuple(found) if found is not None else None
    return positions


def _flat_nodes(value: Any) -> list[Node]:
    """The nodes in an argument value (a node, or a list or tuple of them)."""
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, Node)]
    return []


class _Ops(TorchDispatchMode):
    """Records the aten ops dispatched under it."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _method_writes(node: Node) -> bool:
    """Whether a Tensor method without arguments may write: the aten ops it dispatches to
    (:func:`_method_ops`), from their schemas. Unknown: it may."""
    ops = _method_ops(node)
    return ops is None or any(op._schema.is_mutable for op in ops)


def _method_ops(node: Node) -> list | None:
    """The ops a Tensor method without arguments dispatches to on an empty meta tensor of the
    node's dtype; None where that is unknown (it takes arguments, the call fails)."""
    if node.op != "call_method" or len(node.args) != 1 or node.kwargs:
        return None
    value = node.args[0].meta.get("example_value") if isinstance(node.args[0], Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    mode = _Ops()
    try:
        with unset_fake_temporarily(), mode:
            getattr(torch.empty(0, dtype=value.dtype, device="meta"), node.target)()
    except Exception:  # any failure leaves the answer unknown
        return None
    return mode.ops


def is_random(node: Node) -> bool:
    """Whether the node's op draws random numbers: an overload of its op carries
    ``torch.Tag.nondeterministic_seeded`` (``rand_like``, ``dropout``, ``bernoulli``, ...) and
    the call does not switch drawing off (dropout in eval mode returns its input). Python
    operators (``x * y``, ``x[i]``) never draw."""
    if node.op not in ("call_function", "call_method"):
        return False
    if getattr(node.target, "__module__", None) == "_operator":
        return False
    return _facts(node).random and not _evaluating(node)


def _evaluating(node: Node) -> bool:
    """A seeded op told by its schema's ``train`` / ``training`` argument not to draw (dropout
    in eval mode returns its input)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
    schema = getattr(target, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.name in ("train", "training"):
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                return value is False
    # torch.nn.functional.dropout and friends: the Python signature names it ``training``
    try:
        bound = inspect.signature(target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a builtin without a signature, a call_method name
        return node.kwargs.get("training", node.kwargs.get("train")) is False
    bound.apply_defaults()
    arguments = bound.arguments
    return arguments.get("training", arguments.get("train")) is False


def generators(nodes, device: str) -> tuple:
    """The generators on ``device`` (a device type) other than the default ones that ``nodes``
    pass to their ops."""
    found: dict[int, torch.Generator] = {}
    for node in nodes:
        for value in tree_leaves((node.args, node.kwargs)):
            if isinstance(value, torch.Generator) and value.device.type == device:
                found.setdefault(id(value), value)
    return tuple(found.values())


def writes_unseen(nodes) -> bool:
    """Whether an eager piece of ``nodes`` may write a caller's tensor where its version counter
    does not see it (a custom op refilling a staging tensor through ``.data``, a write through
    another tensor over its memory): anything but ops of torch's own
    (:func:`is_torch_op`, whose in-place writes bump the version counter
    of what they write, and of its views) and indexing, or an in-place layout change of torch's
    (``set_``: the tensor then writes memory of another with a counter of its own)."""
    calls = ("call_function", "call_method", "call_module")
    return any(
        n.op in calls
        and n.target is not operator.getitem
        and (not is_torch_op(n) or changes_layout(n))
        for n in nodes
    )
