"""fxsplit.vllm's reading of vLLM's config, on stand-ins for vLLM's config objects (vLLM itself
is not needed; tests/vllm/ runs the adapter inside vLLM)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fxsplit import presets
from fxsplit.regions import ATTENTION, ATTN_PREP, SPARSE_INDEXER
from fxsplit.vllm import (
    VllmBackend,
    capture_sizes,
    eager_op_presets,
    region_of,
    runner_for,
    size_inputs,
)


def test_importing_fxsplit_and_its_adapter_never_imports_vllm():
    code = "import sys, fxsplit, fxsplit.vllm; fxsplit.Backend; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _config(v2: bool, architecture: str = "LlamaForCausalLM"):
    return SimpleNamespace(
        use_v2_model_runner=v2, model_config=SimpleNamespace(architecture=architecture)
    )


@pytest.mark.parametrize(
    ("v2", "architecture", "platform", "runner"),
    [
        (False, "LlamaForCausalLM", "cuda", "v1"),
        (True, "LlamaForCausalLM", "cuda", "v2"),
        (True, "DeepseekV4ForCausalLM", "cuda", "v2"),
        (True, "DeepseekV4ForCausalLM", "rocm", "v1"),  # vLLM keeps DeepSeek-V4 on V1 there
        (True, "LlamaForCausalLM", "rocm", "v2"),
    ],
)
def test_the_runner_is_vllms_model_runner(v2, architecture, platform, runner):
    assert runner_for(_config(v2, architecture), platform) == runner


@pytest.mark.parametrize(
    ("op", "region"),
    [
        ("vllm::unified_attention_with_output", ATTENTION),
        ("vllm::mamba_mixer2", ATTENTION),
        ("vllm::unified_kv_cache_update", ATTN_PREP),
        ("vllm::unified_mla_kv_cache_update", ATTN_PREP),
        ("vllm::sparse_attn_indexer", SPARSE_INDEXER),
        ("vllm::rocm_aiter_sparse_attn_indexer", SPARSE_INDEXER),
    ],
)
def test_each_vllm_op_has_its_region(op, region):
    assert region_of(op) == region


class _Compilation:
    """vLLM's CompilationConfig as the adapter reads it."""

    _attention_ops = ("vllm::unified_attention_with_output", "vllm::sparse_attn_indexer")

    def __init__(self, splitting_ops=(), sizes=(), mode="NONE", warmups=0):
        self.splitting_ops = list(splitting_ops)
        self.cudagraph_capture_sizes = list(sizes)
        self.cudagraph_mode = SimpleNamespace(name=mode)
        self.cudagraph_num_of_warmups = warmups


def _ops(found):
    return {p.name: (p.region, p.ops) for p in found}


def test_vllms_default_list_and_its_kv_cache_writes_are_eager_by_region():
    found = _ops(eager_op_presets(_Compilation()))
    region, ops = found["engine_attention"]
    assert region == ATTENTION and ops[0] == "vllm::unified_attention_with_output"
    assert not any(o.startswith("vllm::") for o in ops[1:])  # other engines' names stay
    assert found["engine_kv_cache_update"] == (ATTN_PREP, presets.VLLM_KV_CACHE_UPDATE_OPS)
    assert found["engine_sparse_indexer"] == (SPARSE_INDEXER, ("vllm::sparse_attn_indexer",))


def test_splitting_ops_the_user_set_replace_vllms_default():
    found = _ops(eager_op_presets(_Compilation(["vllm::linear_attention"])))
    assert found["engine_attention"][1][0] == "vllm::linear_attention"
    assert found["engine_kv_cache_update"][1] == ()
    assert found["engine_sparse_indexer"][1] == ()


def test_the_fallback_list_holds_no_name_vllm_dropped():
    ops = next(p for p in presets.defaults() if p.name == "engine_attention").ops
    assert "vllm::unified_attention" not in ops and "vllm::unified_mla_attention" not in ops
    assert set(presets.VLLM_KV_CACHE_UPDATE_OPS).isdisjoint(ops)


@pytest.mark.parametrize(
    ("compilation", "sizes"),
    [
        (_Compilation(sizes=[]), None),  # vLLM on the CPU pads nothing
        (_Compilation(sizes=[4, 1, 2], mode="PIECEWISE"), (1, 2, 4)),
        (_Compilation(sizes=[4, 1, 2], mode="NONE"), None),  # no CUDA graphs: no padding
    ],
)
def test_capture_sizes_are_the_sizes_vllm_pads_to(compilation, sizes):
    assert capture_sizes(compilation) == sizes


