"""A small DeepSeek-V4-style decode model with DeepSeek sparse attention (DSA), plus its runner.

The model is written the way serving engines write decode models: one new token per sequence per
step (so the token count T equals the batch size B), a paged KV cache kept in persistent buffers
written in place, and per-step metadata (positions, slot mapping, block table, sequence lengths)
passed in as tensors. Attention uses multi-head latent attention (MLA: low-rank query and a shared
compressed KV latent) restricted to the top-k context tokens chosen by the lightning indexer of
the DeepSeek-V3.2 paper ("DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models",
section 2.1): eq. 1 scores every cached token, eq. 2 keeps the top-k.

Each layer's attention is three adjacent regions with no captured compute between them:

1. :data:`fxsplit.ATTN_PREP`: everything that reads per-step metadata (RoPE from ``positions``,
   cache writes at ``slot_mapping``, context slots from ``block_table`` and ``seq_lens``).
   Metadata tensors are consumed nowhere else, so under runner "v1" the eager prep reads fresh
   metadata and captured pieces never do.
2. :data:`fxsplit.SPARSE_INDEXER`: lightning indexer scores and top-k selection.
3. :data:`fxsplit.ATTENTION`: sparse MLA attention over the selected slots.

:class:`DecodeRunner` builds the metadata each step like an engine's model runner: fresh tensors
("v1", ``persistent=False``) or views of persistent buffers updated in place ("v2",
``persistent=True``).

Everything is float32 and runs on CPU; the model traces with Dynamo into one graph under
``fullgraph=True, dynamic=True`` (no ``.item()``, no data-dependent shapes or branches).

Tensor parallel: ``build(group=...)`` (or ``DeepseekV4Model(config, group)``) shards the model
built from the same seed over a ``torch.distributed`` process group (:mod:`fxsplit.models.tp`):
attention heads and indexer heads split across ranks (``q_b``, ``kv_b``, ``index_q``,
``index_weights`` column-parallel; ``o_proj`` row-parallel with an ``all_reduce``; the indexer's
per-head score sum all-reduced inside the indexer region), the MLP column/row-parallel with a
``reduce_scatter_tensor`` + ``all_gather_tensor`` over the hidden dim, the embedding
vocab-parallel (``all_reduce``) and the logits vocab-parallel (``all_gather_tensor``). The
low-rank projections, norms and the paged caches are replicated. Regions are the same as with
one process.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxsplit.models import tp
from fxsplit.regions import ATTENTION, ATTN_PREP, SPARSE_INDEXER, region

__all__ = [
    "DecodeInputs",
    "DecodeRunner",
    "DeepseekV4Attention",
    "DeepseekV4Config",
    "DeepseekV4DecoderLayer",
    "DeepseekV4Model",
    "apply_rope",
    "build",
    "clone_model",
    "context_slots",
    "example",
    "lightning_indexer",
    "rope_cos_sin",
    "run_decode",
    "sparse_mla_attention",
]


@dataclass(frozen=True)
class DeepseekV4Config:
    """Model and paged-cache sizes; the defaults make a tiny model that runs fast on CPU.

    Attributes:
        vocab_size: vocabulary size.
        hidden_size: residual stream width.
        num_layers: decoder layers.
        num_heads: attention heads.
        q_lora_rank: rank of the low-rank query projection (MLA).
        kv_lora_rank: width of the compressed KV latent cached per token (MLA).
        qk_nope_dim: per-head query/key dims without RoPE.
        qk_rope_dim: per-head query/key dims with RoPE; the rope key is shared by all heads.
        v_head_dim: per-head value dims.
        index_n_heads: lightning indexer heads (64 in V3.2).
        index_head_dim: lightning indexer head dims (128 in V3.2); the first ``qk_rope_dim`` get
            RoPE.
        index_topk: tokens each query attends to, k of eq. 2 (2048 in V3.2, 512 in V4).
        block_size: tokens per KV-cache block.
        num_blocks: KV-cache blocks per layer.
        max_blocks_per_seq: block table width; a sequence holds at most
            ``max_blocks_per_seq * block_size`` tokens.
        intermediate_size: SwiGLU MLP hidden width.
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_dim: int = 16
    qk_rope_dim: int = 8
    v_head_dim: int = 16
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 8
    block_size: int = 4
    num_blocks: int = 64
    max_blocks_per_seq: int = 8
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.qk_rope_dim % 2 or self.qk_rope_dim > self.index_head_dim:
            raise ValueError(
                f"qk_rope_dim must be even and <= index_head_dim, got {self.qk_rope_dim} "
                f"(index_head_dim {self.index_head_dim})"
            )
        if self.index_topk > self.max_seq_len:
            # topk over the context needs at least k candidates, valid or not.
            raise ValueError(
                f"index_topk ({self.index_topk}) exceeds max_blocks_per_seq * block_size "
                f"({self.max_seq_len})"
            )

    @property
    def max_seq_len(self) -> int:
        """Most tokens one sequence can hold: ``max_blocks_per_seq * block_size``."""
        return self.max_blocks_per_seq * self.block_size

    @property
    def num_slots(self) -> int:
        """KV-cache slots per layer: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size


# ---------------------------------------------------------------------------------------------
# Functional pieces (module-level so tests can check them against naive references)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE angles for token positions.

    Args:
        positions: [T] int64 token positions (0-based).
        inv_freq: [D/2] float32 inverse frequencies, ``theta ** (-2i / D)``.

    Returns:
        ``(cos, sin)``, each [T, D/2] float32.
    """
    angles = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the last dim of ``x`` by RoPE (half-split "NeoX" pairing: i with i + D/2).

    Args:
        x: [T, ..., D] float32.
        cos, sin: [T, D/2] float32 from :func:`rope_cos_sin`.

    Returns:
        [T, ..., D] float32.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def context_slots(
    block_table: Tensor, seq_lens: Tensor, block_size: int, max_seq_len: int
) -> tuple[Tensor, Tensor]:
    """Cache slots of every context position of each sequence, and which of them hold tokens.

    Position ``j`` of sequence ``b`` lives in slot
    ``block_table[b, j // block_size] * block_size + j % block_size``; it is valid when
    ``j < seq_lens[b]``.

    Args:
        block_table: [B, >= max_seq_len / block_size] int32 or int64 block ids; entries past a
            sequence's last block must still be in range (their slots are masked out).
        seq_lens: [B] int64 tokens in each sequence, the current token included.
        block_size: tokens per block.
        max_seq_len: context positions to enumerate (a Python int, so shapes stay static).

    Returns:
        ``(slots, valid)``: [B, max_seq_len] int64 slot ids and [B, max_seq_len] bool.
    """
    j = torch.arange(max_seq_len, device=block_table.device)
    blocks = block_table.long().index_select(1, j // block_size)
    slots = blocks * block_size + j % block_size
    valid = j[None, :] < seq_lens[:, None]
    return slots, valid


def lightning_indexer(
    q: Tensor, weights: Tensor, keys: Tensor, valid: Tensor, topk: int, group=None
) -> tuple[Tensor, Tensor]:
    """Lightning indexer scores (DeepSeek-V3.2 eq. 1) and top-k selection (eq. 2).

    ``I[t, s] = sum_j weights[t, j] * ReLU(q[t, j] . keys[t, s])`` over index heads ``j``;
    positions with ``valid`` False score ``-inf``. The ``topk`` highest-scoring positions are
    selected. A sequence with fewer than ``topk`` valid positions still selects ``topk``: the
    extra ones come back with a False mask instead of a host-side branch.

    Args:
        q: [T, H_i, D_i] float32 index queries (scale folded into ``weights``).
        weights: [T, H_i] float32 per-head weights ``w[t, j]``.
        keys: [T, S, D_i] float32 index keys of each token's S context positions.
        valid: [T, S] bool, True where a context position holds a token.
        topk: k, a Python int <= S.
        group: tensor-parallel process group when ``q`` and ``weights`` hold this rank's index
            heads only: the per-head sum is then all-reduced over the ranks; None for all heads.

    Returns:
        ``(positions, selected_valid)``: [T, topk] int64 indices into the S context positions,
        and [T, topk] bool.
    """
    logits = torch.einsum("thd,tsd->ths", q, keys).relu()
    scores = tp.all_reduce((weights[:, :, None] * logits).sum(dim=1), group)
    scores = scores.masked_fill(~valid, float("-inf"))
    positions = scores.topk(topk, dim=-1).indices
    return positions, valid.gather(1, positions)


def sparse_mla_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    latent: Tensor,
    k_pe: Tensor,
    valid: Tensor,
    kv_b_weight: Tensor,
    v_head_dim: int,
    scale: float,
) -> Tensor:
    """Multi-head latent attention over a few selected tokens per query.

    The per-token latent is up-projected to per-head keys (no-RoPE part) and values; the
    RoPE part of the key is shared by all heads. Scores are ``scale * (q_nope . k_nope +
    q_pe . k_pe)``, masked where ``valid`` is False, softmaxed over the selected tokens.

    Args:
        q_nope: [T, H, Dn] float32.
        q_pe: [T, H, Dr] float32, RoPE applied.
        latent: [T, K, R] float32 normalised KV latents of the K selected tokens.
        k_pe: [T, K, Dr] float32 rope keys of the selected tokens, RoPE applied.
        valid: [T, K] bool; every row needs at least one True.
        kv_b_weight: [H * (Dn + Dv), R] float32 up-projection weight.
        v_head_dim: Dv.
        scale: softmax scale, usually ``(Dn + Dr) ** -0.5``.

    Returns:
        [T, H * Dv] float32.
    """
    _, h, dn = q_nope.shape
    kv = F.linear(latent, kv_b_weight).unflatten(-1, (h, dn + v_head_dim))
    k_nope, v = kv.split((dn, v_head_dim), dim=-1)
    scores = torch.einsum("thd,tkhd->thk", q_nope, k_nope)
    scores = scores + torch.einsum("thd,tkd->thk", q_pe, k_pe)
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("thk,tkhd->thd", probs, v).flatten(1)


