"""Materialise pass: turn the parts into piece modules and a stitched top-level GraphModule.

Each piece becomes a :class:`PieceModule` whose ``forward`` is generated straight from the
original nodes (:mod:`fxsplit.passes.codegen`). The stitched module is a small
``torch.fx.GraphModule``: the original placeholders and ``get_attr`` nodes, one ``call_module``
per piece in order, a ``getitem`` per value a later piece or the output reads, and the original
output.
"""

from __future__ import annotations

import copy
import functools
import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from fxsplit.passes import global_state
from fxsplit.passes.codegen import Codegen
from fxsplit.passes.partition import Part


class PieceModule(torch.nn.Module):
    """One piece of a split graph; calling it runs the piece's nodes.

    Attributes:
        name: ``"piece_<i>"``.
        kind: ``"captured"`` or ``"eager"``.
        code: the piece's Python source with the graph's node names (rendered on first use;
            ``forward`` runs the same code with canonical names, shared by every piece of the
            same structure).
        shared_code: the canonical source ``forward`` was compiled from.
        same_as: the first piece with the same ``shared_code`` (itself when it is the first).
        stateful: its code re-enters grad mode or a block (autocast, ...) open across a piece
            boundary.
        input_names / output_names: names of the values the piece reads / returns, in order.
            A piece returns a single value as is, several as a tuple, none as None.
    """

    def __init__(
        self, name: str, kind: str, fn, render, shared_code: str, same_as: str, ins, outs, stateful
    ):
        super().__init__()
        self.stateful = stateful
        self.name = name
        self.kind = kind
        self.forward = fn
        self._render = render
        self._code: str | None = None
        self.shared_code = shared_code
        self.same_as = same_as
        self.input_names = tuple(ins)
        self.output_names = tuple(outs)

    @property
    def code(self) -> str:
        if self._code is None:
            self._code = self._render()
        return self._code

    def extra_repr(self) -> str:
        return f"{self.name}, kind={self.kind}"


@dataclass
class Materialised:
    """Output of :func:`materialise`: the stitched module, its pieces and the piece source."""

    stitched: GraphModule
    pieces: list[PieceModule]
    source: str


def _io(parts: list[Part]) -> tuple[list[list[Node]], list[list[Node]]]:
    owner: dict[Node, int] = {}
    for i, part in enumerate(parts):
        for node in part.nodes:
            owner[node] = i
    ins: list[list[Node]] = []
    outs: list[list[Node]] = []
    for i, part in enumerate(parts):
        seen: dict[Node, None] = {}
        produced: list[Node] = []
        for node in part.nodes:
            for a in node._input_nodes:  # all_input_nodes without building a list
                if owner.get(a) != i and a not in seen:
                    seen[a] = None
            for user in node.users:
                if owner.get(user) != i:
                    produced.append(node)
                    break
        # Block contexts are re-entered inside each piece (see global_state), never passed.
        ins.append([a for a in seen if not global_state.is_enter(a)])
        outs.append([n for n in produced if not global_state.is_enter(n)])
    return ins, outs


def _state_lines(cg: Codegen, *, state: global_state.PieceState, grad_at_entry: bool):
    prologue, epilogue = [], []
    if state.grad_in is not None:
        prologue.append(f"{cg.target(global_state.SET_GRAD)}({state.grad_in})")
    for enter in state.blocks_in:
        prologue.append(f"{cg.name(enter)} = {cg.call(enter)}")
    epilogue += [
        f"{cg.target(global_state.exit_target(enter))}({cg.name(enter)})"
        for enter in reversed(state.blocks_out)
    ]
    if state.grad_out is not None:
        epilogue.append(f"{cg.target(global_state.SET_GRAD)}({grad_at_entry})")
    return prologue, epilogue


