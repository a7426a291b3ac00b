"""Tensor-parallel layers for the reference models, on torch.distributed's functional collectives.

Each layer is made from the full single-process layer and keeps this rank's shard of its
weight, so a tensor-parallel model built from the same seed computes what the single-process
model computes (up to the order of floating-point sums). All communication goes through
``torch.distributed._functional_collectives`` (``all_reduce``, ``all_gather_tensor`` and
``reduce_scatter_tensor``, called ``all_gather_single`` / ``reduce_scatter_single`` from torch
2.13 on) on the process group the caller passes; under ``torch.compile`` they
appear as ``_c10d_functional`` nodes with their ``wait_tensor``.

Ranks split the output features of column-parallel layers and the input features of
row-parallel ones into contiguous equal blocks, rank ``r`` holding block ``r`` (heads are the
outer dim of every projection here, so a block is a set of whole heads).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

if dist.is_available():
    import torch.distributed._functional_collectives as funcol
else:  # a torch built without distributed: only group=None (one process) works
    funcol = None


def _all_gather(x: Tensor, dim: int, group) -> Tensor:
    # torch 2.13 renamed all_gather_tensor to all_gather_single (same _c10d_functional op,
    # all_gather_into_tensor) and deprecates the old name; 2.11 has only the old one.
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return gather(x, gather_dim=dim, group=group)


def _reduce_scatter(x: Tensor, dim: int, group) -> Tensor:
    # Renamed like _all_gather (reduce_scatter_tensor -> reduce_scatter_single).
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return scatter(x, "sum", scatter_dim=dim, group=group)


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_reduce",
    "rank_and_size",
    "shard_count",
    "shard_range",
]


def rank_and_size(group) -> tuple[int, int]:
    """``(rank in group, group size)``; ``(0, 1)`` for ``group=None`` (no tensor parallelism)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_range(total: int, group, what: str) -> tuple[int, int]:
    """``(start, end)`` of this rank's contiguous block of ``total`` items.

    Raises:
        ValueError: the group size does not divide ``total``; names ``what`` and both numbers.
    """
    rank, size = rank_and_size(group)
    if total % size:
        sizes = ", ".join(str(d) for d in range(1, total + 1) if total % d == 0)
        raise ValueError(
            f"tensor-parallel size {size} does not divide {what} ({total}); use one of {sizes}"
        )
    block = total // size
    return rank * block, (rank + 1) * block


def shard_count(total: int, group, what: str) -> int:
    """How many of ``total`` items (heads) this rank holds under ``group`` (all for None).

    Raises:
        ValueError: the group size does not divide ``total``.
    """
    start, end = shard_range(total, group, what)
    return end - start


def all_reduce(x: Tensor, group) -> Tensor:
    """Sum of ``x`` over the ranks of ``group`` (``x`` itself for ``group=None``)."""
    if group is None:
        return x
    return funcol.all_reduce(x, "sum", group)


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split across ranks: [..., in] -> [..., out/tp]
    (or [..., out] with ``gather_output``, all-gathered over the last dim).

    Args:
        full: the single-process ``nn.Linear`` (no bias); this rank keeps its row block.
        group: the tensor-parallel process group.
        what: name of the split dim in errors ("attention heads", ...).
        gather_output: all-gather the output features (vocab-parallel logits).

    Raises:
        ValueError: the group size does not divide the output features.
    """

    def __init__(self, full: nn.Linear, group, what: str, gather_output: bool = False):
        super().__init__()
        if full.bias is not None:
            raise ValueError("ColumnParallelLinear takes linears without bias")
        start, end = shard_range(full.out_features, group, what)
        self.weight = nn.Parameter(full.weight[start:end].clone(), requires_grad=False)
        self.group = group
        self.gather_output = gather_output

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        if self.gather_output:
            y = _all_gather(y, y.dim() - 1, self.group)
        return y


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across ranks: [..., in/tp] -> [..., out],
    the partial products summed over the ranks.

    The sum is an ``all_reduce``, or with ``scatter_dim`` a ``reduce_scatter_tensor`` over that
    dim followed by an ``all_gather_tensor`` (the pattern of sequence-parallel engines, which
    keep the activations between those two collectives sharded).

    Args:
        full: the single-process ``nn.Linear`` (no bias); this rank keeps its column block.
        group: the tensor-parallel process group.
        what: name of the split dim in errors.
        scatter_dim: None (all-reduce) or the output dim to reduce-scatter and all-gather over
            (the group size must divide it).

    Raises:
        ValueError: the group size does not divide the input features (or the scatter dim).
    """

    def __init__(self, full: nn.Linear, group, what: str, scatter_dim: int | None = None):
        super().__init__()
        if full.bias is not None:
            raise ValueError("RowParallelLinear takes linears without bias")
        start, end = shard_range(full.in_features, group, what)
        if scatter_dim is not None:
            shard_range(full.out_features, group, f"the output features of {what}")
        self.weight = nn.Parameter(full.weight[:, start:end].clone(), requires_grad=False)
        self.group = group
        self.scatter_dim = scatter_dim

    def forward(self, x: Tensor) -> Tensor:
        partial = F.linear(x, self.weight)
        if self.scatter_dim is None:
            return funcol.all_reduce(partial, "sum", self.group)
        dim = self.scatter_dim % partial.dim()
        return _all_gather(_reduce_scatter(partial, dim, self.group), dim, self.group)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split across ranks: [...] int64 ids ->
    [..., dim]. Each rank looks up the ids in its block (zeros elsewhere); the all-reduce sums
    the one non-zero row per id.

    Args:
        full: the single-process ``nn.Embedding``.
        group: the tensor-parallel process group.

    Raises:
        ValueError: the group size does not divide the vocabulary.
    """

    def __init__(self, full: nn.Embedding, group):
        super().__init__()
        self.start, self.end = shard_range(full.num_embeddings, group, "the vocabulary")
        self.weight = nn.Parameter(full.weight[self.start : self.end].clone(), requires_grad=False)
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return funcol.all_reduce(rows, "sum", self.group)
