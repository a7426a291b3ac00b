"""Split plans: what the backend decided for one compiled graph, as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """One piece of a split graph.

    Attributes:
        name: ``"piece_<i>"``, in execution order.
        kind: ``"captured"`` (replayed as a CUDA/HIP graph) or ``"eager"``.
        regions: region names of the piece's nodes, eager or not.
        reasons: sorted reasons of its eager nodes: ``"region:<name>"``, ``"op:<ns::op>"``,
            ``"module:<pattern>"``, ``"unsafe:<ns::op>"``; empty for captured pieces.
        num_ops: call_function / call_method / call_module nodes, not counting getitem.
        nodes: names of its nodes, in graph order.
        inputs: names of the values it reads from placeholders or earlier pieces.
        outputs: names of the values it hands to later pieces or the graph output.
        writes: names of the inputs whose data it writes (from the aliasing analysis, which
            runs for captured pieces when capture is on or a dump is written).
        metadata_writes: names of the inputs whose size or stride it changes in place.
        aliases: ``"output -> input"`` for each output that is a view of one of its inputs.
        devices: the devices of the tensors it reads and makes (``"cuda:0"``, ``"cpu"``).
        random: it draws random numbers (an op tagged ``nondeterministic_seeded``).
        unset: names of the outputs it allocates and never writes (an ``empty_like`` buffer a
            later eager op fills): their values are unspecified when the piece ends.
        same_as: the first piece with the same code (structure, targets, constants and global
            state; another layer of the same model), whose code object, and compiled artifact
            when pieces are compiled, this one shares; None for the first of its kind.
    """

    name: str
    kind: str
    regions: frozenset[str]
    reasons: tuple[str, ...]
    num_ops: int
    nodes: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    metadata_writes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    random: bool = False
    same_as: str | None = None
    unset: tuple[str, ...] = ()


@dataclass(frozen=True)
class SplitPlan:
    """The split of one Dynamo graph.

    Attributes:
        graph_id: ``"graph_<n>"``, numbered per backend in compile order.
        runner: the runner name the plan was made for.
        eager_regions: region names the runner ran eagerly.
        pieces: the pieces, in execution order.
        num_nodes: nodes of the Dynamo graph, placeholders and output included.
        split_seconds: wall time of the split (normalise, mark, partition, materialise).
    """

    graph_id: str
    runner: str
    eager_regions: frozenset[str]
    pieces: tuple[Piece, ...]
    num_nodes: int = 0
    split_seconds: float = field(default=0.0, compare=False)

    @property
    def captured(self) -> list[Piece]:
        """The captured pieces."""
        return [p for p in self.pieces if p.kind == "captured"]

    @property
    def eager(self) -> list[Piece]:
        """The eager pieces."""
        return [p for p in self.pieces if p.kind == "eager"]

    def sharing(self) -> dict[str, list[str]]:
        """First piece -> every piece sharing its code (itself first), for groups of two or
        more."""
        groups: dict[str, list[str]] = {}
        for p in self.pieces:
            groups.setdefault(p.same_as or p.name, []).append(p.name)
        return {first: names for first, names in groups.items() if len(names) > 1}

    def rows(self, sep: str = ",") -> list[tuple[str, str, str, str, str]]:
        """One ``(piece, kind, ops, regions, reasons)`` row of text per piece; ``"-"`` for none."""
        return [
            (
                p.name,
                p.kind,
                str(p.num_ops),
                sep.join(sorted(p.regions)) or "-",
                sep.join(p.reasons) or "-",
            )
            for p in self.pieces
        ]

    def format(self) -> str:
        """Deterministic text table of the plan (no timings, no node names)."""
        head = (
            f"{self.graph_id} runner={self.runner} "
            f"eager_regions={','.join(sorted(self.eager_regions)) or '-'}: "
            f"{len(self.pieces)} piece{'s' if len(self.pieces) != 1 else ''}, "
            f"{len(self.captured)} captured, {len(self.eager)} eager"
        )
        rows = [("piece", "kind", "ops", "regions", "reasons"), *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head]
        for row in rows:
            cells = [
                row[i].ljust(widths[i]) if i != 2 else row[i].rjust(widths[i]) for i in range(4)
            ]
            lines.append("  ".join([*cells, row[4]]).rstrip())
        return "\n".join(lines)
