"""Op names of FX nodes and of dispatched ops, and the configured splitting ops they match.

Names take the dispatcher's form ``"ns::op"`` or ``"ns::op.overload"``. A Dynamo graph holds the
same aten op in three shapes: an OpOverload/OpOverloadPacket target (``torch.ops.aten.topk``), a
torch-level function (``torch.topk``, ``torch._C._nn.linear``) and a Tensor method
(``x.topk(...)``, a ``call_method`` node). All three are named ``"aten::topk"`` here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch.fx import Node

_OP_NAME = re.compile(r"^([A-Za-z_]\w*)::([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?$")


def parse_op_name(name: str) -> tuple[str, str, str | None]:
    """Split ``"ns::op"`` / ``"ns::op.overload"`` into ``(ns, op, overload or None)``.

    Raises:
        ValueError: ``name`` is not of that form (the message shows the form expected).
    """
    match = _OP_NAME.match(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(
            f"malformed op name {name!r}; expected 'namespace::op' or 'namespace::op.overload', "
            "e.g. 'aten::topk' or 'mylib::attention.default'"
        )
    return match.group(1), match.group(2), match.group(3)


def op_names(node: Node) -> tuple[str, str | None] | None:
    """``("ns::op", overload)`` for a call node, overload None when the target names no overload.

    OpOverloadPacket targets, torch-level functions and Tensor methods have no overload; an
    OpOverload's default overload is ``"default"``. A Python operator on tensors (``x * 0.5``
    is recorded as ``operator.mul``, ``x[1:]`` as ``operator.getitem``) is named after the aten
    op it dispatches to (see :func:`operator_op`). Returns None for nodes that are not ops
    (placeholders, outputs, Python operators on non-tensors).
    """
    try:
        return node.meta[_NAMES_KEY]
    except KeyError:
        names = node.meta[_NAMES_KEY] = _op_names(node)
        return names


# Every pass asks; the answer depends only on the node's op, target and argument kinds, which
# no pass changes after the split starts.
_NAMES_KEY = "fxsplit.op_names"


def _op_names(node: Node) -> tuple[str, str | None] | None:
    target = node.target
    if node.op == "call_method":
        if target.startswith("__") and target.endswith("__"):
            # x.__eq__(y), x.__rmul__(2): the aten op of the operator's name, where aten has one
            name = target.strip("_")
            for candidate in (name, name[1:] if name.startswith("r") else None):
                if candidate and _takes_tensors(candidate):
                    return f"aten::{candidate}", None
        return f"aten::{target}", None
    if node.op != "call_function":
        return None
    if getattr(target, "__module__", None) == "_operator":
        name = operator_op(node)
        return None if name is None else (name, None)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name, target._overloadname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name, None
    if isinstance(target, torch._ops.HigherOrderOperator):  # e.g. higher_order::flex_attention
        return f"{target.namespace}::{target.name()}", None
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None)
    # torch's own modules only: ``torchvision``, ``torchao`` or a user's ``torchext`` run code
    # of their own under an aten-like name
    torch_module = module == "torch" or module.startswith("torch.")
    if name and torch_module and not module.startswith("torch.fx"):
        return f"aten::{name}", None
    return None


_OPERATOR_OPS: dict[tuple, str | None] = {}


def _kind(value: object) -> object:
    if isinstance(value, Node):
        value = value.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_kind(v) for v in value))
    return type(value).__name__


def operator_op(node: Node) -> str | None:
    """The aten op (``"ns::op"``) a Python-operator node on tensors stands for: the aten op of
    the operator's own name where aten has one (``operator.matmul`` is ``aten::matmul``, which
    dispatch would only show decomposed), else the op it dispatches to, found by running the
    operator once on fake tensors shaped like its arguments under a dispatch mode that records
    the first op (``operator.truediv`` is ``aten::div``, ``x[idx]`` is ``aten::index``). None
    when no argument is a tensor (``operator.add`` of two SymInts) or nothing dispatches. Cached
    per operator and argument kinds (types, dtypes, ranks)."""
    key = (node.target, tuple(_kind(a) for a in node.args))
    try:
        return _OPERATOR_OPS[key]
    except KeyError:
        pass
    if not any(isinstance(k, tuple) and k[0] == "tensor" for k in key[1]):
        found = None
    elif _takes_tensors(node.target.__name__):
        found = f"aten::{node.target.__name__}"
    else:
        found = _dispatch_first(node)
    _OPERATOR_OPS[key] = found
    return found


def _takes_tensors(name: str) -> bool:
    """Whether aten has an op of this name with an overload whose first argument is a Tensor
    (``aten::floordiv`` exists, for ints only)."""
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(
        (args := getattr(packet, overload)._schema.arguments)
        and isinstance(args[0].type, torch.TensorType)
        for overload in packet.overloads()
    )


def _dispatch_first(node: Node) -> str | None:
    from torch._guards import detect_fake_mode
    from torch.utils._python_dispatch import TorchDispatchMode

    tensors = [
        v
        for a in node.all_input_nodes
        if isinstance(v := a.meta.get("example_value"), torch.Tensor)
    ]
    if not tensors:
        return None
    fake_mode = detect_fake_mode(tensors)
    if fake_mode is None:
        return None
    seen: list[str] = []

    class _First(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not seen and func.namespace != "prim":  # prim:: ops are metadata queries
                seen.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    def fresh(a):
        value = a.meta.get("example_value")
        if isinstance(value, torch.Tensor):  # own storage: in-place operators write nothing
            return torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device=value.device
            )
        return value

    try:
        with fake_mode:
            args = torch.fx.node.map_arg(node.args, fresh)
            with _First():
                node.target(*args)
    except Exception:  # an operator the fake run cannot take: no name rather than a wrong one
        return None
    return seen[0] if seen else None


def dispatched_op_name(func: object) -> str:
    """The name of an op as the dispatcher runs it: ``"ns::op"`` or ``"ns::op.overload"``
    (``"higher_order::cond"`` for a higher-order op, ``str(func)`` for anything else)."""
    if isinstance(func, torch._ops.HigherOrderOperator):
        return f"higher_order::{func.name()}"
    schema = getattr(func, "_schema", None)
    if schema is None:
        return str(func)
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else str(schema.name)


def op_name(node: Node) -> str | None:
    """The node's op name, ``"ns::op"`` or ``"ns::op.overload"``; None if it is not an op."""
    names = op_names(node)
    if names is None:
        return None
    base, overload = names
    return base if overload in (None, "default") else f"{base}.{overload}"


