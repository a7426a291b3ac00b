"""Attention written as ops: the two batched matmuls around a softmax, found in the graph.

Models that call no attention op (transformers' ``attn_implementation="eager"``, GPT-2's and
Bloom's own code) compute ``softmax(q @ k^T * scale + mask) @ v`` with plain ops; in a decode
step the step-sizes pass makes that work eager through the growing KV length, but in a prefill
nothing would, and attention would be captured while the runner says it runs eagerly.

The pattern is the definition of dot-product attention (Vaswani et al. 2017, eq. 1): a softmax
whose input is computed from a matmul of two activations (the scores) and whose output, maybe
cast, masked or dropped out on the way, is an operand of a second matmul of activations (the
weighted values). The region is every node on a path from the first matmul to the second, both
included: the scale, the mask's addition, the softmax and its casts, and attention sinks
joined to the scores and sliced off again. The mask's own making and
the projections stay where they are. A matmul with a parameter (``x @ self.w``) is a
projection, not attention.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from fxsplit.facts.ops import op_names

__all__ = ["find"]

# Batched products of two activations, as aten names them (``x @ y`` is ``aten::matmul``).
_PRODUCTS = frozenset({"aten::matmul", "aten::bmm", "aten::baddbmm", "aten::einsum"})
_SOFTMAX = frozenset({"aten::softmax", "aten::_softmax", "aten::special_softmax"})
_JOINS = frozenset({"aten::cat", "aten::getitem", "aten::slice", "aten::narrow"})


def find(graph: Graph) -> set[Node]:
    """The nodes of every ``matmul -> ... -> softmax -> ... -> matmul`` chain of ``graph``
    (see the module docstring); empty where there is none.

    The paths go through the scores only: every node between a product and the softmax holds
    as many elements as the softmax does (a cast, a scale, a mask's addition, a view of the
    scores), so a router's softmax over a projection's logits never reaches back to the
    attention of the layer before it.
    """
    found: set[Node] = set()
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if _name(node) not in _SOFTMAX:
            continue
        size = _numel(node)
        if size is None:
            continue
        up, scores = _reach(node, size, up=True)
        down, weighted = _reach(node, size, up=False)
        if up and down:
            first = min((n for n in scores if _is_product(n)), key=order.__getitem__)
            last = max((n for n in weighted if _is_product(n)), key=order.__getitem__)
            found |= _between(first, last, order)
    return found


def _between(first: Node, last: Node, order: dict[Node, int]) -> set[Node]:
    """Every node on a path from ``first`` to ``last`` (both included): what the scores need
    besides the scores themselves (a max subtracted for stability) stays in the region, so
    no captured piece of one op sits inside attention."""
    reached = _descendants(first, order[last], order) | {first}
    on_path = {last}
    for node in sorted(reached, key=order.__getitem__, reverse=True):
        if any(u in on_path for u in node.users):
            on_path.add(node)
    return on_path


def _descendants(first: Node, end: int, order: dict[Node, int]) -> set[Node]:
    """The nodes reachable from ``first`` that come no later than graph position ``end``."""
    seen: set[Node] = set()
    stack = [first]
    while stack:
        for user in stack.pop().users:
            if user not in seen and order.get(user, end + 1) <= end:
                seen.add(user)
                stack.append(user)
    return seen


def _reach(softmax: Node, size: str, up: bool) -> tuple[bool, set[Node]]:
    """From the softmax, through nodes of ``size`` elements (past a join of the keys' dim, of
    the size the join's other side has), whether a product of activations is reached
    upstream (``up``: it makes the scores, so it has their size) or downstream (it takes the
    weights), and the nodes on the paths to the products found (products included)."""
    seen: dict[Node, bool] = {}  # node -> whether a product lies on or beyond it

    def visit(node: Node, size: str | None) -> bool:
        if node in seen:
            return seen[node]
        seen[node] = False
        if size is None:  # past a join of the keys' dim: any length of it
            if not _leading_match(node, softmax):
                return False
            size = _numel(node)
        if node is not softmax and _is_product(node) and (not up or _numel(node) == size):
            seen[node] = True
            return True
        joined = node is not softmax and _joins_keys(node, softmax)
        if node is not softmax and _numel(node) != size and not joined:
            return False
        hit = False
        for other in node.all_input_nodes if up else list(node.users):
            if other.op not in ("placeholder", "get_attr", "output"):
                hit |= visit(other, None if joined else size)
        seen[node] = hit
        return hit

    visit(softmax, size)
    return seen[softmax], {n for n, hit in seen.items() if hit and n is not softmax}


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


def _is_product(node: Node) -> bool:
    return _name(node) in _PRODUCTS and not any(_is_weight(a) for a in node.all_input_nodes)


# Ops that only change a tensor's layout or dtype: a weight through them is still a weight.
_LAYOUT = frozenset(
    f"aten::{name}"
    for name in (
        "t",
        "transpose",
        "permute",
        "view",
        "reshape",
        "expand",
        "expand_as",
        "contiguous",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "to",
        "float",
        "half",
        "bfloat16",
        "type_as",
        "numpy_T",
        "mT",
        "adjoint",
        "detach",
        "clone",
    )
)


def _is_weight(node: Node) -> bool:
    """A parameter or module constant (Dynamo lifts parameters to placeholders), or one seen
    through ops that only change its layout or dtype (a router's ``x @ self.w.t()`` is a
    projection too). A tensor computed from weights (a projection of learned queries) is no
    weight: attention over learned queries is attention."""
    while True:
        if node.op == "get_attr":
            return True
        example = getattr(node.meta.get("grapharg"), "example", None)
        if isinstance(example, torch.nn.Parameter):
            return True
        if node.op == "call_function" and node.target is getattr and node.args:
            source = node.args[0]  # w.T, w.mT: Dynamo may keep the attribute read
        elif _name(node) in _LAYOUT and node.args and isinstance(node.args[0], Node):
            source = node.args[0]
        else:
            return False
        if not isinstance(source, Node):
            return False
        node = source


def _name(node: Node) -> str | None:
    if node.op not in ("call_function", "call_method"):
        return None
    names = op_names(node)
    return names[0] if names is not None else None
