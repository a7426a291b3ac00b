"""The adapter's runner follows vLLM's model-runner choice (``VllmConfig.use_v2_model_runner``,
which follows ``VLLM_USE_V2_MODEL_RUNNER``). vLLM's V2 model runner needs Triton, which
vLLM's CPU build lacks (a V2 config is refused there), so the engine test runs V1 and the
V2 choice is tested on vLLM's own property."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

# imported by name: ``vllm`` binds ``vllm.config`` as an attribute only once something imports
# it, which, with this module run alone, nothing had
from vllm.config import VllmConfig

from fxsplit.vllm import runner_for
from tests.vllm import engine


def _vllms_choice(monkeypatch, value: str | None):
    """A config whose ``use_v2_model_runner`` is vLLM's property, evaluated under the variable."""
    if value is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    stub = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        watermark_config=None,
        _get_v2_model_runner_unsupported_features=lambda: [],
        model_config=SimpleNamespace(architecture="LlamaForCausalLM"),
    )
    stub.use_v2_model_runner = VllmConfig.use_v2_model_runner.fget(stub)
    return stub


@pytest.mark.parametrize(("value", "runner"), [("1", "v2"), ("0", "v1")])
def test_the_runner_follows_vllm_use_v2_model_runner(monkeypatch, value, runner):
    assert runner_for(_vllms_choice(monkeypatch, value), platform="cuda") == runner


def test_in_vllms_cpu_engine_the_runner_is_v1():
    expected = engine.run("llama", None).tokens
    run = engine.run("llama", "auto")
    assert {p.runner for p in run.backend.plans} == {"v1"}
    assert run.tokens == expected
