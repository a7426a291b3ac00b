"""fxsplit inside vLLM 0.32's engine: same greedy tokens as vLLM eager, replays, plans."""

from __future__ import annotations

import functools

import pytest
import torch

import fxsplit

vllm = pytest.importorskip("vllm")

from fxsplit.vllm import eager_op_presets  # noqa: E402
from tests.vllm import engine  # noqa: E402
from tests.vllm.tiny_models import ARCHITECTURES  # noqa: E402


@functools.cache
def _eager(arch: str) -> list[list[int]]:
    return engine.run(arch, None).tokens


def _op_name(target) -> str | None:
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else getattr(target, "_qualified_op_name", None)


def _piece_of_each_node(backend):
    """(node, piece) for every node of the backend's graphs."""
    for split in backend.compiled:
        nodes = {n.name: n for n in split.graph_module.graph.nodes}
        for piece in split.plan.pieces:
            for name in piece.nodes:
                yield nodes[name], piece


def _vllm_eager_ops(runner: str) -> set[str]:
    """vLLM's default eager ops the runner must run eagerly (the KV-cache writes are captured
    by a runner keeping the slot mapping in persistent buffers)."""
    from vllm.config import CompilationConfig

    found = eager_op_presets(CompilationConfig())
    keep = {"engine_attention", "engine_sparse_indexer"}
    if runner == "v1":
        keep.add("engine_kv_cache_update")
    return {op for p in found if p.name in keep for op in p.ops}


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokens_equal_vllm_eager_and_vllms_eager_ops_stay_eager(arch, runner):
    expected = _eager(arch)  # first: an engine's start resets Dynamo, and fxsplit's backends
    if arch == "deepseek_v2" and runner == "v2":
        # vLLM's CPU MLA cache write (captured under v2) reads a mask on the host
        # (``valid_mask.all().item()`` in cpu_mla.py): a counted, warned refusal, as CUDA would
        with pytest.warns(fxsplit.FxsplitRuntimeWarning, match=r"runs uncaptured: CaptureError"):
            run = engine.run(arch, runner)
    else:
        run = engine.run(arch, runner)
    engine.record(f"{arch} {runner}", run)
    assert run.tokens == expected
    must = _vllm_eager_ops(runner)
    seen = [(n, p) for n, p in _piece_of_each_node(run.backend) if _op_name(n.target) in must]
    assert seen, "the graph holds none of vLLM's eager ops"
    captured = [n.name for n, p in seen if p.kind != "eager"]
    assert not captured, f"vLLM's eager ops captured under {runner}: {captured}"
    assert run.counts["replays"] > 0


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_llama_replays_at_least_nine_calls_in_ten(runner):
    expected = _eager("llama")
    run = engine.run("llama", runner)
    engine.record(f"llama {runner} (8 x 32)", run)
    assert run.tokens == expected
    assert run.replay_share >= 0.9, run.counts
    if runner == "v2":
        assert [rt.context.binding for rt in run.backend.runtimes] == ["strict"]
        assert run.counts["input_copies"] == 0 and run.counts["input_copy_bytes"] == 0


def _rotary_pieces(backend) -> set[str]:
    return {
        p.kind
        for n, p in _piece_of_each_node(backend)
        if any("RotaryEmbedding" in str(m) for m in n.meta.get("nn_module_stack", {}).values())
    }


def test_the_v2_plan_captures_the_rotary_and_v1_runs_it_eagerly():
    v2 = engine.run("llama", "v2").backend
    assert _rotary_pieces(v2) == {"captured"}
    assert not any(r.startswith("dynamic:") for p in v2.plans[0].eager for r in p.reasons)
    assert v2.plans[0].runner == "v2"
    v1 = engine.run("llama", "v1").backend
    assert _rotary_pieces(v1) == {"eager"}
    assert any("preset:rotary_embedding" in p.reasons for p in v1.plans[0].eager)


def test_the_built_in_fallback_names_are_vllms_own():
    import vllm.model_executor.layers.attention.attention  # noqa: F401 (registers the ops)
    from vllm.config import CompilationConfig

    from fxsplit import presets

    vllms = CompilationConfig._attention_ops
    assert sorted({*presets.VLLM_ATTENTION_OPS, *presets.VLLM_INDEXER_OPS}) == sorted(vllms)
    for name in presets.VLLM_KV_CACHE_UPDATE_OPS:  # registered by vLLM's attention layers
        namespace, _, op = name.partition("::")
        assert hasattr(getattr(torch.ops, namespace), op), name
