"""Built-in region presets (fxsplit.presets): what they hold, how the mark pass applies them,
that user marks take precedence, and the ``presets`` option's validation."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit import presets
from fxsplit.presets import Preset


class FooRotaryEmbedding(nn.Module):
    def forward(self, positions):
        return positions.float().unsqueeze(-1).sin()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary_emb = FooRotaryEmbedding()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, positions):
        q = self.proj(x) + self.rotary_emb(positions)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return self.proj(o).relu()


def _plan(**options):
    x, positions = torch.randn(1, 2, 4, 16), torch.arange(4)
    torch._dynamo.reset()
    backend = fxsplit.Backend(capture="off", **options)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(Block(), backend=backend, dynamic=False)(x, positions)
    (plan,) = backend.plans
    return plan


def _reasons(plan):
    return sorted({r for p in plan.eager for r in p.reasons})


def test_sdpa_preset_holds_every_forward_sdpa_op_torch_registers():
    (sdpa,) = [p for p in presets.defaults() if p.name == "sdpa"]
    registered = {
        n.partition(".")[0]
        for n in torch._C._dispatch_get_all_op_names()
        if "scaled_dot_product" in n and not n.partition(".")[0].endswith("_backward")
    }
    assert set(sdpa.ops) == registered
    assert "aten::scaled_dot_product_attention" in sdpa.ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in sdpa.ops


def test_flex_attention_preset_is_torchs_higher_order_op():
    (flex,) = [p for p in presets.defaults() if p.name == "flex_attention"]
    assert flex.ops == ("higher_order::flex_attention",)
    assert flex.region == fxsplit.ATTENTION


def test_presets_mark_attention_and_rotary_without_user_marking():
    v1 = _plan(runner="v1")
    assert _reasons(v1) == [
        "preset:rotary_embedding",
        "preset:sdpa",
        "region:attention",
        "region:attn_prep",
    ]
    v2 = _plan(runner="v2")
    assert _reasons(v2) == ["preset:sdpa", "region:attention"]
    assert [p.kind for p in v2.pieces] == ["captured", "eager", "captured"]
    assert "attn_prep" in v2.pieces[0].regions  # a region, captured under v2


def test_presets_false_turns_them_off():
    plan = _plan(runner="v1", presets=False)
    assert [p.kind for p in plan.pieces] == ["captured"]
    assert not plan.pieces[0].regions


def test_user_splitting_ops_and_module_regions_take_precedence():
    plan = _plan(
        runner="v1",
        splitting_ops=["aten::scaled_dot_product_attention"],
        module_regions={"FooRotaryEmbedding": "attn_prep"},
    )
    assert _reasons(plan) == [
        "module:FooRotaryEmbedding",
        "op:aten::scaled_dot_product_attention",
        "region:attn_prep",
    ]


def test_region_marked_by_the_user_gets_no_preset_reason():
    class Marked(nn.Module):
        def forward(self, q):
            with fxsplit.region(fxsplit.ATTENTION):
                o = F.scaled_dot_product_attention(q, q, q)
            return o * 2

    backend = fxsplit.Backend(capture="off")
    torch._dynamo.reset()
    torch.compile(Marked(), backend=backend)(torch.randn(1, 2, 4, 8))
    assert _reasons(backend.plans[0]) == ["region:attention"]


@pytest.mark.parametrize(
    "extra",
    [
        {"mine": {"region": "attention", "ops": ["aten::relu"]}},
        Preset("mine", "attention", ops=("aten::relu",)),
        [Preset("mine", "attention", ops=("aten::relu",))],
    ],
)
def test_presets_extend_the_defaults(extra):
    plan = _plan(runner="v2", presets=extra)
    assert "preset:mine" in _reasons(plan)
    assert "preset:sdpa" in _reasons(plan)


def test_a_preset_named_like_a_default_replaces_it():
    config = fxsplit.Config.from_options(
        {"presets": {"sdpa": {"region": "attention", "ops": ["aten::relu"]}}}
    )
    (sdpa,) = [p for p in config.active_presets if p.name == "sdpa"]
    assert sdpa.ops == ("aten::relu",)
    assert len(config.active_presets) == len(presets.defaults())


def test_class_name_globs_match_module_classes():
    plan = _plan(runner="v1", presets=False, module_regions={"*RotaryEmbedding": "attn_prep"})
    assert "module:*RotaryEmbedding" in _reasons(plan)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("yes", TypeError, "presets='yes'"),
        ({"x": {"ops": ["aten::relu"]}}, ValueError, "no 'region'"),
        ({"x": {"region": "attention", "bogus": 1}}, ValueError, "unknown key 'bogus'"),
        ({"x": {"region": "attention", "ops": ["not an op"]}}, ValueError, "'not an op'"),
        ({"x": "attention"}, TypeError, "presets['x']='attention'"),
        ({"x": Preset("y", "attention")}, ValueError, "named 'y'"),
        ({"x": {"region": "", "ops": []}}, ValueError, "region must be a non-empty str"),
        ({"x": {"region": "attention", "modules": "Foo"}}, TypeError, "list of strings"),
    ],
)
def test_bad_presets_raise_naming_the_value(value, error, message):
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        fxsplit.Backend(presets=value)


class OpsAttention(nn.Module):
    """Attention written as ops, as transformers' ``attn_implementation="eager"`` writes it
    (scores scaled and masked, softmax in float32, weights cast back and dropped out), beside
    a mixture-of-experts router (a softmax over a projection's logits, weighting a product)
    and a softmax between projections by weights (``x @ w``): neither of the last is
    attention."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.router = nn.Linear(16, 4)
        self.w1 = nn.Parameter(torch.randn(16, 16))
        self.w2 = nn.Parameter(torch.randn(16, 16))

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) * 0.25 + mask
        weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        h = F.dropout(weights, 0.0, training=False) @ v
        gate = self.router(h).softmax(-1)
        h = h * gate.sum(-1, keepdim=True)
        return ((h @ self.w1).softmax(-1) @ self.w2).relu()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_attention_written_as_ops_is_found_in_prefill(runner):
    """No attention op, no KV cache growing: only its shape says it is attention, and both
    runners run attention eagerly."""
    x, mask = torch.randn(1, 2, 5, 16), torch.zeros(5, 5)
    torch._dynamo.reset()
    backend = fxsplit.Backend(capture="off", runner=runner)
    with torch.no_grad():
        torch.compile(OpsAttention(), backend=backend, dynamic=False)(x, mask)
    (plan,) = backend.plans
    (eager,) = plan.eager
    assert eager.reasons == ("preset:eager_attention", "region:attention")
    # from the scores' product to the weighted values' product; the router's softmax and the
    # one between projections by weights stay captured
    assert eager.nodes == ("matmul", "mul", "scores", "softmax", "weights", "dropout", "h")


def test_attention_written_as_ops_is_left_alone_without_presets():
    x, mask = torch.randn(1, 2, 5, 16), torch.zeros(5, 5)
    torch._dynamo.reset()
    backend = fxsplit.Backend(capture="off", presets=False, eager_regions=[])
    with torch.no_grad():
        torch.compile(OpsAttention(), backend=backend, dynamic=False)(x, mask)
    assert not backend.plans[0].eager
