"""Compare two splits of the same graph: which nodes moved between eager and captured, and why.

Typical use is the same model under two runners (``fxsplit diff MODULE:FACTORY --runner v1
--runner v2``): Dynamo names nodes deterministically, so a node of plan A and the node of plan B
with the same name are the same operation, and :func:`diff_splits` lists every node whose kind
differs with the reasons each side recorded for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fxsplit.plan import SplitPlan

__all__ = ["GraphDiff", "MoveGroup", "NodeMove", "diff_splits", "print_diff"]


@dataclass(frozen=True)
class NodeMove:
    """One node whose piece kind differs between plan A and plan B.

    Attributes:
        node: the node's name.
        regions: region names the node sits in (from either side); a node that follows another
            (a multi-output ``getitem``, a ``Size`` copy) reports that node's regions.
        piece_a / piece_b: the piece holding it under A / B.
        kind_a / kind_b: ``"eager"`` or ``"captured"``.
        why_a / why_b: why it has that kind on that side: its own eager reasons
            (``region:<name>``, ``op:<ns::op>``, ...), or for an eager node without reasons of its
            own how it got there (``follows <node>``: takes its producer's or user's kind;
            ``joins eager neighbour``: launches no kernel), or ``()`` for a captured node.
    """

    node: str
    regions: tuple[str, ...]
    piece_a: str
    kind_a: str
    why_a: tuple[str, ...]
    piece_b: str
    kind_b: str
    why_b: tuple[str, ...]


@dataclass
class GraphDiff:
    """:func:`diff_splits` of one graph.

    Attributes:
        plan_a / plan_b: the two plans.
        moved: nodes whose kind differs, in plan A's order.
        only_a / only_b: node names present in one plan only (a different Dynamo graph).
    """

    plan_a: SplitPlan
    plan_b: SplitPlan
    moved: list[NodeMove] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)

    def summary(self) -> list[MoveGroup]:
        """Moves grouped by (regions, kind under A, kind under B), most nodes first."""
        groups: dict[tuple, MoveGroup] = {}
        for m in self.moved:
            key = (m.regions, m.kind_a, m.kind_b)
            group = groups.setdefault(key, MoveGroup(*key))
            group.nodes.append(m.node)
            group.why_a.update(r for r in m.why_a if ":" in r)
            group.why_b.update(r for r in m.why_b if ":" in r)
        return sorted(groups.values(), key=lambda g: -len(g.nodes))


@dataclass
class MoveGroup:
    """Moved nodes with the same regions and kinds.

    Attributes:
        regions / kind_a / kind_b: as in :class:`NodeMove`.
        nodes: the node names.
        why_a / why_b: the rule reasons (``region:``, ``op:``, ``module:``, ``unsafe:``) any of
            them has on each side.
    """

    regions: tuple[str, ...]
    kind_a: str
    kind_b: str
    nodes: list[str] = field(default_factory=list)
    why_a: set[str] = field(default_factory=set)
    why_b: set[str] = field(default_factory=set)


def _why(split) -> dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]]:
    """node name -> (piece, why, kind, regions) for every partitioned node of ``split``."""
    marks = split.marks
    owner = {}
    for piece in split.plan.pieces:
        for name in piece.nodes:
            owner[name] = piece
    out = {}
    for node in marks.nodes:
        piece = owner.get(node.name)
        if piece is None:
            continue
        if node in marks.reasons:
            why = marks.reasons[node]
        elif piece.kind != "eager":
            why = ()
        elif node in marks.follows:
            why = (f"follows {marks.follows[node].name}",)
        elif node in marks.trivial:
            why = ("joins eager neighbour (no kernel)",)
        else:
            why = ("joins eager neighbour",)
        source = node
        while source not in marks.regions and source in marks.follows:
            source = marks.follows[source]  # a getitem or Size copy: its producer's / user's
        out[node.name] = (piece.name, why, piece.kind, tuple(marks.regions.get(source, ())))
    return out


def diff_splits(a, b) -> GraphDiff:
    """Compare two :class:`fxsplit.passes.Split` results of the same Dynamo graph.

    Returns:
        a :class:`GraphDiff`; ``moved`` is empty when both plans run every node the same way.
    """
    info_a, info_b = _why(a), _why(b)
    result = GraphDiff(a.plan, b.plan)
    for name, (piece_a, why_a, kind_a, regions_a) in info_a.items():
        if name not in info_b:
            result.only_a.append(name)
            continue
        piece_b, why_b, kind_b, regions_b = info_b[name]
        if kind_a != kind_b:
            regions = tuple(sorted(set(regions_a) | set(regions_b)))
            result.moved.append(
                NodeMove(name, regions, piece_a, kind_a, why_a, piece_b, kind_b, why_b)
            )
    result.only_b = [name for name in info_b if name not in info_a]
    return result


def _label(plan: SplitPlan, side: str) -> str:
    return f"{side} (runner {plan.runner})"


def print_diff(console, diff: GraphDiff, *, nodes: bool = True) -> None:
    """Print ``diff`` with rich: pieces side by side, moves by region, then each moved node.

    Args:
        console: a ``rich.console.Console``.
        diff: from :func:`diff_splits`.
        nodes: also print the table of every moved node (node, regions, kind and piece under A and
            B, reasons on each side).
    """
    from rich.table import Table

    from fxsplit.tools.dump import titled

    a, b = diff.plan_a, diff.plan_b
    la, lb = "A", "B"
    console.print(f"[bold]{a.graph_id}[/bold]: {len(diff.moved)} nodes moved", highlight=False)
    for plan, label in ((a, la), (b, lb)):
        console.print(
            f"  {_label(plan, label)}: {len(plan.pieces)} pieces "
            f"({len(plan.captured)} captured, {len(plan.eager)} eager)",
            highlight=False,
        )
    side = Table()
    for label in (la, lb):
        side.add_column(f"{label} piece")
        side.add_column("kind")
        side.add_column("ops", justify="right")
        side.add_column("regions", overflow="fold")
    for i in range(max(len(a.pieces), len(b.pieces))):
        cells = []
        for plan in (a, b):
            if i < len(plan.pieces):
                p = plan.pieces[i]
                cells += [p.name, p.kind, str(p.num_ops), ", ".join(sorted(p.regions)) or "-"]
            else:
                cells += ["", "", "", ""]
        side.add_row(*cells)
    console.print(titled(f"{a.graph_id}: pieces side by side", side))
    if not diff.moved:
        console.print("No node moved between eager and captured.")
    else:
        groups = Table()
        for column in ("regions", la, lb, "nodes", f"why {la}", f"why {lb}"):
            groups.add_column(column, overflow="fold")
        for g in diff.summary():
            groups.add_row(
                ", ".join(g.regions) or "-",
                g.kind_a,
                g.kind_b,
                str(len(g.nodes)),
                ", ".join(sorted(g.why_a)) or "-",
                ", ".join(sorted(g.why_b)) or "-",
            )
        console.print(titled(f"{a.graph_id}: moved nodes by region", groups))
    if nodes and diff.moved:
        table = Table()
        for column in ("node", "regions", la, lb, f"why {la}", f"why {lb}"):
            # "captured (piece_12)" stays on one line: the reasons fold instead
            table.add_column(column, overflow="fold", no_wrap=column in (la, lb))
        for m in diff.moved:
            table.add_row(
                m.node,
                ", ".join(m.regions) or "-",
                f"{m.kind_a} ({m.piece_a})",
                f"{m.kind_b} ({m.piece_b})",
                ", ".join(m.why_a) or "-",
                ", ".join(m.why_b) or "-",
            )
        console.print(titled(f"{a.graph_id}: moved nodes", table))
    if diff.only_a or diff.only_b:
        console.print(
            f"Nodes in one plan only: {len(diff.only_a)} in A, {len(diff.only_b)} in B "
            "(the graphs differ).",
            highlight=False,
        )
