"""A small Llama-style causal LM whose attention is a custom op that writes into an output buffer.

This is the "splitting op" pattern of serving engines: attention is an opaque custom op
(:data:`SPLITTING_OPS`) that a backend splits the graph at, and the op writes its result into a
buffer allocated by the preceding piece (``torch.empty`` just before the call) instead of
returning a new tensor. Prefill-style: a batch of equal-length prompts, no KV cache.

Architecture as in Llama 2/3 (Touvron et al., 2023): pre-norm RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP. Everything is float32.

Tensor parallel: ``build(group=...)`` shards the model built from the same seed over a
``torch.distributed`` process group (:mod:`fxsplit.models.tp`): query and key/value heads split
across ranks (``q_proj``, ``k_proj``, ``v_proj`` column-parallel, ``o_proj`` row-parallel with an
``all_reduce``), the MLP column/row-parallel, the embedding and the logits vocab-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxsplit.models import tp

__all__ = [
    "SPLITTING_OPS",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaModel",
    "build",
    "example",
    "llama_attention",
]

SPLITTING_OPS = ("fxsplit::llama_attention",)


@torch.library.custom_op("fxsplit::llama_attention", mutates_args=("out",))
def llama_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
    """Causal grouped-query softmax attention, written into ``out``.

    Args:
        q: [B, S, H, D] float32 queries, RoPE applied.
        k: [B, S, H_kv, D] float32 keys, RoPE applied; ``H`` must be a multiple of ``H_kv``.
        v: [B, S, H_kv, D] float32 values.
        out: [B, S, H, D] float32, overwritten with ``softmax(q k^T / sqrt(D) + causal) v``.
    """
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    out.copy_(o.transpose(1, 2))


@llama_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
    return None


@dataclass(frozen=True)
class LlamaConfig:
    """Model sizes; the defaults make a tiny model that runs fast on CPU.

    Attributes:
        vocab_size: vocabulary size.
        hidden_size: residual stream width.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention); divides ``num_heads``.
        head_dim: dims per head (even, for RoPE).
        intermediate_size: SwiGLU MLP hidden width.
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [B, S, H, D]; cos/sin [B, S, D/2]; half-split pairing (i with i + D/2).
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h += o_proj(attn(rope(q), rope(k), v)); h += mlp(norm(h))``.

    With a tensor-parallel ``group`` this rank holds ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` key/value heads.

    Raises:
        ValueError: the group size does not divide ``num_heads``, ``num_kv_heads`` or
            ``intermediate_size``.
    """

    def __init__(self, config: LlamaConfig, group=None) -> None:
        super().__init__()
        c = config
        self.config = c
        self.num_heads = tp.shard_count(c.num_heads, group, "num_heads (query heads)")
        self.num_kv_heads = tp.shard_count(c.num_kv_heads, group, "num_kv_heads (kv heads)")
        self.attn_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.gate = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        if group is not None:
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(self, name, tp.ColumnParallelLinear(getattr(self, name), group, "heads"))
            self.o_proj = tp.RowParallelLinear(self.o_proj, group, "heads")
            what = "intermediate_size"
            self.gate = tp.ColumnParallelLinear(self.gate, group, what)
            self.up = tp.ColumnParallelLinear(self.up, group, what)
            self.down = tp.RowParallelLinear(self.down, group, what)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """[B, S, hidden] float32 -> same; ``cos``/``sin`` [B, S, head_dim/2] float32."""
        c = self.config
        x = self.attn_norm(h)
        q = _rope(self.q_proj(x).unflatten(-1, (self.num_heads, c.head_dim)), cos, sin)
        k = _rope(self.k_proj(x).unflatten(-1, (self.num_kv_heads, c.head_dim)), cos, sin)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, c.head_dim))
        # The output buffer is allocated by the piece before the op, as engines require.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        llama_attention(q, k, v, out)
        h = h + self.o_proj(out.flatten(2))
        x = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaModel(nn.Module):
    """Llama-style causal LM, prefill only.

    ``forward(input_ids [B, S] int64, positions [B, S] int64) -> logits [B, S, vocab] float32``.
    Attention is causal over the S tokens of each row whatever ``positions`` holds; positions
    only drive RoPE.

    Args:
        config: sizes; the default config when None.
        group: a ``torch.distributed`` process group to run tensor-parallel over; None (the
            default) runs in one process.

    Raises:
        ValueError: the group size does not divide the heads, kv heads, intermediate size or
            vocabulary.
    """

    def __init__(self, config: LlamaConfig | None = None, group=None) -> None:
        super().__init__()
        self.config = config = config or LlamaConfig()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, group) for _ in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if group is not None:
            self.embed = tp.VocabParallelEmbedding(self.embed, group)
            self.lm_head = tp.ColumnParallelLinear(
                self.lm_head, group, "the vocabulary", gather_output=True
            )
        d = config.head_dim
        inv_freq = config.rope_theta ** (-torch.arange(0, d, 2) / d)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Logits for every position.

        Args:
            input_ids: [B, S] int64.
            positions: [B, S] int64 token positions (RoPE only).

        Returns:
            [B, S, vocab_size] float32.
        """
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


def build(config: LlamaConfig | None = None, seed: int = 0, group=None) -> LlamaModel:
    """A :class:`LlamaModel` in eval mode, weights drawn deterministically from ``seed``.

    Seeds the global RNG (``torch.manual_seed``) before initialising. Parameters do not require
    grad (inference model). With a process ``group``, each rank gets its shards of the
    single-process model built from the same seed.

    Raises:
        ValueError: the group size does not divide a split dim (see :class:`LlamaModel`).
    """
    torch.manual_seed(seed)
    return LlamaModel(config, group).eval().requires_grad_(False)


def example(batch_size: int = 2, seq_len: int = 8) -> tuple[LlamaModel, tuple[Tensor, Tensor]]:
    """A built model and inputs ``(input_ids [B, S] int64, positions [B, S] int64)``.

    Token ids come from a generator seeded with 0; positions are ``0..S-1`` per row.
    """
    model = build()
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(model.config.vocab_size, (batch_size, seq_len), generator=gen)
    positions = torch.arange(seq_len).expand(batch_size, seq_len).contiguous()
    return model, (input_ids, positions)