class OpMatcher:
    """Matches nodes against configured op names (``splitting_ops``).

    ``"ns::op"`` matches every overload of the op; ``"ns::op.overload"`` matches that overload,
    and a target that names no overload (a packet, a torch function, a Tensor method) matches
    every configured overload of its op. Results are cached per target.

    Raises:
        ValueError: a malformed name (see :func:`parse_op_name`).
    """

    def __init__(self, names: Iterable[str]):
        self._by_op: dict[str, list[tuple[str | None, str]]] = {}
        for name in names:
            ns, op, overload = parse_op_name(name)
            self._by_op.setdefault(f"{ns}::{op}", []).append((overload, name))
        self._cache: dict[object, str | None] = {}
        self._by_names: dict[tuple[str, str | None], str | None] = {}
        self.used: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._by_op)

    @property
    def names(self) -> list[str]:
        """Every configured name."""
        return [name for entries in self._by_op.values() for _, name in entries]

    def match(self, node: Node) -> str | None:
        """The configured name ``node`` matches, or None."""
        if getattr(node.target, "__module__", None) == "_operator":
            return self._match(node)  # named per argument kinds, see operator_op
        key = (node.op, node.target)
        try:
            return self._cache[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable target: match without caching
            return self._match(node)
        found = self._cache[key] = self._match(node)
        return found

    def _match(self, node: Node) -> str | None:
        names = op_names(node)
        if names is None:
            return None
        try:  # operators are named per argument kinds: cache by the name found
            return self._by_names[names]
        except KeyError:
            found = self._by_names[names] = self._match_names(names)
            return found

    def _match_names(self, names: tuple[str, str | None]) -> str | None:
        base, overload = names
        hits = [
            name
            for wanted, name in self._by_op.get(base, ())
            if wanted is None or overload is None or wanted == overload
        ]
        self.used.update(hits)
        return hits[0] if hits else None
