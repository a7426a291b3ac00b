"""Tests of the reference models in plain eager and under torch.compile(backend="eager")."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

import fxsplit
from fxsplit.models import deepseek_v4 as dsv4
from fxsplit.models import llama
from fxsplit.regions import node_regions

METADATA = ("positions", "slot_mapping", "block_table", "seq_lens")


pytestmark = pytest.mark.usefixtures("fresh_capture_state")


def _compile(model, backend="eager"):
    return torch.compile(model, backend=backend, dynamic=True, fullgraph=True)


class _Recorder:
    """A backend that keeps every graph Dynamo hands it and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


# --------------------------------------------------------------------------- DeepSeek-V4: pieces


def test_lightning_indexer_matches_eq1_and_eq2():
    gen = torch.Generator().manual_seed(1)
    t, heads, dim, s, k = 5, 3, 4, 12, 4
    q = torch.randn(t, heads, dim, generator=gen)
    w = torch.randn(t, heads, generator=gen)
    keys = torch.randn(t, s, dim, generator=gen)
    n_valid = [12, 7, 4, 2, 1]
    valid = torch.arange(s)[None, :] < torch.tensor(n_valid)[:, None]

    picked, picked_valid = dsv4.lightning_indexer(q, w, keys, valid, k)

    assert picked.shape == picked_valid.shape == (t, k)
    for row in range(t):
        score = [
            sum(w[row, j] * torch.relu(q[row, j] @ keys[row, pos]) for j in range(heads))
            for pos in range(n_valid[row])
        ]
        got = picked[row][picked_valid[row]].tolist()
        assert len(set(got)) == len(got) and all(p < n_valid[row] for p in got)
        # Compare score multisets, not indices: ReLU makes exact ties (zeros) common.
        want = sorted((float(x) for x in score), reverse=True)[:k]
        assert sorted((float(score[p]) for p in got), reverse=True) == pytest.approx(want)
        assert int(picked_valid[row].sum()) == min(k, n_valid[row])


def test_sparse_mla_attention_matches_naive():
    gen = torch.Generator().manual_seed(2)
    t, h, dn, dr, dv, r, k = 3, 2, 4, 2, 3, 5, 4
    q_nope, q_pe = torch.randn(t, h, dn, generator=gen), torch.randn(t, h, dr, generator=gen)
    latent, k_pe = torch.randn(t, k, r, generator=gen), torch.randn(t, k, dr, generator=gen)
    w = torch.randn(h * (dn + dv), r, generator=gen)
    valid = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 1, 0]], dtype=torch.bool)
    scale = 0.3

    out = dsv4.sparse_mla_attention(q_nope, q_pe, latent, k_pe, valid, w, dv, scale)

    want = torch.zeros(t, h, dv)
    for i in range(t):
        for head in range(h):
            wk = w[head * (dn + dv) : head * (dn + dv) + dn]
            wv = w[head * (dn + dv) + dn : (head + 1) * (dn + dv)]
            keep = valid[i].nonzero().flatten()
            scores = torch.stack(
                [
                    scale * (q_nope[i, head] @ (wk @ latent[i, s]) + q_pe[i, head] @ k_pe[i, s])
                    for s in keep
                ]
            )
            probs = scores.softmax(0)
            want[i, head] = sum(p * (wv @ latent[i, s]) for p, s in zip(probs, keep, strict=True))
    torch.testing.assert_close(out, want.flatten(1))


def test_context_slots_follow_block_table():
    table = torch.tensor([[5, 2, 0], [7, 0, 0]], dtype=torch.int32)
    slots, valid = dsv4.context_slots(table, torch.tensor([6, 1]), block_size=4, max_seq_len=12)
    assert slots[0].tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 0, 1, 2, 3]
    assert slots[1, :4].tolist() == [28, 29, 30, 31]
    assert valid.sum(1).tolist() == [6, 1]


