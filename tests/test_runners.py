"""Tests of the runner registry, runner policies and default runner selection."""

from __future__ import annotations

import pytest
import torch

import fxsplit
from fxsplit import platforms, runners
from fxsplit.runners import Runner

pytestmark = pytest.mark.usefixtures("fresh_capture_state")


@pytest.fixture
def registry():
    """Restores the runner registry after the test."""
    saved = dict(runners._REGISTRY)
    yield
    runners._REGISTRY.clear()
    runners._REGISTRY.update(saved)


@pytest.fixture
def fresh_platform():
    """Clears the platform cache before and after the test."""
    platforms.current_platform.cache_clear()
    yield
    platforms.current_platform.cache_clear()


# --------------------------------------------------------------------------- built-ins


def test_v1_fields():
    v1 = runners.get("v1")
    assert v1.name == "v1"
    assert v1.eager_regions == frozenset({"attn_prep", "sparse_indexer", "attention"})
    assert v1.persistent_inputs is False


def test_v2_fields():
    v2 = runners.get("v2")
    assert v2.name == "v2"
    assert v2.eager_regions == frozenset({"sparse_indexer", "attention"})
    assert v2.persistent_inputs is True


def test_region_constants():
    assert (fxsplit.ATTN_PREP, fxsplit.SPARSE_INDEXER, fxsplit.ATTENTION) == (
        "attn_prep",
        "sparse_indexer",
        "attention",
    )


def test_names_sorted():
    assert {"v1", "v2"} <= set(runners.names())
    assert runners.names() == sorted(runners.names())


def test_get_returns_runner_objects_as_is():
    runner = Runner("adhoc", frozenset({"x"}), persistent_inputs=False)
    assert runners.get(runner) is runner


@pytest.mark.parametrize("name", ["v3", "", None, 3])
def test_get_unknown_lists_registered(name):
    with pytest.raises(ValueError, match=r"unknown runner .*registered runners: .*v1, v2"):
        runners.get(name)


# --------------------------------------------------------------------------- Runner validation


def test_runner_normalises_regions_to_frozenset():
    runner = Runner("r", ["a", "b", "a"], persistent_inputs=True)
    assert runner.eager_regions == frozenset({"a", "b"})


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": "", "eager_regions": (), "persistent_inputs": False}, ValueError),
        ({"name": 3, "eager_regions": (), "persistent_inputs": False}, ValueError),
        ({"name": "r", "eager_regions": "attention", "persistent_inputs": False}, TypeError),
        ({"name": "r", "eager_regions": 3, "persistent_inputs": False}, TypeError),
        ({"name": "r", "eager_regions": ["", "a"], "persistent_inputs": False}, ValueError),
        ({"name": "r", "eager_regions": [1], "persistent_inputs": False}, ValueError),
        ({"name": "r", "eager_regions": (), "persistent_inputs": 1}, TypeError),
    ],
)
def test_runner_validation(kwargs, error):
    with pytest.raises(error):
        Runner(**kwargs)


# --------------------------------------------------------------------------- register


def test_register_custom_runner_then_select_by_name(registry):
    mine = runners.register(Runner("mine", frozenset({"my_region"}), persistent_inputs=True))
    assert runners.get("mine") is mine
    assert "mine" in runners.names()

    def f(x):
        with fxsplit.region("attention"):
            a = x.sin()
        with fxsplit.region("my_region"):
            b = a.cos()
        return b + 1

    backend = fxsplit.Backend(runner="mine")
    assert backend.config.binding == "strict"
    x = torch.randn(3)
    assert torch.equal(torch.compile(f, backend=backend, fullgraph=True)(x), f(x))
    (plan,) = backend.plans
    assert plan.runner == "mine"
    assert plan.eager_regions == frozenset({"my_region"})
    assert [p.kind for p in plan.pieces] == ["captured", "eager", "captured"]
    assert plan.eager[0].reasons == ("region:my_region",)