def _graph(**ranks):
    """A graph with one tensor placeholder per argument, of the given ranks."""
    graph = torch.fx.Graph()
    for name, rank in ranks.items():
        node = graph.placeholder(name)
        node.meta["example_value"] = torch.zeros((2,) * rank)
        node.meta["grapharg"] = SimpleNamespace(source=SimpleNamespace(name=f"L['{name}']"))
    graph.output(None)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_size_inputs_are_the_arguments_vllm_declares_dynamic_in_their_leading_dim():
    dims = {"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
    assert size_inputs(dims, _graph(input_ids=1, positions=1)) == (
        "input_ids",
        "positions",
        "intermediate_tensors",
        "inputs_embeds",
    )
    # multimodal rotary positions are [3, tokens]: the tokens are not their leading dim
    assert "positions" not in size_inputs(dims, _graph(input_ids=1, positions=2))
    assert size_inputs({"x": {0: None}, "y": [1]}) == ("x",)
    assert size_inputs(None) == ()


@pytest.mark.parametrize(
    ("dims", "ranks", "expected"),
    [
        ({"inputs_embeds": -2}, {"inputs_embeds": 2}, ("inputs_embeds",)),  # [tokens, hidden]
        ({"x": -2}, {"x": 3}, ()),
        ({"x": [-3, 2]}, {"x": 3}, ("x",)),
        ({"x": {-2: "tokens"}}, {"x": 2}, ("x",)),  # vLLM's shape ids as values
        ({"x": -2}, {}, ()),  # no tensor to count from
    ],
)
def test_a_negative_dim_counts_from_the_end_of_the_arguments_rank(dims, ranks, expected):
    assert size_inputs(dims, _graph(**ranks)) == expected


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _declarations(draw):
    """Arguments with a rank in the graph (or none: not a tensor of the graph) and the dims
    declared for each, in each of vLLM's forms (an int, a list, a dict of shape ids)."""
    names = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4, unique=True))
    declared, ranks = {}, {}
    for name in names:
        rank = draw(st.one_of(st.none(), st.integers(1, 4)))
        bound = rank or 4
        dims = draw(st.lists(st.integers(-bound, bound - 1), min_size=1, max_size=3, unique=True))
        form = draw(st.sampled_from(("int", "list", "dict")))
        declared[name] = {"int": dims[0], "list": dims, "dict": dict.fromkeys(dims)}[form]
        if rank is not None:
            ranks[name] = rank
    return declared, ranks


@settings(max_examples=max(settings.default.max_examples // 5, 1))
@given(_declarations())
def test_the_size_inputs_are_the_arguments_whose_declared_dim_is_their_first(case):
    """A declared dim names the tensor's dim as a Python index does (negative from the end):
    the argument is a size input where one names dim 0; without a rank, where one is 0."""
    declared, ranks = case
    expected = []
    for name, dims in declared.items():
        dims = [dims] if isinstance(dims, int) else list(dims)
        rank = ranks.get(name)
        if any(range(rank)[d] == 0 if rank is not None else d == 0 for d in dims):
            expected.append(name)
    assert size_inputs(declared, _graph(**ranks)) == tuple(expected)


# ------------------------------------------------------------------------------------------
# The backend compiles with what it read: the runner and the eager ops of a stub vLLM config
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("fxsplit_test_vllm::attend", mutates_args=())
def _attend(x: torch.Tensor) -> torch.Tensor:
    return x.softmax(-1) * x


@_attend.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fxsplit_test_vllm::kv_cache_update", mutates_args=())
def _kv_cache_update(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@_kv_cache_update.register_fake
def _(x):
    return torch.empty_like(x)


class _StubVllmModel(torch.nn.Module):
    """A model as vLLM compiles it: it holds the ``vllm_config`` it was built with (here a
    stand-in), and calls a KV-cache write and an attention op of its own."""

    def __init__(self, vllm_config):
        super().__init__()
        self.vllm_config = vllm_config
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.ops.fxsplit_test_vllm.kv_cache_update(self.proj(x))
        return self.proj(torch.ops.fxsplit_test_vllm.attend(h)).relu()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_backend_compiles_with_vllms_runner_and_its_splitting_ops(runner):
    """vLLM on the CPU runs V1 and its default op list equals fxsplit's fallback, so only a
    config of another runner and another list shows the backend uses what it read: the runner
    (a KV-cache write is eager under v1 only) and the ops (neither op is in fxsplit's
    fallback list)."""
    splitting_ops = ["fxsplit_test_vllm::attend", "fxsplit_test_vllm::kv_cache_update"]
    config = SimpleNamespace(
        use_v2_model_runner=runner == "v2",
        model_config=SimpleNamespace(architecture="LlamaForCausalLM"),
        compilation_config=_Compilation(splitting_ops),
    )
    torch._dynamo.reset()
    backend = VllmBackend(capture="off")
    with torch.no_grad():
        torch.compile(_StubVllmModel(config), backend=backend, fullgraph=True)(torch.randn(4, 8))
    (plan,) = backend.plans
    assert plan.runner == runner
    reasons = {r for piece in plan.eager for r in piece.reasons}
    expected = {"preset:engine_attention", "region:attention"}
    if runner == "v1":
        expected |= {"preset:engine_kv_cache_update", "region:attn_prep"}
    assert reasons == expected, plan.format()


def test_the_adapter_refuses_to_compile_outside_vllm():
    pytest.importorskip("vllm")  # without vLLM the import error says it first
    with pytest.raises(RuntimeError, match="no vLLM config to read"):
        VllmBackend()(torch.fx.symbolic_trace(lambda x: x + 1), [torch.ones(2)])
