"""What the split pipeline (:func:`fxsplit.passes.split`) produces for one graph: the record the
runtime, the dump and the plan's JSON read, kept apart from the passes so that the runtime imports
none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.fx import GraphModule

    from fxsplit.facts import aliasing
    from fxsplit.passes import mark, materialise, partition, step_sizes
    from fxsplit.plan import Piece, SplitPlan

__all__ = ["Split", "SplitPiece"]


@dataclass(frozen=True)
class SplitPiece:
    """One piece of a split, as each pass left it.

    Attributes:
        plan: its record in the plan (:class:`fxsplit.plan.Piece`).
        part: its nodes in the Dynamo graph (:class:`fxsplit.passes.partition.Part`).
        module: the module that runs it (:class:`fxsplit.passes.materialise.PieceModule`;
            the Inductor pass may replace its ``forward``).
        aliasing: what it writes and aliases (:mod:`fxsplit.facts.aliasing`), or None where
            the split ran without the analysis or the piece runs eagerly.
    """

    plan: Piece
    part: partition.Part
    module: materialise.PieceModule
    aliasing: aliasing.PieceAliasing | None


@dataclass
class Split:
    """Everything :func:`split` produced for one graph.

    Attributes:
        plan: the :class:`~fxsplit.plan.SplitPlan`.
        graph_module: the Dynamo graph, normalised in place.
        marks: what the mark pass found (:class:`fxsplit.passes.mark.Marks`).
        pieces: one record per piece, in graph order.
        stitched: the module that calls the pieces in order (what runs the graph).
        compiled_pieces: the Inductor pass's records (:class:`fxsplit.passes.inductor.
            CompiledPiece`), or None where it did not run.
        steps: the step sizes found (:class:`fxsplit.passes.step_sizes.StepSizes`).
    """

    plan: SplitPlan
    graph_module: GraphModule
    marks: mark.Marks
    pieces: tuple[SplitPiece, ...]
    stitched: GraphModule
    compiled_pieces: list | None = None
    steps: step_sizes.StepSizes | None = None