def test_rope_is_a_rotation_by_position():
    inv_freq = torch.tensor([1.0, 0.1])
    cos, sin = dsv4.rope_cos_sin(torch.tensor([0, 3]), inv_freq)
    x = torch.randn(2, 3, 4)
    y = dsv4.apply_rope(x, cos, sin)
    torch.testing.assert_close(y[0], x[0])  # position 0 is the identity
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    angle = 3 * 1.0
    want = x[1, :, 0] * math.cos(angle) - x[1, :, 2] * math.sin(angle)
    torch.testing.assert_close(y[1, :, 0], want)


# --------------------------------------------------------------------------- DeepSeek-V4: runner


def test_runner_v1_fresh_and_v2_persistent_give_equal_values():
    cfg = dsv4.DeepseekV4Config()
    v1 = dsv4.DecodeRunner(cfg, 6, persistent=False, seed=3)
    v2 = dsv4.DecodeRunner(cfg, 6, persistent=True, seed=3)
    ptrs, kept = None, []
    for b in (3, 5, 5, 2, 6, 4):
        a, p = v1.step(b), v2.step(b)
        for x, y in zip(a, p, strict=True):
            assert torch.equal(x, y)
        assert a.block_table.dtype == torch.int32 and a.input_ids.dtype == torch.int64
        step_ptrs = [t.data_ptr() for t in p]
        assert ptrs is None or step_ptrs == ptrs  # views of the same buffers every step
        ptrs = step_ptrs
        assert all(t.data_ptr() != old.data_ptr() for t, old in zip(a, kept, strict=False))
        kept = list(a)
        torch.testing.assert_close(a.seq_lens, a.positions + 1)


def test_runner_join_leave_allocates_and_frees_blocks():
    cfg = dsv4.DeepseekV4Config(num_blocks=8, max_blocks_per_seq=2, block_size=4)
    r = dsv4.DecodeRunner(cfg, 4)
    for _ in range(5):
        r.step(2)
    assert r.lengths() == {0: 5, 1: 5}
    r.step(3)  # one joins
    assert r.lengths() == {0: 6, 1: 6, 2: 1}
    inputs = r.step(1)  # the newest leave first
    assert r.lengths() == {0: 7} and inputs.seq_lens.tolist() == [7]
    assert len(r._free_blocks) == 8 - 2
    r.step([0, 9])  # explicit ids: 9 joins, nothing else changes
    assert r.lengths() == {0: 8, 9: 1}
    r.step(2)  # sequence 0 is full: it retires, a new one joins
    assert r.lengths() == {9: 2, 10: 1}
    with pytest.raises(ValueError, match="outside"):
        r.step([])