# ---------------------------------------------------------------------------------------------
# Modules


class DeepseekV4Attention(nn.Module):
    """MLA attention with DeepSeek sparse attention over a paged cache, for one layer.

    Owns this layer's paged caches as non-persistent buffers (kept across steps, left out of the
    state dict), each indexed by slot ``block * block_size + offset``:

    - ``kv_cache``: [num_slots, kv_lora_rank] float32 normalised KV latents.
    - ``pe_cache``: [num_slots, qk_rope_dim] float32 rope keys, RoPE applied.
    - ``index_cache``: [num_slots, index_head_dim] float32 indexer keys, RoPE applied.

    With a tensor-parallel ``group`` this rank holds ``num_heads / tp`` attention heads and
    ``index_n_heads / tp`` index heads (the caches are replicated).

    Raises:
        ValueError: the group size does not divide ``num_heads`` or ``index_n_heads``.
    """

    def __init__(self, config: DeepseekV4Config, group=None) -> None:
        super().__init__()
        c = config
        self.config = c
        heads = tp.shard_count(c.num_heads, group, "num_heads (attention heads)")
        index_heads = tp.shard_count(c.index_n_heads, group, "index_n_heads (indexer heads)")
        self.num_heads, self.index_n_heads, self.group = heads, index_heads, group
        qk_head_dim = c.qk_nope_dim + c.qk_rope_dim
        self.scale = qk_head_dim**-0.5
        # The indexer's per-head weights absorb both the head-count and dot-product scales.
        self.index_weight_scale = c.index_n_heads**-0.5 * c.index_head_dim**-0.5

        self.q_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = nn.RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
        self.q_b = nn.Linear(c.q_lora_rank, c.num_heads * qk_head_dim, bias=False)
        self.kv_a = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps)
        self.kv_b = nn.Linear(
            c.kv_lora_rank, c.num_heads * (c.qk_nope_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=False)
        # Lightning indexer (V3.2 section 2.1): queries from the low-rank query, one key per
        # token from a LayerNorm'd projection, per-head weights from the hidden state.
        self.index_q = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, bias=False)
        self.index_k = nn.Linear(c.hidden_size, c.index_head_dim, bias=False)
        self.index_k_norm = nn.LayerNorm(c.index_head_dim)
        self.index_weights = nn.Linear(c.hidden_size, c.index_n_heads, bias=False)

        inv_freq = c.rope_theta ** (-torch.arange(0, c.qk_rope_dim, 2) / c.qk_rope_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        for name, width in (
            ("kv_cache", c.kv_lora_rank),
            ("pe_cache", c.qk_rope_dim),
            ("index_cache", c.index_head_dim),
        ):
            self.register_buffer(name, torch.zeros(c.num_slots, width), persistent=False)
        if group is not None:
            self.q_b = tp.ColumnParallelLinear(self.q_b, group, "attention heads")
            self.kv_b = tp.ColumnParallelLinear(self.kv_b, group, "attention heads")
            self.o_proj = tp.RowParallelLinear(self.o_proj, group, "attention heads")
            self.index_q = tp.ColumnParallelLinear(self.index_q, group, "indexer heads")
            self.index_weights = tp.ColumnParallelLinear(self.index_weights, group, "indexer heads")

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        slot_mapping: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
    ) -> Tensor:
        """Attend from each sequence's new token; writes that token into the caches first.

        Args:
            x: [B, hidden_size] float32 normalised hidden states.
            positions, slot_mapping, block_table, seq_lens: see :meth:`DeepseekV4Model.forward`.

        Returns:
            [B, hidden_size] float32.
        """
        c = self.config
        rd = c.qk_rope_dim

        # Projections: metadata-free, captured under every runner.
        q_lat = self.q_a_norm(self.q_a(x))
        q = self.q_b(q_lat).unflatten(-1, (self.num_heads, c.qk_nope_dim + rd))
        q_nope, q_pe = q.split((c.qk_nope_dim, rd), dim=-1)
        latent, k_pe = self.kv_a(x).split((c.kv_lora_rank, rd), dim=-1)
        latent = self.kv_a_norm(latent)
        iq = self.index_q(q_lat).unflatten(-1, (self.index_n_heads, c.index_head_dim))
        ik = self.index_k_norm(self.index_k(x))
        iw = self.index_weights(x) * self.index_weight_scale

        # The three regions below must stay adjacent: anything between them would be a captured
        # piece of its own under runner "v1".
        with region(ATTN_PREP):
            cos, sin = rope_cos_sin(positions, self.inv_freq)
            q_pe = apply_rope(q_pe, cos, sin)
            k_pe = apply_rope(k_pe, cos, sin)
            iq = torch.cat((apply_rope(iq[..., :rd], cos, sin), iq[..., rd:]), dim=-1)
            ik = torch.cat((apply_rope(ik[..., :rd], cos, sin), ik[..., rd:]), dim=-1)
            self.kv_cache.index_copy_(0, slot_mapping, latent)
            self.pe_cache.index_copy_(0, slot_mapping, k_pe)
            self.index_cache.index_copy_(0, slot_mapping, ik)
            ctx_slots, ctx_valid = context_slots(block_table, seq_lens, c.block_size, c.max_seq_len)

        with region(SPARSE_INDEXER):
            keys = self.index_cache[ctx_slots]
            picked, sel_valid = lightning_indexer(iq, iw, keys, ctx_valid, c.index_topk, self.group)
            sel_slots = ctx_slots.gather(1, picked)

        with region(ATTENTION):
            attn = sparse_mla_attention(
                q_nope,
                q_pe,
                self.kv_cache[sel_slots],
                self.pe_cache[sel_slots],
                sel_valid,
                self.kv_b.weight,
                c.v_head_dim,
                self.scale,
            )

        return self.o_proj(attn)