def test_runner_object_as_option(registry):
    runner = Runner("unregistered", frozenset({"my_region"}), persistent_inputs=False)
    backend = fxsplit.Backend(runner=runner)

    def f(x):
        with fxsplit.region("my_region"):
            a = x.sin()
        return a + 1

    x = torch.randn(3)
    assert torch.equal(torch.compile(f, backend=backend, fullgraph=True)(x), f(x))
    assert backend.plans[0].runner == "unregistered"
    assert [p.kind for p in backend.plans[0].pieces] == ["eager", "captured"]


def test_register_duplicate_raises(registry):
    runners.register(Runner("dup", frozenset(), persistent_inputs=False))
    with pytest.raises(ValueError, match="'dup' is already registered"):
        runners.register(Runner("dup", frozenset({"a"}), persistent_inputs=False))
    assert runners.get("dup").eager_regions == frozenset()


def test_register_builtin_name_raises(registry):
    with pytest.raises(ValueError, match="already registered"):
        runners.register(Runner("v1", frozenset(), persistent_inputs=False))
    assert runners.get("v1").eager_regions == frozenset(
        {"attn_prep", "sparse_indexer", "attention"}
    )


def test_register_replace(registry):
    runners.register(Runner("dup", frozenset(), persistent_inputs=False))
    new = Runner("dup", frozenset({"a"}), persistent_inputs=True)
    assert runners.register(new, replace=True) is new
    assert runners.get("dup") is new


def test_register_non_runner_raises(registry):
    with pytest.raises(TypeError, match=r"takes a fxsplit\.runners\.Runner"):
        runners.register("v3")


# --------------------------------------------------------------------------- default_runner


@pytest.mark.parametrize("architecture", sorted(runners.V2_ARCHITECTURES))
@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_default_runner_v2_architectures(architecture, platform):
    assert runners.default_runner(architecture, platform) == "v2"


def test_v2_architectures_listed():
    assert {
        "DeepseekV2ForCausalLM",
        "DeepseekV4ForCausalLM",
        "GraniteMoeForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
        "KimiK3ForConditionalGeneration",
        "LongcatFlashNgramForCausalLM",
        "Qwen2MoeForCausalLM",
    } == runners.V2_ARCHITECTURES


@pytest.mark.parametrize("platform", ["cuda", "rocm", "cpu"])
def test_default_runner_llama_is_v1(platform):
    assert runners.default_runner("LlamaForCausalLM", platform) == "v1"


def test_default_runner_deepseek_v4_on_rocm_is_v1():
    assert runners.default_runner("DeepseekV4ForCausalLM", "rocm") == "v1"
    assert runners.default_runner("DeepseekV2ForCausalLM", "rocm") == "v2"


@pytest.mark.parametrize("platform", ["hip", "CUDA", "", "gpu"])
def test_default_runner_bad_platform_raises(platform):
    with pytest.raises(ValueError, match=r"unknown platform .*cuda, rocm, cpu"):
        runners.default_runner("LlamaForCausalLM", platform)


@pytest.mark.parametrize(("platform", "want"), [("rocm", "v1"), ("cuda", "v2"), ("cpu", "v2")])
def test_default_runner_detects_platform(monkeypatch, platform, want):
    calls = []

    def fake():
        calls.append(1)
        return platform

    monkeypatch.setattr(platforms, "current_platform", fake)
    assert runners.default_runner("DeepseekV4ForCausalLM") == want
    assert calls == [1]


def test_default_runner_explicit_platform_does_not_detect(monkeypatch):
    def boom():
        raise AssertionError("current_platform called")

    monkeypatch.setattr(platforms, "current_platform", boom)
    assert runners.default_runner("DeepseekV4ForCausalLM", "cuda") == "v2"


@pytest.mark.parametrize(
    ("available", "hip", "want_platform", "want_runner"),
    [
        (False, None, "cpu", "v2"),
        (True, None, "cuda", "v2"),
        (True, "6.2", "rocm", "v1"),
    ],
)
def test_current_platform_detection(
    monkeypatch, fresh_platform, available, hip, want_platform, want_runner
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.version, "hip", hip)
    platforms.current_platform.cache_clear()
    assert platforms.current_platform() == want_platform
    assert runners.default_runner("DeepseekV4ForCausalLM") == want_runner
