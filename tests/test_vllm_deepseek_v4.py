"""vLLM's DeepSeek-V4 attention, in a stand-in with vLLM's class and method names: fxsplit's
presets find the regions vLLM's runners choose by a function pointer.

vLLM's DeepSeek-V4 needs kernels these CPUs lack, so this stand-in keeps its structure only
(vLLM 0.32, ``vllm/models/deepseek_v4/attention.py``): the attention module picks
``_prepare_and_attn`` under the V2 model runner and ``_prepare_and_attn_eager`` (which calls
it) under V1, and ``_prepare_and_attn`` prepares the inputs (query rotary, KV-cache insert at
the step's slots, the indexer's queries through ``DeepseekV4Indexer``, the compressor) before
``_sparse_indexer_and_attn`` runs the indexer op (``SparseAttnIndexer``) and attention. Under
fxsplit's v1 the whole preparation runs eagerly; under v2 only the indexer and attention do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit import counters

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

HIDDEN, HEADS, HEAD_DIM, SLOTS, TOPK = 32, 2, 16, 64, 4


class RotaryEmbedding(nn.Module):
    """Rotary over the last dim, from the positions ([T] int64)."""

    def __init__(self, dim: int):
        super().__init__()
        self.inv_freq = nn.Buffer(10000 ** (-torch.arange(0, dim, 2) / dim), persistent=False)

    def forward(self, positions, x):
        angles = positions[:, None].float() * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class DeepseekCompressor(nn.Module):
    """Compresses the KV scores into a cache of its own, written at the step's slots."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HEAD_DIM, bias=False)
        self.cache = nn.Buffer(torch.zeros(SLOTS, HEAD_DIM), persistent=False)

    def forward(self, kv_score, positions, rotary_emb, slot_mapping):
        self.cache.index_copy_(0, slot_mapping, rotary_emb(positions, self.proj(kv_score)))


class SparseAttnIndexer(nn.Module):
    """The indexer op: scores every cached key per query and picks the top-k slots."""

    def forward(self, index_q, keys, weights):
        scores = (torch.einsum("thd,sd->ths", index_q, keys).relu() * weights[..., None]).sum(1)
        return scores.topk(TOPK, dim=-1).indices


class DeepseekV4Indexer(nn.Module):
    """Prepares the indexer's queries and weights; owns the indexer op and its compressor."""

    def __init__(self):
        super().__init__()
        self.wq_b = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.weights_proj = nn.Linear(HIDDEN, HEADS, bias=False)
        self.indexer_op = SparseAttnIndexer()
        self.compressor = DeepseekCompressor()

    def forward(self, hidden_states, qr, positions, rotary_emb, slot_mapping):
        index_q = rotary_emb(positions, self.wq_b(qr).view(-1, HEADS, HEAD_DIM))
        self.compressor(hidden_states, positions, rotary_emb, slot_mapping)
        return index_q, self.weights_proj(hidden_states)


class DeepseekV4Attention(nn.Module):
    """vLLM's DeepSeek-V4 attention layer, its structure and names."""

    def __init__(self, use_v2_model_runner: bool):
        super().__init__()
        self.wq_a = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wkv = nn.Linear(HIDDEN, HEAD_DIM, bias=False)
        self.wq_b = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.rotary_emb = RotaryEmbedding(HEAD_DIM)
        self.indexer = DeepseekV4Indexer()
        self.compressor = DeepseekCompressor()
        self.kv_cache = nn.Buffer(torch.zeros(SLOTS, HEAD_DIM), persistent=False)
        # vLLM's choice per runner: the wide eager region under V1
        self._prepare_and_attn_fn = (
            self._prepare_and_attn if use_v2_model_runner else self._prepare_and_attn_eager
        )

    def forward(self, positions, hidden_states, slot_mapping):
        out = hidden_states.new_empty(hidden_states.shape[0], HEADS, HEAD_DIM)
        qr, kv = self.wq_a(hidden_states), self.wkv(hidden_states)
        self._prepare_and_attn_fn(hidden_states, qr, kv, positions, slot_mapping, out)
        return self.o_proj(out.flatten(1))

    def _prepare_and_attn_eager(self, hidden_states, qr, kv, positions, slot_mapping, out):
        self._prepare_and_attn(hidden_states, qr, kv, positions, slot_mapping, out)

    def _prepare_and_attn(self, hidden_states, qr, kv, positions, slot_mapping, out):
        q = self.rotary_emb(positions, self.wq_b(qr).view(-1, HEADS, HEAD_DIM))
        self.kv_cache.index_copy_(0, slot_mapping, self.rotary_emb(positions, kv))
        index_q, weights = self.indexer(hidden_states, qr, positions, self.rotary_emb, slot_mapping)
        self.compressor(hidden_states, positions, self.rotary_emb, slot_mapping)
        self._sparse_indexer_and_attn(index_q, weights, q, out)

    def _sparse_indexer_and_attn(self, index_q, weights, q, out):
        picked = self.indexer.indexer_op(index_q, self.indexer.compressor.cache, weights)
        self.forward_mqa(q, picked, out)

    def forward_mqa(self, q, picked, out):
        kv = self.kv_cache[picked][:, None]  # [T, 1, TOPK, HEAD_DIM], shared by the heads
        attn = F.scaled_dot_product_attention(q[:, :, None], kv, kv).squeeze(2)
        out.copy_(attn)