def materialise(
    gm: GraphModule,
    parts: list[Part],
    filename: str,
    grad_at_entry: bool = True,
    host: list[Node] = (),
) -> Materialised:
    """Build the piece modules and the stitched GraphModule for ``parts`` of ``gm``.

    Args:
        gm: the (normalised) Dynamo GraphModule the parts were cut from.
        parts: the output of :func:`fxsplit.passes.partition.partition`.
        filename: pseudo file name of the generated source (shown in tracebacks).
        grad_at_entry: grad mode when the graph is called (Dynamo guards on it).
        host: nodes to run in the stitched module before the pieces (see
            :func:`fxsplit.passes.mark.is_host_input`).
    """
    graph = gm.graph
    cg = Codegen((n.name for n in graph.nodes), gm)
    ins, outs = _io(parts)
    states = global_state.track([p.nodes for p in parts], grad_at_entry)
    # One function per distinct piece: a layer's pieces repeat with other inputs, and
    # compiling their source once is most of the cost of a deep graph's split.
    distinct: dict[str, int] = {}
    first: list[int] = []
    of_piece: list[int] = []
    for i, part in enumerate(parts):
        body = cg.function(
            "piece",
            part.nodes,
            ins[i],
            outs[i],
            functools.partial(_state_lines, state=states[i], grad_at_entry=grad_at_entry),
            states[i].blocks_in,
            canonical=True,
        )
        k = distinct.setdefault(body, len(distinct))
        if k == len(first):
            first.append(i)
        of_piece.append(k)
    bodies = list(distinct)
    fns, source = cg.compile(
        [b.replace("def piece(", f"def piece_fn_{k}(", 1) for k, b in enumerate(bodies)],
        filename,
    )

    def render(i: int) -> str:
        around = functools.partial(_state_lines, state=states[i], grad_at_entry=grad_at_entry)
        return cg.function(f"piece_{i}", parts[i].nodes, ins[i], outs[i], around)

    pieces = [
        PieceModule(
            f"piece_{i}",
            part.kind,
            fns[of_piece[i]],
            functools.partial(render, i),
            bodies[of_piece[i]],
            f"piece_{first[of_piece[i]]}",
            [n.name for n in ins[i]],
            [n.name for n in outs[i]],
            states[i] != global_state.PieceState(),
        )
        for i, part in enumerate(parts)
    ]

    stitched = Graph()
    env: dict[Node, Node] = {}
    attrs: dict[str, object] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node] = stitched.node_copy(node, env.__getitem__)
            if node.op == "get_attr":
                attrs[node.target] = fetch(gm, node.target)
    for node in host:
        env[node] = stitched.node_copy(node, env.__getitem__)
    for i, piece in enumerate(pieces):
        attrs[piece.name] = piece
        call = stitched.call_module(piece.name, tuple(env[a] for a in ins[i]))
        if len(outs[i]) == 1:
            env[outs[i][0]] = call
        else:
            for j, out in enumerate(outs[i]):
                env[out] = stitched.create_node(
                    "call_function", operator.getitem, (call, j), name=out.name
                )
    output = graph.output_node()
    stitched.output(torch.fx.map_arg(output.args[0], env.__getitem__), output.type)
    stitched._codegen = copy.deepcopy(graph._codegen)
    module = GraphModule(attrs, stitched, class_name="FxsplitStitched")
    for piece in pieces:
        bind_piece(module, piece)
    return Materialised(module, pieces, source)


def bind_piece(stitched: GraphModule, piece: torch.nn.Module) -> None:
    """Make ``piece`` the stitched module's ``piece.name`` submodule.

    Also sets it in the instance ``__dict__``: the generated ``self.piece_<i>(...)`` then skips
    ``nn.Module.__getattr__`` on every call of every step.
    """
    stitched.register_module(piece.name, piece)
    object.__setattr__(stitched, piece.name, piece)


def fetch(gm: GraphModule, target: str) -> object:
    """The attribute a ``get_attr`` node's dotted ``target`` names on ``gm``."""
    obj: object = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj
