"""Ranks agree on the split before anything is captured.

Under tensor parallelism every rank compiles the same graph and every captured piece issues its
collectives when it is replayed. If one rank split its graph differently (another option, another
torch, a model edited on one node), or runs a piece differently (an Inductor artifact on one rank,
the generated Python on another because Inductor failed there or its cache remembers a failure),
its collectives would run in other pieces, in another order, or eagerly where the others replay
them: the job hangs at the first collective with no message.
:func:`check_ranks` compares a fingerprint of each plan across the ranks right after the split
and raises :class:`RankMismatchError` on every rank instead.

The exchange is one ``torch.distributed.all_gather_object`` per compiled graph, over the process
group the graph's collectives use (the default group when it uses none or several).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.fx import Node

from fxsplit import collectives

__all__ = ["PieceFingerprint", "RankMismatchError", "check_ranks", "fingerprint", "group_of"]


class RankMismatchError(RuntimeError):
    """Ranks split one compiled graph differently (raised on every rank alike).

    Attributes:
        graph_id: the graph, ``"graph_<n>"``.
        groups: the global ranks of each distinct split, the one of the group's first rank
            first.
        piece: the name of the first piece that differs.
    """

    def __init__(self, message: str, graph_id: str, groups: list[list[int]], piece: str):
        super().__init__(message)
        self.graph_id = graph_id
        self.groups = groups
        self.piece = piece


@dataclass(frozen=True)
class PieceFingerprint:
    """What must agree across ranks about one piece: its name and kind, its reasons, how many
    nodes it holds, a digest of their targets in order, and what runs it (``"python"``: its
    generated code; ``"inductor"``: an Inductor artifact, compiled here or loaded from a cache,
    which may order and fuse its collectives differently)."""

    name: str
    kind: str
    reasons: tuple[str, ...]
    num_nodes: int
    digest: str
    runs: str = "python"

    def describe(self) -> str:
        """One line for error messages."""
        reasons = f", {', '.join(self.reasons)}" if self.reasons else ""
        return (
            f"{self.kind}, {self.num_nodes} nodes (targets {self.digest}), runs as {self.runs}"
            f"{reasons}"
        )


def _target(node: Node) -> str:
    """A rank-independent text of the node's target (no object addresses)."""
    target = node.target
    if isinstance(target, str):
        return f"{node.op}:{target}"
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', type(target).__name__)}"


def fingerprint(plan, graph_module, compiled=None) -> tuple[PieceFingerprint, ...]:
    """The fingerprint of a split: one :class:`PieceFingerprint` per piece, in order.

    Args:
        plan: the :class:`~fxsplit.plan.SplitPlan`.
        graph_module: the split Dynamo graph (its nodes, by the names the plan lists).
        compiled: the graph's compiled-piece records (each with ``pieces`` and ``outcome``),
            None when no piece was compiled.
    """
    nodes = {n.name: n for n in graph_module.graph.nodes}
    runs = {
        name: "python" if record.outcome == "eager" else "inductor"
        for record in compiled or ()
        for name in record.pieces
    }
    pieces = []
    for piece in plan.pieces:
        text = "\n".join(_target(nodes[name]) for name in piece.nodes)
        digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:12]
        pieces.append(
            PieceFingerprint(
                piece.name,
                piece.kind,
                piece.reasons,
                len(piece.nodes),
                digest,
                runs.get(piece.name, "python"),
            )
        )
    return tuple(pieces)


def group_of(graph_module):
    """The process group a graph's collectives use; the default group when it has none, or
    collectives over several groups (every rank of the default group compiles the graph then)."""
    from torch.distributed import distributed_c10d as c10d

    names = {
        collectives.group_name(n)
        for n in graph_module.graph.nodes
        if collectives.is_collective_node(n)
    }
    names.discard(None)
    if len(names) == 1:
        return c10d._resolve_process_group(names.pop())
    return c10d.group.WORLD


def check_ranks(graph_id: str, plan, graph_module, compiled=None) -> None:
    """Compare this rank's split of ``graph_id``, and what runs each piece, with every other
    rank's (``compiled``: see :func:`fingerprint`).

    Does nothing where ``torch.distributed`` is unavailable or not initialised, or where the
    group holds one rank. Every rank of the group must call it for the same graph (it is a
    collective: a rank that never compiles the graph leaves the others waiting, up to the
    group's timeout).

    Raises:
        RankMismatchError: on every rank, when any two ranks' fingerprints differ; names the
            ranks on each side and the first piece that differs, with each side's view of it.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    group = group_of(graph_module)
    if dist.get_world_size(group) < 2:
        return
    mine = fingerprint(plan, graph_module, compiled)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if all(other == mine for other in gathered):
        return
    ranks = dist.get_process_group_ranks(group)
    variants: list[tuple] = []
    groups: list[list[int]] = []
    for rank, other in zip(ranks, gathered, strict=True):
        if other not in variants:
            variants.append(other)
            groups.append([])
        groups[variants.index(other)].append(rank)
    raise _mismatch(graph_id, variants, groups)


def _mismatch(graph_id: str, variants: list[tuple], groups: list[list[int]]) -> RankMismatchError:
    first, second = variants[0], variants[1]
    index = next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
        min(len(first), len(second)),
    )
    piece = first[index].name if index < len(first) else second[index].name
    sides = "; ".join(
        f"ranks {', '.join(map(str, ranks))}: "
        + (
            f"{piece} {variant[index].describe()}"
            if index < len(variant)
            else f"no {piece} ({len(variant)} pieces)"
        )
        for variant, ranks in zip(variants, groups, strict=True)
    )
    return RankMismatchError(
        f"fxsplit {graph_id}: ranks split the graph differently, so their collectives would not "
        f"match (the job would hang at the first one). First piece that differs: {piece}. "
        f"{sides}. Every rank must compile the same model with the same fxsplit options and "
        "torch; check_ranks=False skips this check (single-rank debugging only)",
        graph_id,
        groups,
        piece,
    )
