"""Partition pass: cut the marked node list into contiguous pieces, in original order.

Contiguity keeps every in-place mutation in its original order. Runs of eager nodes form one
eager piece, so adjacent eager nodes, consecutive splitting ops and nested regions fold together.
A captured run that launches no kernel (only host values, allocations and views) is never
captured alone: it joins the neighbouring eager piece(s).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Node

from fxsplit.passes.mark import Marks

CAPTURED = "captured"
EAGER = "eager"


@dataclass
class Part:
    """One piece before materialisation: its kind and its nodes in graph order."""

    kind: str
    nodes: list[Node]

    def regions(self, marks: Marks) -> frozenset[str]:
        """Every region name any node of the piece sits in."""
        regions = marks.regions
        return frozenset(r for n in self.nodes if n in regions for r in regions[n])

    def reasons(self, marks: Marks) -> tuple[str, ...]:
        """Sorted reasons of the piece's eager nodes (empty for a captured piece)."""
        if self.kind != EAGER:
            return ()
        reasons = marks.reasons
        return tuple(sorted({r for n in self.nodes if n in reasons for r in reasons[n]}))

    def num_ops(self) -> int:
        """call_function / call_method / call_module nodes, not counting getitem."""
        return sum(
            1
            for n in self.nodes
            if n.op in ("call_function", "call_method", "call_module")
            and n.target is not operator.getitem
        )


def partition(marks: Marks) -> list[Part]:
    """Group ``marks.nodes`` into alternating captured and eager parts."""
    reasons, follows, trivial = marks.reasons, marks.follows, marks.trivial
    runs: list[list] = []  # [eager, nodes, has_compute]
    last = None
    for node in marks.nodes:
        source = node
        while source in follows:
            source = follows[source]
        eager = source in reasons
        if last is None or last[0] != eager:
            last = [eager, [], False]
            runs.append(last)
        last[1].append(node)
        if not last[2] and node not in trivial:
            last[2] = True
    has_eager = any(run[0] for run in runs)
    parts: list[Part] = []
    for eager, nodes, has_compute in runs:
        if not eager and not has_compute and has_eager:
            eager = True
        if parts and (parts[-1].kind == EAGER) == eager:
            parts[-1].nodes.extend(nodes)
        else:
            parts.append(Part(EAGER if eager else CAPTURED, nodes))
    return parts
