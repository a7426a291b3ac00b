"""Normalise pass: rewrite the graph so that any contiguous cut of it is a valid piece boundary.

Two rules, both needed before partitioning:

- A ``torch.Size`` value never crosses a piece boundary (AOTAutograd and capture both reject
  it as a piece input): every Size-valued node gets one copy per user, placed right before that
  user, so it always lands in its user's piece. Its own inputs are tensors, which may cross.
- A ``getitem`` on a multi-output value stays with its producer: it is moved right after the
  producer (a pure read, so moving it earlier never changes a value).
- A functional collective's ``wait_tensor`` stays with its collective: it is moved right after
  it (Dynamo's trace already puts it there; waiting earlier only gives up overlap). The mark pass
  then gives both one kind, so no eager piece ever runs between a collective and its wait (a
  captured collective whose wait ran in another piece would be replayed unwaited, and a wait
  left behind an eager piece could order collectives differently from eager on some rank).
- A tensor whose layout an op changes in place (``h.t_()``, ``unsqueeze_``, ``as_strided_``:
  :func:`fxsplit.facts.op_facts.changes_layout`) is read after it through that op's node, which
  returns the same tensor: a piece boundary after the op then hands on what the op returned, the
  changed tensor. Dynamo's graph reads the tensor's first node instead, which in one graph is the
  same object, but across pieces is what the producing piece returned: an eager piece handed a
  loan changes the loan's alias, never the captured piece's own output.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from fxsplit.collectives import is_collective_node, is_wait_node
from fxsplit.facts.op_facts import changes_layout


def is_size(node: Node) -> bool:
    """True when the node's traced value is a ``torch.Size``."""
    return isinstance(node.meta.get("example_value"), torch.Size)


def is_multi_output_getitem(node: Node) -> bool:
    """True for ``operator.getitem`` on a tuple/list value produced by another node."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source = node.args[0]
    return (
        isinstance(source, Node)
        and source.op not in ("placeholder", "get_attr")
        and isinstance(source.meta.get("example_value"), tuple | list)
        and not is_size(source)
    )


def waited_collective(node: Node) -> Node | None:
    """For ``wait_tensor`` on a collective's result (or a getitem of it), the collective node;
    else None."""
    if not is_wait_node(node) or not node.args or not isinstance(node.args[0], Node):
        return None
    source = node.args[0]
    if is_multi_output_getitem(source):
        source = source.args[0]
    return source if is_collective_node(source) else None


def normalise(graph: Graph) -> None:
    """Apply the four rules to ``graph`` in place."""
    anchors: dict[Node, Node] = {}
    sizes: list[Node] = []
    changed: dict[Node, Node] = {}  # a tensor's node -> the last op that changed its layout
    for node in list(graph.nodes):
        if changed:
            for value in node.all_input_nodes:
                if value in changed:
                    node.replace_input_with(value, changed[value])
        if changes_layout(node) and node.args and isinstance(node.args[0], Node):
            for value, last in list(changed.items()):
                if last is node.args[0]:
                    changed[value] = node
            changed[node.args[0]] = node
        if is_multi_output_getitem(node):
            producer = node.args[0]
            anchor = anchors.get(producer, producer)
            if anchor.next is not node:
                anchor.append(node)
            anchors[producer] = node
        elif waited_collective(node) is not None:
            source = node.args[0]
            anchor = anchors.get(source, source)
            if anchor.next is not node:
                anchor.append(node)
            anchors[source] = node
        if is_size(node) and node.op != "placeholder":
            sizes.append(node)
    # Reverse order: a Size computed from another Size is copied first, so the upstream Size then
    # sees one user per copy.
    for node in reversed(sizes):
        users = list(node.users)
        if len(users) == 1 and node.next is users[0]:
            continue
        for user in users:
            with graph.inserting_before(user):
                copy = graph.node_copy(node)
            user.replace_input_with(node, copy)
        graph.erase_node(node)
