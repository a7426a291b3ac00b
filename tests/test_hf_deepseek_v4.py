"""transformers' DeepseekV4ForCausalLM, tiny and random (fxsplit.models.hf_deepseek_v4)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing

from fxsplit.models import hf_deepseek_v4 as hf

needs_hf = pytest.mark.skipif(
    not hf.available(), reason="needs transformers >= 5.8.1 with DeepseekV4ForCausalLM"
)

# Data-dependent or host-syncing ops that must not appear in the prefill graph.
_FORBIDDEN = {"nonzero", "unique", "masked_select", "item", "cpu", "tolist", "numpy"}


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def test_imports_without_transformers():
    tree = ast.parse(Path(hf.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "transformers"]


def test_available_false_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert hf.available.__wrapped__() is False
    assert isinstance(hf.available(), bool)


@needs_hf
def test_tiny_config():
    config = hf.tiny_config()
    assert config.num_hidden_layers == 3
    assert config.layer_types == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert config.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert config.index_topk == 4
    assert config.use_cache is False
    assert config._attn_implementation == "eager"
    assert config._experts_implementation == "batched_mm"
    longer = hf.tiny_config(num_hidden_layers=4, index_topk=8)
    assert len(longer.layer_types) == len(longer.mlp_layer_types) == 4
    assert longer.index_topk == 8


@needs_hf
def test_build_is_deterministic():
    state = torch.get_rng_state()
    a = hf.build(seed=0).state_dict()
    assert torch.equal(torch.get_rng_state(), state)  # global RNG untouched
    b = hf.build(seed=0).state_dict()
    c = hf.build(seed=1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert all(t.dtype == torch.float32 for k, t in a.items() if not k.endswith("tid2eid"))
    tid2eid = a["model.layers.0.mlp.gate.tid2eid"]  # hash routing: distinct experts per token
    assert tid2eid.shape == (128, 2)
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all() and tid2eid.max() > 0


@needs_hf
def test_module_regions_match_model_classes():
    model = hf.build()
    assert not model.training
    classes = {type(m).__name__: name for name, m in model.named_modules()}
    for cls in {**hf.MODULE_REGIONS, **hf.ENGINE_MODULE_REGIONS}:
        assert cls in classes
    assert classes["DeepseekV4Indexer"] == "model.layers.1.self_attn.compressor.indexer"


@needs_hf
@pytest.mark.parametrize("seq_len", [1, 5, 8, 13])
def test_prefill(seq_len):
    model, (ids,) = hf.example(seq_len=seq_len)
    assert ids.shape == (1, seq_len) and ids.dtype == torch.int64
    with torch.no_grad():
        out = model(ids)
        again = model(ids)
    assert out.shape == (1, seq_len, 128) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.equal(out, again)


@needs_hf
def test_prefill_batch_matches_single():
    model, (ids,) = hf.example(seq_len=8, batch_size=2)
    with torch.no_grad():
        both = model(ids)
        first = model(ids[:1])
    assert both.shape == (2, 8, 128)
    torch.testing.assert_close(both[:1], first)


@needs_hf
def test_compile_fullgraph_static_matches_eager():
    torch._dynamo.reset()
    model, args = hf.example(seq_len=13)  # 6 compressed CSA entries > index_topk 4
    graphs = []

    def record(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        want = model(*args)
        got = torch.compile(model, backend=record, fullgraph=True, dynamic=False)(*args)
    assert torch.equal(got, want)
    assert len(graphs) == 1
    (gm,) = graphs
    assert not {_target_name(n) for n in gm.graph.nodes} & _FORBIDDEN
    indexer = [
        n
        for n in gm.graph.nodes
        if n.op != "placeholder"
        and any(
            cls.__name__ == "DeepseekV4Indexer"
            for _, cls in n.meta.get("nn_module_stack", {}).values()
        )
    ]
    assert indexer
    paths = {n.meta["nn_module_stack"][k][0] for n in indexer for k in n.meta["nn_module_stack"]}
    assert "L['self'].lm.model.layers.1.self_attn.compressor.indexer" in paths
    assert "topk" in {_target_name(n) for n in indexer}


@needs_hf
def test_compile_eager_backend_dynamic_matches_eager():
    torch._dynamo.reset()
    model, _ = hf.example()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for seq_len in (8, 13):  # 4 and 6 compressed CSA entries: same guards, one graph
            ids = hf.input_ids(seq_len)
            torch.testing.assert_close(compiled(ids), model(ids), rtol=0, atol=0)
    assert counter.frame_count == 1
