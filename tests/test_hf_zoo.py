"""The transformers zoo (fxsplit.tools.zoo, scripts/hf_zoo.py): every causal-LM architecture
transformers ships, tiny, through fxsplit. CI runs a fixed sample of architectures outside the
coverage table (docs/coverage.md), one runner each; ``python3 scripts/hf_zoo.py`` runs them all."""

from __future__ import annotations

import pytest

from fxsplit.models import hf_architectures, hf_zoo
from fxsplit.tools import zoo

if not hf_architectures.available():
    pytest.skip("needs transformers >= 5.8.1", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

# Outside the coverage table: dense, MoE, parallel attention + MLP, learned and partial rotary
# positions, eager attention.
SAMPLE = {
    "GemmaForCausalLM": "v1",
    "StableLmForCausalLM": "v2",
    "Starcoder2ForCausalLM": "v1",
    "Olmo2ForCausalLM": "v2",
    "GPTNeoXForCausalLM": "v1",
    "PhiForCausalLM": "v2",
    "Qwen3MoeForCausalLM": "v1",
    "GPTNeoForCausalLM": "v2",
}


def test_sample_is_outside_the_coverage_table_and_in_the_zoo():
    shipped = set(hf_zoo.architectures())
    assert len(SAMPLE) >= 8
    for name in SAMPLE:
        assert name in shipped and name not in hf_architectures.ARCHITECTURES, name


@pytest.mark.parametrize(("architecture", "runner"), sorted(SAMPLE.items()))
def test_sample_equals_eager_and_replays(architecture, runner):
    row = zoo.run(architecture, runners_run=(runner,))
    assert not row.reason
    assert row.equal, row.runners
    assert row.replaying, row.runners
    config = hf_zoo.tiny_config(architecture).get_text_config()
    assert config.vocab_size == 128 and config.num_hidden_layers == 2


def test_table_and_summary_say_why_an_architecture_did_not_run():
    rows = [
        zoo.Row("A", {"v1": zoo.Runner("equal", "eager", 9, 9)}, attention="sdpa"),
        zoo.Row("B", {"v1": zoo.Runner("wrong", "dynamo", 0, 3, "0.5")}, attention="eager"),
        zoo.Row("C", {}, "cannot build tiny: ValueError: no"),
        zoo.Row("D", {"v1": zoo.Runner("crash", detail="RuntimeError: boom")}),
    ]
    text = zoo.table(rows)
    assert "| `A` | sdpa | equal, 100 % (9/9) | - |" in text
    assert "wrong (Dynamo's graph) (0.5), 0 % (0/3)" in text
    assert "| `C` | - | cannot build tiny: ValueError: no | - |" in text
    assert "crash: RuntimeError: boom" in text
    assert zoo.summary(rows).startswith(
        "4 architectures: 3 build tiny, 3 run eagerly; 1 equal under both runners (1 of them"
    )
    assert zoo.summary(rows).endswith("1 wrong, 1 crash")
    assert [zoo.Row.from_dict(r.as_dict()) for r in rows] == rows


def test_a_model_transformers_cannot_build_is_no_fxsplit_crash():
    """transformers' own errors while building (Gemma3n's cache layer types, Zamba's tied
    weights, a vision tower's missing PIL) say 'cannot build tiny'; only an unknown name, or a
    transformers without the class, raises."""
    from fxsplit.tools import coverage

    def build(name):
        raise ValueError("The set of layer types producing a cache is different")

    result = coverage.attempt("LlamaForCausalLM", "v1", build=build)
    assert result.error.startswith("cannot build tiny: ValueError")

    def build_vision(name):
        raise ImportError("TimmWrapperModel requires the PIL library")  # Gemma3n's vision tower

    result = coverage.attempt("LlamaForCausalLM", "v1", build=build_vision)
    assert (
        result.error == "cannot build tiny: ImportError: TimmWrapperModel requires the PIL library"
    )

    result = coverage.attempt("LlamaForCausalLM", "v1", build=build)
    assert (
        result.error
        == "cannot build tiny: ValueError: The set of layer types producing a cache is different"
    )
    with pytest.raises(hf_architectures.UnknownArchitecture, match="NoSuchForCausalLM"):
        coverage.check("NoSuchForCausalLM", "v1", build=hf_zoo.build)