class DeepseekV4MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; [B, hidden] -> [B, hidden] float32.

    With a tensor-parallel ``group``: ``gate`` and ``up`` column-parallel, ``down``
    row-parallel, its sum a reduce-scatter + all-gather over the hidden dim.
    """

    def __init__(self, config: DeepseekV4Config, group=None) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        if group is not None:
            what = "intermediate_size"
            self.gate = tp.ColumnParallelLinear(self.gate, group, what)
            self.up = tp.ColumnParallelLinear(self.up, group, what)
            self.down = tp.RowParallelLinear(self.down, group, what, scatter_dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DeepseekV4DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config: DeepseekV4Config, group=None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = DeepseekV4Attention(config, group)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DeepseekV4MLP(config, group)

    def forward(
        self,
        h: Tensor,
        positions: Tensor,
        slot_mapping: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
    ) -> Tensor:
        h = h + self.attn(self.attn_norm(h), positions, slot_mapping, block_table, seq_lens)
        return h + self.mlp(self.mlp_norm(h))


class DeepseekV4Model(nn.Module):
    """Decode-only DeepSeek-V4-style causal LM with DeepSeek sparse attention (DSA).

    Attention per layer: MLA with a paged latent cache; the lightning indexer (DeepSeek-V3.2
    eq. 1) scores the sequence's cached tokens and attention runs over the top ``index_topk``
    (eq. 2). Omitted from the real V4: MoE, multi-token prediction, KV compression, FP8.

    ``forward`` mutates the layers' caches (writes the new tokens at ``slot_mapping``), so an
    eager reference and a compiled copy need separate instances (:func:`clone_model`). Running
    the same step twice on one instance is idempotent: it rewrites the same slots with the same
    values.

    Args:
        config: sizes; the default config when None.
        group: a ``torch.distributed`` process group to run tensor-parallel over (see the
            module docstring); None (the default) runs in one process. Its weights are this
            rank's shards of the weights the single-process model draws.

    Raises:
        ValueError: the group size does not divide the heads, index heads, vocabulary,
            intermediate or hidden size.
    """

    def __init__(self, config: DeepseekV4Config | None = None, group=None) -> None:
        super().__init__()
        self.config = config = config or DeepseekV4Config()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(config, group) for _ in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if group is not None:
            self.embed = tp.VocabParallelEmbedding(self.embed, group)
            self.lm_head = tp.ColumnParallelLinear(
                self.lm_head, group, "the vocabulary", gather_output=True
            )

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slot_mapping: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
    ) -> Tensor:
        """One decode step: one new token for each of B sequences.

        Args:
            input_ids: [B] int64 new token ids.
            positions: [B] int64 position of each new token (tokens before it in its sequence).
            slot_mapping: [B] int64 cache slot the new token is written to.
            block_table: [B, max_blocks_per_seq] int32 or int64 block ids of each sequence;
                unused entries must be valid block ids (e.g. 0).
            seq_lens: [B] int64 tokens in each sequence including the new one
                (``positions + 1``).

        Returns:
            [B, vocab_size] float32 logits for the next token.
        """
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, positions, slot_mapping, block_table, seq_lens)
        return self.lm_head(self.norm(h))


def build(config: DeepseekV4Config | None = None, seed: int = 0, group=None) -> DeepseekV4Model:
    """A :class:`DeepseekV4Model` in eval mode with weights drawn deterministically from ``seed``.

    Seeds the global RNG (``torch.manual_seed``) before initialising, as the default
    ``nn.Linear``/``nn.Embedding`` initialisers draw from it; caches start zeroed. Parameters
    do not require grad: cache writes from grad-requiring values would chain every step's
    autograd graph onto the caches. With a process ``group``, each rank gets its shards of the
    single-process model built from the same seed.

    Raises:
        ValueError: the group size does not divide a split dim (see :class:`DeepseekV4Model`).
    """
    torch.manual_seed(seed)
    return DeepseekV4Model(config, group).eval().requires_grad_(False)


def clone_model(model: nn.Module) -> nn.Module:
    """A deep copy with identical weights and cache contents at new addresses (process groups
    are shared, not copied)."""
    groups = {id(g): g for m in model.modules() if (g := getattr(m, "group", None)) is not None}
    return copy.deepcopy(model, memo=groups)


# ---------------------------------------------------------------------------------------------
# Runner


class DecodeInputs(NamedTuple):
    """One decode step's inputs, in :meth:`DeepseekV4Model.forward` argument order.

    Shapes and dtypes: ``input_ids`` [B] int64, ``positions`` [B] int64, ``slot_mapping`` [B]
    int64, ``block_table`` [B, max_blocks_per_seq] int32, ``seq_lens`` [B] int64.
    """

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    block_table: Tensor
    seq_lens: Tensor


@dataclass
class _Sequence:
    blocks: list[int]
    length: int  # tokens in the cache
    tokens: torch.Generator  # per-sequence stream, so a token never depends on batch mates


class DecodeRunner:
    """Feeds :class:`DeepseekV4Model` decode steps the way an engine's model runner does.

    Tracks live sequences, allocates KV-cache blocks as they grow, frees them when sequences
    leave, and draws each sequence's next input token from a generator seeded with
    ``(seed, seq_id)``, so two runners built and driven alike return equal inputs.

    Args:
        config: the model's config (cache geometry).
        max_batch_size: most sequences in one step.
        persistent: False ("v1" runner): every step returns freshly allocated tensors.
            True ("v2" runner): every step writes into max-size buffers allocated once and
            returns views ``buf[:B]`` of them (same ``data_ptr`` every step).
        seed: token stream seed.
        device: where step tensors live.
    """

    def __init__(
        self,
        config: DeepseekV4Config,
        max_batch_size: int,
        *,
        persistent: bool = False,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.config = config
        self.max_batch_size = max_batch_size
        self.persistent = persistent
        self.seed = seed
        self.device = torch.device(device)
        self.sequences: dict[int, _Sequence] = {}
        self._free_blocks = list(range(config.num_blocks))
        self._next_id = 0
        self._buffers: DecodeInputs | None = None
        if persistent:
            b, m = max_batch_size, config.max_blocks_per_seq
            self._buffers = DecodeInputs(
                *(torch.zeros(b, dtype=torch.int64, device=self.device) for _ in range(3)),
                torch.zeros(b, m, dtype=torch.int32, device=self.device),
                torch.zeros(b, dtype=torch.int64, device=self.device),
            )

    def add(self, seq_id: int | None = None) -> int:
        """Admit a new, empty sequence; returns its id (the next unused one when omitted)."""
        if seq_id is None:
            seq_id = self._next_id
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} is already live")
        self._next_id = max(self._next_id, seq_id + 1)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + seq_id)
        self.sequences[seq_id] = _Sequence(blocks=[], length=0, tokens=gen)
        return seq_id

    def remove(self, seq_id: int) -> None:
        """Retire a sequence and free its blocks."""
        self._free_blocks.extend(self.sequences.pop(seq_id).blocks)

    def lengths(self) -> dict[int, int]:
        """Tokens cached per live sequence id."""
        return {i: s.length for i, s in self.sequences.items()}

    def step(self, batch: int | list[int]) -> DecodeInputs:
        """Build the inputs of one decode step and advance the chosen sequences by one token.

        Args:
            batch: sequence ids to step (unknown ids are admitted first; live sequences not
                listed idle), or a batch size B: full sequences retire, the newest sequences
                retire while more than B are live, new ones join until B are live, and all
                live sequences step in admission order.

        Returns:
            :class:`DecodeInputs` for B sequences, in the order of ``batch``.

        Raises:
            ValueError: bad batch size, or a sequence is already at ``max_seq_len``.
            RuntimeError: out of KV-cache blocks.
        """
        ids = self._select(batch)
        if not 1 <= len(ids) <= self.max_batch_size:
            raise ValueError(f"batch of {len(ids)} outside 1..{self.max_batch_size}")
        cfg = self.config
        rows = []
        for i in ids:
            seq = self.sequences[i]
            if seq.length >= cfg.max_seq_len:
                raise ValueError(f"sequence {i} is full ({cfg.max_seq_len} tokens)")
            if seq.length % cfg.block_size == 0:
                if not self._free_blocks:
                    raise RuntimeError("out of KV-cache blocks")
                seq.blocks.append(self._free_blocks.pop(0))
            pos = seq.length
            slot = seq.blocks[pos // cfg.block_size] * cfg.block_size + pos % cfg.block_size
            token = int(torch.randint(cfg.vocab_size, (), generator=seq.tokens))
            seq.length += 1
            table = seq.blocks + [0] * (cfg.max_blocks_per_seq - len(seq.blocks))
            rows.append((token, pos, slot, table, seq.length))
        tok, pos, slot, table, lens = zip(*rows, strict=True)
        fresh = DecodeInputs(
            torch.tensor(tok, dtype=torch.int64),
            torch.tensor(pos, dtype=torch.int64),
            torch.tensor(slot, dtype=torch.int64),
            torch.tensor(table, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int64),
        )
        if self._buffers is None:
            return DecodeInputs(*(t.to(self.device) for t in fresh))
        b = len(ids)
        views = DecodeInputs(*(buf[:b] for buf in self._buffers))
        for view, src in zip(views, fresh, strict=True):
            view.copy_(src)
        return views

    def _select(self, batch: int | list[int]) -> list[int]:
        if not isinstance(batch, int):
            ids = list(batch)
            for i in ids:
                if i not in self.sequences:
                    self.add(i)
            return ids
        full = [i for i, s in self.sequences.items() if s.length >= self.config.max_seq_len]
        for i in full:
            self.remove(i)
        while len(self.sequences) > batch:
            self.remove(max(self.sequences))
        while len(self.sequences) < batch:
            self.add()
        return list(self.sequences)


def run_decode(model: nn.Module, runner: DecodeRunner, batches: list) -> list[Tensor]:
    """Run one decode step per entry of ``batches`` (see :meth:`DecodeRunner.step`).

    Returns:
        Each step's logits, [B_step, vocab_size] float32, cloned (a compiled model may reuse
        output memory).
    """
    return [model(*runner.step(b)).clone() for b in batches]


def example(batch_size: int = 4) -> tuple[DeepseekV4Model, DecodeInputs]:
    """A built model with warmed caches and the inputs of its next decode step (v1 runner).

    Sequences join staggered over ``3 * batch_size`` prior steps (capped by ``max_seq_len``), so
    at the returned step their lengths spread out (13, 10, 7, 4 for the default), both above and
    below ``index_topk``.

    Returns:
        ``(model, inputs)``; ``model(*inputs)`` gives [batch_size, vocab_size] float32.
    """
    model = build()
    cfg = model.config
    warmup = min(3 * batch_size, cfg.max_seq_len - 1)
    runner = DecodeRunner(cfg, batch_size)
    starts = [math.floor(i * warmup / batch_size) for i in range(batch_size)]
    for step in range(warmup):
        model(*runner.step([i for i in range(batch_size) if starts[i] <= step]))
    return model, runner.step(list(range(batch_size)))
