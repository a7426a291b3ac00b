"""Input binding: what each input of a captured piece is, and what a changed address gets.

A captured graph reads its inputs at the addresses seen at capture. Each input of a captured
piece is one of:

- ``PARAM``: a parameter or buffer (Dynamo's static inputs). Never copied; its address is checked
  once per step against the capture, and a change recaptures (``load_state_dict(assign=True)``
  moves weights without any recompile).
- ``RUNNER``: a graph input the runner hands in each step. A changed address gets the
  ``input_binding`` option: ``"copy"`` into fxsplit's static buffer, ``"strict"`` raises
  :class:`BindingError`, ``"trust"`` is not checked at all (unsafe: what engines do in production).
  With a runner that declares persistent inputs, the caller's tensor itself is the static buffer.
- ``INTERNAL``: a value produced by an earlier piece. Always bound by fxsplit: copied into the
  static buffer unless it already lives there (an earlier captured piece's static output, or an
  eager op that wrote in place into that buffer).
- ``HOST``: a Python int/float/bool or SymInt. Part of the capture key; a replay freezes it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from fxsplit.passes.ops import op_names

PARAM, RUNNER, INTERNAL, HOST = "param", "runner", "internal", "host"

_VIEW_METHODS = frozenset(
    {
        "view", "view_as", "reshape", "unsqueeze", "squeeze", "permute", "transpose", "t",
        "expand", "narrow", "select", "flatten", "unflatten", "as_strided", "detach", "movedim",
        "contiguous", "split", "chunk", "unbind", "diagonal",
    }
)  # fmt: skip


class BindingError(RuntimeError):
    """A runner input of a captured piece moved under ``input_binding="strict"``."""


@dataclass(frozen=True)
class InputSpec:
    """One input of a captured piece.

    Attributes:
        name: the value's node name.
        source: where it comes from: Dynamo's source for graph inputs (e.g. ``L['positions']``),
            else ``"<piece> output"``.
        kind: ``PARAM``, ``RUNNER``, ``INTERNAL`` or ``HOST``.
        symbolic: a tensor with a symbolic (dynamic) dimension: its shape is part of the key.
        mutated: the piece writes into it in place.
    """

    name: str
    source: str
    kind: str
    symbolic: bool = False
    mutated: bool = False


def _is_static_input(node: Node) -> bool:
    if "_dynamo_static_input_type" in node.meta.get("tensor_dict", {}):
        return True
    example = getattr(node.meta.get("grapharg"), "example", None)
    return isinstance(example, torch.nn.Parameter)


def _written(node: Node) -> list[Node]:
    """Nodes ``node`` writes into in place."""
    target = node.target
    if node.op == "call_method":
        name = target
        if name.endswith("_") and not name.endswith("__"):
            return [a for a in node.args[:1] if isinstance(a, Node)]
        return []
    if node.op != "call_function":
        return []
    if target is operator.setitem:
        return [node.args[0]] if isinstance(node.args[0], Node) else []
    written = [v for k, v in node.kwargs.items() if k == "out" and isinstance(v, Node)]
    if isinstance(target, torch._ops.OpOverload):
        for arg, value in zip(target._schema.arguments, node.args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, Node):
                written.append(value)
        return written
    names = op_names(node)
    if names is not None and names[0].endswith("_") and not names[0].endswith("__"):
        written += [a for a in node.args[:1] if isinstance(a, Node)]
    return written


def _base(node: Node, inputs: set[Node]) -> Node | None:
    """Follow views back to a piece input (None when the chain starts inside the piece)."""
    seen = 0
    while node not in inputs and seen < 64:
        seen += 1
        if (node.op == "call_method" and node.target in _VIEW_METHODS) or (
            node.op == "call_function" and node.target is operator.getitem
        ):
            node = node.args[0]
        else:
            names = op_names(node)
            if names is None or names[0][6:] not in _VIEW_METHODS or not node.args:
                return None
            node = node.args[0]
        if not isinstance(node, Node):
            return None
    return node if node in inputs else None


def key_reads(specs: list[InputSpec], inputs: list[Node]) -> tuple[tuple[int, int | None], ...]:
    """What a capture key reads: ``(i, None)`` for a host value, ``(i, d)`` for dim ``d`` of
    tensor input ``i``, one per distinct symbolic size expression.

    Every dynamic dim of every tensor input is one of these expressions, so equal keys mean equal
    input shapes; reading each expression once keeps the key short (usually one int: the token
    count).
    """
    reads: list[tuple[int, int | None]] = []
    seen: set[object] = set()
    for i, (spec, node) in enumerate(zip(specs, inputs, strict=True)):
        if spec.kind == HOST:
            reads.append((i, None))
            continue
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            if spec.symbolic:
                reads.append((i, -1))  # no traced shape: key on the whole shape
            continue
        for d, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if expr not in seen:
                    seen.add(expr)
                    reads.append((i, d))
    return tuple(reads)


def classify(nodes: list[Node], inputs: list[Node], producer: dict[Node, str]) -> list[InputSpec]:
    """Describe each input of a captured piece.

    Args:
        nodes: the piece's nodes, in order.
        inputs: the piece's input nodes, in call order.
        producer: for values produced by earlier pieces, that piece's name.
    """
    input_set = set(inputs)
    mutated = set()
    for node in nodes:
        for target in _written(node):
            base = _base(target, input_set)
            if base is not None:
                mutated.add(base)
    specs = []
    for node in inputs:
        value = node.meta.get("example_value")
        is_tensor = isinstance(value, torch.Tensor)
        symbolic = is_tensor and any(isinstance(d, torch.SymInt) for d in value.shape)
        if node.op == "placeholder":
            grapharg = node.meta.get("grapharg")
            source = grapharg.source.name if grapharg is not None else node.target
            kind = HOST if not is_tensor else PARAM if _is_static_input(node) else RUNNER
        elif node in producer:
            source = f"{producer[node]} output"
            kind = INTERNAL if is_tensor or value is None else HOST
        else:
            source = "graph input"
            kind = HOST if not is_tensor else RUNNER
        if kind == INTERNAL and value is None:
            # No traced value (a plain torch.fx graph): treat as a tensor and bind at run time.
            symbolic = True
        specs.append(InputSpec(node.name, str(source), kind, symbolic, node in mutated))
    return specs