def _step(tokens: int, step: int):
    g = torch.Generator().manual_seed(step)
    positions = torch.arange(tokens) + step
    slots = torch.randperm(SLOTS, generator=g)[:tokens]
    return positions, torch.randn(tokens, HIDDEN, generator=g), slots


def _compiled(runner: str):
    torch.manual_seed(0)
    model = DeepseekV4Attention(use_v2_model_runner=runner == "v2").eval()
    reference = DeepseekV4Attention(use_v2_model_runner=runner == "v2").eval()
    reference.load_state_dict(model.state_dict())
    backend = fxsplit.Backend(capture="emulate", runner=runner, input_binding="copy")
    return model, reference, backend, torch.compile(model, backend=backend, dynamic=True)


def _in(node, name: str) -> bool:
    """Whether a module of class ``name`` encloses the node."""
    stack = node.meta.get("nn_module_stack", {}).values()
    return any(getattr(cls, "__name__", str(cls)).endswith(name) for _, cls in stack)


def _kinds(backend):
    """Each node of the plan's pieces -> (node, kind)."""
    split = backend.compiled[0]
    nodes = {n.name: n for n in split.graph_module.graph.nodes}
    return [(nodes[name], piece) for piece in split.plan.pieces for name in piece.nodes]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_vllm_deepseek_v4_regions_follow_the_runner(runner):
    model, reference, backend, compiled = _compiled(runner)
    with torch.no_grad():
        for step in range(6):
            args = _step(3 if step % 2 else 4, step)
            assert torch.equal(compiled(*args), reference(*args)), step
            assert torch.equal(model.kv_cache, reference.kv_cache)
    assert counters.snapshot()["replays"] > 0
    kinds = _kinds(backend)
    eager = [n for n, p in kinds if p.kind == "eager"]
    prep = [n for n in eager if any(r == "preset:engine_attn_prep" for r in _reasons(kinds, n))]
    indexer_or_attention = [
        n
        for n in eager
        if _in(n, "DeepseekV4Indexer")
        or _in(n, "SparseAttnIndexer")
        or "attention" in str(n.target)
    ]
    rotary = [n for n, _ in kinds if _in(n, "RotaryEmbedding")]
    writes = [
        n for n, _ in kinds if n.target in (torch.ops.aten.index_copy_.default, "index_copy_")
    ]
    assert rotary and writes
    if runner == "v1":
        # the whole of _prepare_and_attn: one eager piece, the projections around it captured
        assert len(backend.plans[0].eager) == 1 and prep
        assert all(n in eager for n in (*rotary, *writes))
        assert [p.kind for p in backend.plans[0].pieces] == ["captured", "eager", "captured"]
    else:
        assert not prep
        assert set(eager) == set(indexer_or_attention)  # only the indexer and attention
        assert any(p.kind == "captured" for n, p in kinds if n in writes)  # KV-cache insert


def _reasons(kinds, node):
    return next(p.reasons for n, p in kinds if n is node)