def test_example_has_short_and_long_sequences():
    model, inputs = dsv4.example(batch_size=4)
    topk = model.config.index_topk
    assert inputs.seq_lens.min() < topk < inputs.seq_lens.max()
    logits = model(*inputs)
    assert logits.shape == (4, model.config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_build_is_deterministic_and_clone_is_independent():
    a, b = dsv4.build(seed=5), dsv4.build(seed=5)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    c = dsv4.clone_model(a)
    runner = dsv4.DecodeRunner(a.config, 2)
    a(*runner.step(2))
    assert a.layers[0].attn.kv_cache.abs().sum() > 0
    assert c.layers[0].attn.kv_cache.abs().sum() == 0


def test_sequence_result_does_not_depend_on_batch_mates():
    # Catches slot, block-table and masking mistakes: sequence 0 must see only its own tokens.
    alone, crowded = dsv4.build(), dsv4.build()
    solo = dsv4.DecodeRunner(alone.config, 4)
    busy = dsv4.DecodeRunner(crowded.config, 4)
    for step in range(12):
        want = alone(*solo.step([0]))
        mates = [i for i in (1, 2, 3) if step >= 3 * i - 2]
        got = crowded(*busy.step([*mates[:1], 0, *mates[1:]]))
        torch.testing.assert_close(got[min(1, len(mates))], want[0])


# --------------------------------------------------------------------------- DeepSeek-V4: compile


SCHEDULE = [2, 3, 3, 4, 4, 2, 3, 4, 4, 3, 4, 2]  # B >= 2: Dynamo specialises size 1


def test_deepseek_compiled_matches_eager_over_changing_batches():
    counters.clear()  # Dynamo's counters (torch._dynamo.reset keeps them): unique_graphs below
    eager = dsv4.build()
    compiled_model = dsv4.clone_model(eager)
    compiled = _compile(compiled_model)
    # Eager reads fresh (v1) metadata, compiled reads persistent (v2) views: same values.
    ref = dsv4.run_decode(eager, dsv4.DecodeRunner(eager.config, 4), SCHEDULE)
    runner = dsv4.DecodeRunner(eager.config, 4, persistent=True)
    out = dsv4.run_decode(compiled, runner, SCHEDULE)
    assert max(runner.lengths().values()) > eager.config.index_topk
    for r, o in zip(ref, out, strict=True):
        torch.testing.assert_close(o, r)
    for le, lc in zip(eager.layers, compiled_model.layers, strict=True):
        torch.testing.assert_close(lc.attn.index_cache, le.attn.index_cache)
    assert counters["stats"]["unique_graphs"] == 1


def test_deepseek_graph_has_adjacent_regions_and_confined_metadata():
    model, inputs = dsv4.example()
    rec = _Recorder()
    torch.testing.assert_close(_compile(dsv4.clone_model(model), rec)(*inputs), model(*inputs))
    (gm,) = rec.graphs
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    runs = []
    for n in nodes:
        regions = node_regions(n.meta.get("custom"))
        if not runs or runs[-1] != regions:
            runs.append(regions)
    per_layer = [(fxsplit.ATTN_PREP,), (fxsplit.SPARSE_INDEXER,), (fxsplit.ATTENTION,), ()]
    assert runs == [(), *per_layer * model.config.num_layers]

    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name in METADATA:
        (ph,) = [n for k, n in placeholders.items() if k == f"l_{name}_"]
        assert ph.users
        for user in ph.users:
            assert node_regions(user.meta.get("custom")) == (fxsplit.ATTN_PREP,), user


# --------------------------------------------------------------------------- Llama


def _naive_causal_gqa(q, k, v):
    _, s, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def test_llama_attention_op_writes_out_buffer():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 5, 4, 8, generator=gen)
    k, v = torch.randn(2, 5, 2, 8, generator=gen), torch.randn(2, 5, 2, 8, generator=gen)
    out = torch.full_like(q, float("nan"))
    assert llama.llama_attention(q, k, v, out) is None
    torch.testing.assert_close(out, _naive_causal_gqa(q, k, v))
    op = torch.ops.fxsplit.llama_attention.default
    assert op.name() in llama.SPLITTING_OPS


def test_llama_eager_shapes_and_causality():
    model, (ids, pos) = llama.example(batch_size=2, seq_len=8)
    logits = model(ids, pos)
    assert logits.shape == (2, 8, model.config.vocab_size) and logits.dtype == torch.float32
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab_size
    torch.testing.assert_close(model(changed, pos)[:, :-1], logits[:, :-1])


def test_llama_compiled_matches_eager_across_shapes():
    model, inputs = llama.example(batch_size=2, seq_len=8)
    rec = _Recorder()
    compiled = _compile(model, backend=rec)
    for b, s in ((2, 8), (3, 5), (4, 11)):
        _, inputs = llama.example(batch_size=b, seq_len=s)
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    (gm,) = rec.graphs  # dynamic shapes: one graph for all three
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.fxsplit.llama_attention.default]
    assert len(calls) == model.config.num_layers
    for call in calls:
        out_buf = call.args[3]
        assert out_buf.target is torch.empty  # allocated by the preceding piece


def test_llama_compiles_with_eager_backend():
    model, inputs = llama.example()
    torch.testing.assert_close(_compile(model)(*inputs), model(*inputs))
