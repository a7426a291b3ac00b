"""Attention written as ops: a softmax between two contractions of activations, found in the graph.

Models that call no attention op (transformers' ``attn_implementation="eager"``, GPT-2's and
Bloom's own code) compute ``softmax(q @ k^T * scale + mask) @ v`` with plain ops; in a decode
step the step-sizes pass makes that work eager through the growing KV length, but in a prefill
nothing would, and attention would be captured while the runner says it runs eagerly.

The rule, from the definition of dot-product attention (Vaswani et al. 2017, eq. 1)::

    weights = softmax(scores(q, k))          (scaled, masked, sinks joined on the way)
    out     = contract(weights, v)           (the weights maybe cast, masked or dropped out)

is attention where all three hold:

- **scores**: a contraction of two operands that both derive from activations. A contraction
  is a product summed over a shared dim: ``matmul`` (``q @ k^T``), ``mm``, ``bmm``,
  ``baddbmm`` (its two batches; the first argument is an added bias, as Bloom's ALiBi),
  ``einsum`` of two or more operands, ``linear``, or a broadcast product summed
  (``(q[..., :, None, :] * k[..., None, :, :]).sum(-1)``: the multiplications and the sum);
- **softmax**: ``softmax`` itself, or written out: ``exp(s) / exp(s).sum(d)`` (the max
  subtracted from ``s`` first or not), ``log_softmax(s).exp()``, ``exp(s - logsumexp(s))``;
- **values**: the weights are a factor of a contraction whose other factor derives from
  activations.

*Derives from activations*: computed from a graph input that is not the model's state. The
model's state is its parameters, and its buffers the graph does not write (a KV cache kept in a
buffer and written in the step holds activations; one handed in as an argument is an activation
too); whatever is computed from state alone is state (a dequantised int8 weight, a projection
of learned queries, a parameter expanded to an activation's shape: sizes carry no values). So
these are not attention: a softmax over a router's or a codebook's
logits (one operand is the model's state), over products of dequantised weights, a softmax
gating activations with no second activation in its scores (a mixture's weights over experts,
attention pooling by a learned query), cross-attention from learned queries (the queries are
state, like a router's weights), and a softmax of activation scores weighting a parameter.
A model that wants one of those run eagerly marks it with :func:`fxsplit.region`.

The region is every node on a path of tensors from a scores contraction to the last values
contraction, both included: the scale, the mask's addition, the softmax and its max, sum and
casts, and attention sinks joined to the scores and sliced off again. The mask's own making
(also one made to the scores' sizes, which a dynamic graph may read off the scores), the
projections and the operands' reshaping before a contraction stay where they are.

Between a contraction and the softmax the walk keeps to nodes holding as many elements as the
softmax does (a cast, a scale, a mask's addition, a view of the scores) and ends at the first
contraction it meets, so a router's softmax never reaches back to the attention of the layer
before it, nor a softmax forward into the next layer's products.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxsplit.facts.op_facts import is_view, written_arguments
from fxsplit.facts.ops import op_names

__all__ = ["find"]

# Products summed over a shared dim, as aten names them (``x @ y`` is ``aten::matmul``), with
# the schema names of their factors (None: every tensor after einsum's equation), which a call
# may pass by position or by keyword (Bloom: ``alibi.baddbmm(batch1=q, batch2=k, ...)``). No
# tag or schema says "contraction"; each of these runs a kernel torch's FLOP counter counts as
# one (``torch.utils.flop_counter``: mm, bmm, baddbmm, addmm; tests/test_attention_pattern.py).
_CONTRACTIONS: dict[str, tuple[str, ...] | None] = {
    "aten::matmul": ("self", "other"),
    "aten::mm": ("self", "mat2"),
    "aten::bmm": ("self", "mat2"),
    "aten::baddbmm": ("batch1", "batch2"),
    "aten::linear": ("input", "weight"),
    "aten::einsum": None,
}
_SOFTMAX = frozenset({"aten::softmax", "aten::_softmax", "aten::special_softmax"})
_LOG_SOFTMAX = frozenset({"aten::log_softmax", "aten::_log_softmax", "aten::special_log_softmax"})
_JOINS = frozenset({"aten::cat", "aten::getitem", "aten::slice", "aten::narrow"})


@dataclass(frozen=True)
class _Contraction:
    """One contraction: ``end`` computes its result; ``nodes`` are its own nodes (``end``, and
    for a product summed its multiplications); ``factors`` are the tensors multiplied."""

    end: Node
    nodes: frozenset[Node]
    factors: tuple[Node, ...]


def find(graph: Graph) -> set[Node]:
    """The nodes of every attention written as ops in ``graph`` (the rule and the region: the
    module docstring).

    Args:
        graph: a Dynamo graph (``example_value`` on its nodes; where a node has none its size is
            unknown and no softmax is found through it; placeholders' ``grapharg`` sources tell
            parameters and buffers apart from the caller's tensors).

    Returns:
        The region's nodes (never placeholders); empty where there is no attention.
    """
    found: set[Node] = set()
    order = {node: i for i, node in enumerate(graph.nodes)}
    activations: set[Node] | None = None
    for node in graph.nodes:
        if not _is_softmax(node):
            continue
        size = _numel(node)
        if size is None:
            continue
        if activations is None:  # only graphs with a softmax pay for it
            activations = _activations(graph)
        scores = _scores(node, size, activations)
        if not scores:
            continue
        values = _values(node, size, activations)
        if not values:
            continue
        last = max((c.end for c in values), key=order.__getitem__)
        found |= _between({n for c in scores for n in c.nodes}, last, order)
    return found


# --------------------------------------------------------------------------------------------
# What the softmax and the contractions look like
# --------------------------------------------------------------------------------------------


def _is_softmax(node: Node) -> bool:
    """Whether ``node`` computes a softmax: the op, or written out (the module docstring)."""
    name = _name(node)
    if name in _SOFTMAX:
        return True
    if name == "aten::exp":
        if len(node.all_input_nodes) != 1:  # ``torch.exp(x, out=y)``
            return False
        (inner,) = node.all_input_nodes
        if _name(inner) in _LOG_SOFTMAX:
            return True
        if _name(inner) == "aten::sub":
            subtrahend = _argument(inner, "aten::sub", "other")
            return (
                isinstance(subtrahend, Node)
                and _name(subtrahend) == "aten::logsumexp"
                and _argument(subtrahend, "aten::logsumexp", "self")
                is _argument(inner, "aten::sub", "self")
            )
        return False
    if name == "aten::div":
        numerator = _argument(node, "aten::div", "self")
        denominator = _argument(node, "aten::div", "other")
        if not (isinstance(numerator, Node) and isinstance(denominator, Node)):
            return False
        while is_view(denominator) and denominator.args:  # ``e / e.sum(-1)[..., None]``
            denominator = denominator.args[0]
            if not isinstance(denominator, Node):
                return False
        return (
            _name(numerator) == "aten::exp"
            and _name(denominator) == "aten::sum"
            and _argument(denominator, "aten::sum", "self") is numerator
        )
    return False


def _contraction(node: Node) -> _Contraction | None:
    """The contraction ``node`` ends, if it ends one: a contraction op, or a sum whose input is
    a product of two or more tensors (``(q * k).sum(-1)``)."""
    name = _name(node)
    if name in _CONTRACTIONS:
        names = _CONTRACTIONS[name]
        if names is None:  # einsum(equation, a, b, ...) or einsum(equation, [a, b, ...])
            operands = node.args[1:]
            if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
                operands = operands[0]
        else:
            operands = [_argument(node, name, argument) for argument in names]
        factors = tuple(a for a in operands if _is_tensor(a))
        return _Contraction(node, frozenset({node}), factors) if len(factors) >= 2 else None
    if name == "aten::sum" and _is_product(summed := _argument(node, "aten::sum", "self")):
        products, factors = _product(summed)
        if len(factors) >= 2:
            return _Contraction(node, frozenset({node, *products}), factors)
    return None


def _argument(node: Node, op: str, argument: str) -> object:
    """The value ``node`` passes for its op's schema argument ``argument``, by position or by
    keyword (torch's functions name the schema's ``self`` ``input``)."""
    position = _positions(op)[argument]
    if position < len(node.args):
        return node.args[position]
    if argument in node.kwargs:
        return node.kwargs[argument]
    return node.kwargs.get("input") if argument == "self" else None


@functools.cache
def _positions(op: str) -> dict[str, int]:
    """Each argument's position in the schemas of ``op`` (``"ns::name"``), from the first of its
    overloads that has an argument of that name."""
    namespace, _, name = op.partition("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    found: dict[str, int] = {}
    for overload in packet.overloads():
        for i, argument in enumerate(getattr(packet, overload)._schema.arguments):
            found.setdefault(argument.name, i)
    return found


def _product(root: Node) -> tuple[set[Node], tuple[Node, ...]]:
    """The multiplications of the product ``root`` (``root``, and those of its tensor operands
    that are products used by nothing else: ``q * k * scale``) and the tensors they multiply."""
    products: set[Node] = set()
    factors: list[Node] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node is root or (_is_product(node) and len(node.users) == 1):
            products.add(node)
            stack.extend(reversed(node.all_input_nodes))
        elif _is_tensor(node):
            factors.append(node)
    return products, tuple(factors)


def _is_product(node: object) -> bool:
    return isinstance(node, Node) and _name(node) == "aten::mul"


def _value_contraction(node: Node, source: Node) -> _Contraction | None:
    """The contraction that ``node``, reached from ``source`` on the way down from a softmax,
    takes ``source`` into: ``node`` itself, or, where ``node`` is a multiplication, the sum of
    the product it is part of (the product may hold more elements than the weights: they are
    broadcast against the values)."""
    if not _is_product(node):
        found = _contraction(node)
        return found if found is not None and source in found.factors else None
    root = node
    while len(root.users) == 1 and _is_product(next(iter(root.users))):
        root = next(iter(root.users))
    for user in root.users:
        if _name(user) == "aten::sum" and _argument(user, "aten::sum", "self") is root:
            found = _contraction(user)
            if found is not None and node in found.nodes:
                return found
    return None


# --------------------------------------------------------------------------------------------
# Walking from the softmax
# --------------------------------------------------------------------------------------------


def _scores(softmax: Node, size: str, activations: set[Node]) -> list[_Contraction]:
    """The contractions of two activations that make the softmax's scores: found upstream
    through nodes of ``size`` elements (past a join of the keys' dim, of the size the join's
    other side has); any contraction ends a path."""
    found: list[_Contraction] = []
    seen: set[Node] = set()

    def visit(node: Node, size: str | None) -> None:
        if node in seen or node.op in ("placeholder", "get_attr", "output"):
            return
        seen.add(node)
        if size is None:  # past a join of the keys' dim: any length of it
            if not _leading_match(node, softmax):
                return
            size = _numel(node)
        if node is not softmax:
            contraction = _contraction(node)
            if contraction is not None:
                if _numel(node) == size and sum(f in activations for f in contraction.factors) >= 2:
                    found.append(contraction)
                return
        joined = node is not softmax and _joins_keys(node, softmax)
        if node is not softmax and _numel(node) != size and not joined:
            return
        for other in node.all_input_nodes:
            visit(other, None if joined else size)

    visit(softmax, size)
    return found


def _values(softmax: Node, size: str, activations: set[Node]) -> list[_Contraction]:
    """The contractions that take the softmax's weights as a factor beside a factor derived
    from activations: found downstream through nodes of ``size`` elements (and joins, as
    :func:`_scores`); any contraction ends a path."""
    found: list[_Contraction] = []
    seen: set[Node] = set()

    def visit(node: Node, source: Node | None, size: str | None) -> None:
        if node in seen or node.op in ("placeholder", "get_attr", "output"):
            return
        seen.add(node)
        if size is None:
            if not _leading_match(node, softmax):
                return
            size = _numel(node)
        if source is not None:
            contraction = _value_contraction(node, source)
            if contraction is not None:
                others = [f for f in contraction.factors if f is not source]
                if len(others) < len(contraction.factors) and any(f in activations for f in others):
                    found.append(contraction)
                return
            if _contraction(node) is not None:  # a contraction the weights are no factor of
                return
        joined = node is not softmax and _joins_keys(node, softmax)
        if node is not softmax and _numel(node) != size and not joined:
            return
        for user in list(node.users):
            visit(user, node, None if joined else size)

    visit(softmax, None, size)
    return found


def _between(starts: set[Node], last: Node, order: dict[Node, int]) -> set[Node]:
    """Every node on a path of tensors from one of ``starts`` to ``last`` (both included): what
    the scores need besides the scores themselves (a max subtracted for stability, a softmax's
    sum) stays in the region, so no captured piece of one op sits inside attention. A size read
    off the scores is no such path: a mask made to the scores' shape (``torch.ones(s.shape)``)
    is the mask's making, whether the shape is a number or, in a dynamic graph, a symbol."""
    end = order[last]
    reached = set(starts)
    stack = list(starts)
    while stack:
        for user in stack.pop().users:
            if user not in reached and order.get(user, end + 1) <= end and _holds_tensors(user):
                reached.add(user)
                stack.append(user)
    on_path = {last}
    for node in sorted(reached, key=order.__getitem__, reverse=True):
        if any(u in on_path for u in node.users):
            on_path.add(node)
    return on_path


def _joins_keys(node: Node, softmax: Node) -> bool:
    """A concatenation or slice keeping the scores' leading dims (attention sinks: a logit per
    head joined to the scores before the softmax, sliced off after it)."""
    return _name(node) in _JOINS and _leading_match(node, softmax)


def _leading_match(node: Node, softmax: Node) -> bool:
    """Whether the node's tensor has the softmax's rank and all but its last dim."""
    value, scores = node.meta.get("example_value"), softmax.meta.get("example_value")
    return (
        isinstance(value, torch.Tensor)
        and isinstance(scores, torch.Tensor)
        and value.dim() == scores.dim()
        and str(tuple(value.shape[:-1])) == str(tuple(scores.shape[:-1]))
    )


def _numel(node: Node) -> str | None:
    """The number of elements of the node's tensor, as text (a symbolic count is compared by
    its expression: comparing SymInts would add guards to Dynamo's shape environment)."""
    value = node.meta.get("example_value")
    return str(value.numel()) if isinstance(value, torch.Tensor) else None


def _holds_tensors(node: Node) -> bool:
    """A tensor, or a tuple of them (``max`` with a dim gives values and indices)."""
    value = node.meta.get("example_value")
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def _is_tensor(value: object) -> bool:
    return isinstance(value, Node) and isinstance(value.meta.get("example_value"), torch.Tensor)


# --------------------------------------------------------------------------------------------
# Where values come from
# --------------------------------------------------------------------------------------------


def _activations(graph: Graph) -> set[Node]:
    """The graph's tensors whose value derives from an activation: a tensor input other than
    the model's state (:func:`_is_state`, less the buffers the graph writes), and every tensor
    computed from one. Sizes carry no values: a parameter expanded to an activation's shape
    (``w.expand(x.shape)``, whose sizes a dynamic graph reads off ``x`` as symbols) is still
    the model's state."""
    written: set[Node] = set()
    for node in graph.nodes:
        for target in written_arguments(node):
            while is_view(target) and target.args and isinstance(target.args[0], Node):
                target = target.args[0]  # a write through a view writes its base
            written.add(target)
    found: set[Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            tensor = isinstance(node.meta.get("example_value"), torch.Tensor)
            if tensor and (node in written or not _is_state(node)):
                found.add(node)
        elif (
            node.op in ("call_function", "call_method")
            and _holds_tensors(node)
            and any(a in found for a in node.all_input_nodes)
        ):
            found.add(node)
    return found


def _is_state(node: Node) -> bool:
    """A parameter or buffer of the model: a module attribute (``get_attr``), a placeholder
    Dynamo lifted from a module's ``_parameters`` or ``_buffers`` (its source says so), or a
    parameter handed in as an argument."""
    if node.op == "get_attr":
        return True
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    while source is not None:
        if getattr(source, "member", None) in ("_parameters", "_buffers"):
            return True
        source = getattr(source, "base", None)
    try:  # the example is a weak reference Dynamo may have let go of
        return isinstance(getattr(grapharg, "example", None), torch.nn.Parameter)
    except Exception:
        return False


def _name(node: Node) -> str | None:
    if node.op not in ("call_function", "call_method"):
        return None
    names = op_names(node)
    return names[0] if names is not None else None
