"""Attention written as ops (:mod:`fxsplit.passes.attention_pattern`): named programs for each
form, and a property over random formulations of attention and of softmaxes that are not.

Each program marks what it writes as attention with ``torch.fx.traceback.annotate`` (key
:data:`REGION`): from the scores' contraction to the values' contraction, the operands'
reshaping before a contraction left out. The pattern must find exactly the marked nodes in
Dynamo's graph.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.traceback import annotate

import fxsplit
from fxsplit.passes import attention_pattern

REGION = "fxsplit_test.attention"


def _mark(on: bool = True):
    """The block the program writes as attention (nothing where ``on`` is false)."""
    return annotate({REGION: True}) if on else contextlib.nullcontext()


def _found_and_marked(model: nn.Module, *inputs, dynamic: bool = False):
    """(what the pattern finds, what the program marked), as node names of Dynamo's graph.
    Placeholders (created where first used, so inside a marked block they carry its mark) and
    the sizes Dynamo reads on the way (SymInts) are not region members."""
    seen: list[tuple[set[str], set[str]]] = []

    def backend(gm, example_inputs):
        found = {n.name for n in attention_pattern.find(gm.graph)}
        marked = {
            n.name
            for n in gm.graph.nodes
            if n.op != "placeholder"
            and n.meta.get("custom", {}).get(REGION)
            and isinstance(n.meta.get("example_value"), (torch.Tensor, tuple))
        }
        seen.append((found, marked))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)(*inputs)
    (result,) = seen
    return result


# ------------------------------------------------------------------------------------------
# Named programs
# ------------------------------------------------------------------------------------------


class MulAndSumScores(nn.Module):
    """Scores as a broadcast product summed over the head dim (no matmul), as code written for
    clarity or for an accelerator without batched matmuls does."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = q.unsqueeze(-2), k.unsqueeze(-3)
        with _mark():
            scores = (q * k).sum(-1) * 0.25
            return scores.softmax(-1) @ v


class HandWrittenSoftmax(nn.Module):
    """The softmax written out: ``exp / sum``, with the max subtracted first or not."""

    def __init__(self, subtract_max: bool):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.subtract_max = subtract_max

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        kt = k.transpose(-1, -2)
        with _mark():
            scores = q @ kt
            if self.subtract_max:
                scores = scores - scores.amax(-1, keepdim=True)
            e = scores.exp()
            return e / e.sum(-1, keepdim=True) @ v


class LogSoftmaxThenExp(nn.Module):
    """The weights as ``log_softmax(scores).exp()``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        kt = k.transpose(-1, -2)
        with _mark():
            return (q @ kt).log_softmax(-1).exp() @ v


class BiasByBatchedProduct(nn.Module):
    """Scores as a bias plus a batched product, the factors passed by keyword, as Bloom adds
    ALiBi (``alibi.baddbmm(batch1=q, batch2=k, beta=..., alpha=...)``), and values by ``bmm``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        kt = k.transpose(1, 2)
        bias = torch.zeros(1, 1, x.shape[1])
        with _mark():
            scores = bias.baddbmm(batch1=q, batch2=kt, beta=1.0, alpha=0.25)
            return torch.bmm(F.softmax(scores, dim=-1, dtype=torch.float32), v)


class BufferCodebook(nn.Module):
    """A soft vector quantiser: each token's softmax over its distances to a codebook (a
    buffer), then the codebook's entries weighted by it. One operand is the model's state."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.codebook = nn.Buffer(torch.randn(8, 16))

    def forward(self, x):
        z = self.proj(x)
        return (z @ self.codebook.t()).softmax(-1) @ self.codebook


class DequantisedInt8(nn.Module):
    """A softmax between two products by dequantised int8 weights (int8 values and a scale per
    row, buffers, as weight-only quantisation keeps them): projections, not attention."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Buffer(torch.randint(-127, 127, (8, 16), dtype=torch.int8))
        self.s1 = nn.Buffer(torch.rand(8) / 64)
        self.w2 = nn.Buffer(torch.randint(-127, 127, (8, 16), dtype=torch.int8))
        self.s2 = nn.Buffer(torch.rand(8) / 64)

    def forward(self, x):
        w1 = self.w1.float() * self.s1[:, None]
        w2 = self.w2.float() * self.s2[:, None]
        return (x @ w1.t()).softmax(-1) @ w2


class MaskFromTheScoresSizes(nn.Module):
    """A causal mask made to the scores' sizes. In a dynamic graph whose token count a
    parameter fixes later on (the per-position gain), Dynamo reads those sizes off the scores
    as symbols: the mask's making is still no part of attention, as in a static graph."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.gain = nn.Parameter(torch.ones(5, 16))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        kt = k.transpose(-1, -2)
        with _mark():
            scores = q @ kt
        t, s = scores.shape[-2], scores.shape[-1]
        blocked = torch.ones(t, s, dtype=torch.bool).triu(1)
        with _mark():
            out = scores.masked_fill(blocked, -1e4).softmax(-1) @ v
        return out * self.gain


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_mask_made_to_the_scores_sizes_stays_out_of_the_region(dynamic):
    x = torch.randn(2, 5, 16)
    found, marked = _found_and_marked(MaskFromTheScoresSizes(), x, dynamic=dynamic)
    assert marked and found == marked


@pytest.mark.parametrize(
    "model",
    [
        MulAndSumScores(),
        HandWrittenSoftmax(subtract_max=False),
        HandWrittenSoftmax(subtract_max=True),
        LogSoftmaxThenExp(),
        BiasByBatchedProduct(),
    ],
    ids=[
        "mul_and_sum",
        "exp_over_sum",
        "max_subtracted_exp_over_sum",
        "log_softmax_exp",
        "baddbmm_by_keyword",
    ],
)
def test_attention_in_each_form_is_found_from_scores_to_values(model):
    found, marked = _found_and_marked(model, torch.randn(2, 5, 16))
    assert marked and found == marked


class ParameterValues(nn.Module):
    """Activation scores weighting a parameter (values per position), expanded to the weights'
    batch for a batched product: the values are the model's state. In a dynamic graph the
    expansion's sizes are read off the weights (the table's length fixes the token count only
    later), and sizes carry no values."""

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(16, 32)
        self.table = nn.Parameter(torch.randn(5, 16))

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        p = (q @ k.transpose(-1, -2)).softmax(-1)
        b, _, s = p.shape
        return torch.bmm(p, self.table.expand(b, s, 16))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize(
    "model", [BufferCodebook(), DequantisedInt8(), ParameterValues()], ids=type
)
def test_a_softmax_over_the_models_state_is_not_attention(model, dynamic):
    found, _ = _found_and_marked(model, torch.randn(2, 5, 16), dynamic=dynamic)
    assert not found


class CodebookThenDequantised(nn.Module):
    def __init__(self):
        super().__init__()
        self.codebook, self.dequantised = BufferCodebook(), DequantisedInt8()

    def forward(self, x):
        return self.dequantised(self.codebook(x)).relu()


def test_a_softmax_over_a_codebook_or_dequantised_weights_runs_captured():
    torch._dynamo.reset()
    backend = fxsplit.Backend(capture="off")
    with torch.no_grad():
        torch.compile(CodebookThenDequantised(), backend=backend, dynamic=False)(
            torch.randn(1, 5, 16)
        )
    assert not backend.plans[0].eager, backend.plans[0].format()


_CALLS = {
    "aten::matmul": lambda a, b, c: torch.matmul(a, b),
    "aten::mm": lambda a, b, c: torch.mm(a[0], b[0]),
    "aten::bmm": lambda a, b, c: torch.bmm(a, b),
    "aten::baddbmm": lambda a, b, c: torch.baddbmm(c, a, b),
    "aten::linear": lambda a, b, c: F.linear(a, b.transpose(1, 2)[0]),
    "aten::einsum": lambda a, b, c: torch.einsum("btd,bds->bts", a, b),
}


@pytest.mark.parametrize("name", sorted(attention_pattern._CONTRACTIONS))
def test_each_contraction_op_runs_a_kernel_torchs_flop_counter_counts(name):
    from torch.utils.flop_counter import FlopCounterMode

    a, b, c = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(2, 3, 5)
    with FlopCounterMode(display=False) as counter:
        _CALLS[name](a, b, c)
    assert counter.get_total_flops() > 0


# ------------------------------------------------------------------------------------------
# Property: random formulations
# ------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

HIDDEN, HEADS, CODES, EXPERTS, LATENTS = 16, 2, 6, 4, 3

SCORES = ("matmul", "einsum", "mul_sum", "bmm", "baddbmm")
# where the 1/sqrt(d) goes: on the query or the key (before the contraction), on the scores
# (multiplied or divided), or inside a product summed (``(q * k * scale).sum(-1)``)
SCALES = ("none", "query", "key", "scores", "divide", "product")
MASKS = ("none", "add", "fill")
SOFTMAXES = (
    "softmax",
    "F.softmax",
    "float32",
    "exp_sum",
    "max_exp_sum",
    "max_values_exp_sum",
    "log_softmax_exp",
    "F.log_softmax_exp",
    "logsumexp",
)
AFTER = ("none", "dropout", "cast")
VALUES = ("matmul", "einsum", "mul_sum", "bmm")
# What each block is. Attention: self-attention, cross-attention to a second input, and
# self-attention over a KV cache kept in buffers written in the step. Not attention: a
# codebook (buffer or parameter) as keys and values, dequantised int8 weights as keys and
# values, learned queries (the latents, or a projection of them) over the tokens, a softmax
# gating experts' outputs (by a router's projection, a product by a weight, or a slice of
# the activation), activation scores weighting a parameter, and a softmax whose weights
# contract with nothing.
ATTENTION = ("self", "cross", "cached")
NOT_ATTENTION = ("codebook", "dequantised", "learned_queries", "gating", "state_values", "unused")
VARIANTS = {
    "cached": ("index_copy", "setitem"),
    "codebook": ("buffer", "parameter"),
    "dequantised": ("buffer", "parameter"),
    "learned_queries": ("latents", "projected"),
    "gating": ("linear", "weight", "slice"),
}


@dataclass(frozen=True)
class Forms:
    scores: str
    scale: str
    mask: str
    softmax: str
    after: str
    values: str
    keywords: bool = False  # tensors passed by keyword where the call takes them so


@dataclass(frozen=True)
class Block:
    kind: str
    forms: Forms
    heads: bool
    variant: str = ""


def _scores(q, k, forms: Forms, mark: bool):
    """``[*, T, d] x [*, S, d] -> [*, T, S]``, marked from the contraction on."""
    t, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    scale = d**-0.5
    if forms.scale == "query":
        q = q * scale
    elif forms.scale == "key":
        k = k * scale
    kw = forms.keywords
    if forms.scores == "matmul":
        kt = k.transpose(-1, -2)
        with _mark(mark):
            scores = torch.matmul(input=q, other=kt) if kw else q @ kt
    elif forms.scores == "einsum":
        with _mark(mark):
            scores = torch.einsum("...td,...sd->...ts", q, k)
    elif forms.scores == "mul_sum":
        qa, ka = q.unsqueeze(-2), k.unsqueeze(-3)
        with _mark(mark):
            product = torch.mul(input=qa, other=ka) if kw else qa * ka
            if forms.scale == "product":
                product = product * scale
            scores = torch.sum(input=product, dim=-1) if kw else product.sum(-1)
    else:
        q3 = q.expand(*batch, t, d).reshape(-1, t, d)
        k3 = k.expand(*batch, s, d).reshape(-1, s, d).transpose(1, 2)
        if forms.scores == "bmm":
            with _mark(mark):
                scores = torch.bmm(input=q3, mat2=k3) if kw else torch.bmm(q3, k3)
        else:  # an added bias (Bloom adds ALiBi so), by keyword as Bloom calls it
            bias = torch.zeros(1, t, s)
            with _mark(mark):
                if kw:
                    scores = bias.baddbmm(batch1=q3, batch2=k3, beta=1.0, alpha=1.0)
                else:
                    scores = torch.baddbmm(bias, q3, k3)
        with _mark(mark):
            scores = scores.view(*batch, t, s)
    with _mark(mark):
        if forms.scale == "scores" or (forms.scale == "product" and forms.scores != "mul_sum"):
            scores = scores * scale
        elif forms.scale == "divide":
            scores = scores / d**0.5
    return scores


def _weights(scores, forms: Forms, mark: bool):
    """The softmax over the last dim, masked first and cast or dropped out after as drawn."""
    t, s = scores.shape[-2], scores.shape[-1]
    blocked = torch.ones(t, s, dtype=torch.bool).triu(1)
    bias = torch.zeros(t, s).masked_fill(blocked, -1e4)
    with _mark(mark):
        if forms.mask == "add":
            scores = scores + bias
        elif forms.mask == "fill":
            scores = scores.masked_fill(blocked, -1e4)
        form = forms.softmax
        if form == "softmax":
            p = scores.softmax(-1)
        elif form == "F.softmax":
            p = F.softmax(scores, dim=-1)
        elif form == "float32":
            p = torch.softmax(scores.float(), -1).type_as(scores)
        elif form == "exp_sum" and forms.keywords:
            e = torch.exp(input=scores)
            p = torch.div(input=e, other=torch.sum(input=e, dim=-1, keepdim=True))
        elif form == "exp_sum":
            e = scores.exp()
            p = e / e.sum(-1, keepdim=True)
        elif form == "max_exp_sum":
            e = torch.exp(scores - scores.amax(-1, keepdim=True))
            p = e / e.sum(-1, keepdim=True)
        elif form == "max_values_exp_sum":
            e = (scores - scores.max(-1, keepdim=True).values).exp()
            p = torch.div(e, e.sum(-1, keepdim=True))
        elif form == "log_softmax_exp":
            p = scores.log_softmax(-1).exp()
        elif form == "F.log_softmax_exp":
            p = torch.exp(F.log_softmax(scores, -1))
        elif forms.keywords:
            total = torch.logsumexp(input=scores, dim=-1, keepdim=True)
            p = torch.exp(torch.sub(input=scores, other=total))
        else:
            p = (scores - scores.logsumexp(-1, keepdim=True)).exp()
        if forms.after == "dropout":
            p = F.dropout(p, 0.0, training=False)
        elif forms.after == "cast":
            p = p.to(torch.float32)
    return p


def _contract(p, v, forms: Forms, mark: bool):
    """``[*, T, S] x [*, S, e] -> [*, T, e]``, marked up to the contraction."""
    t, s, e = p.shape[-2], p.shape[-1], v.shape[-1]
    batch = torch.broadcast_shapes(p.shape[:-2], v.shape[:-2])
    kw = forms.keywords
    if forms.values == "matmul":
        with _mark(mark):
            return torch.matmul(input=p, other=v) if kw else p @ v
    if forms.values == "einsum":
        with _mark(mark):
            return torch.einsum("...ts,...se->...te", p, v)
    if forms.values == "mul_sum":
        va = v.unsqueeze(-3)
        with _mark(mark):
            if kw:
                return torch.sum(input=torch.mul(input=p.unsqueeze(-1), other=va), dim=-2)
            return (p.unsqueeze(-1) * va).sum(-2)
    v3 = v.expand(*batch, s, e).reshape(-1, s, e)
    with _mark(mark):
        p3 = p.expand(*batch, t, s).reshape(-1, t, s)
        out = torch.bmm(input=p3, mat2=v3) if kw else torch.bmm(p3, v3)
    return out.view(*batch, t, e)


class Program(nn.Module):
    """A chain of blocks over ``x`` ([B, T, HIDDEN]), each added to the hidden state through a
    projection of its own; ``memory`` ([B, S, HIDDEN]) is what cross-attention attends to."""

    def __init__(self, blocks: tuple[Block, ...], batch: int, tokens: int):
        super().__init__()
        self.specs = blocks
        self.layers = nn.ModuleList(self._layer(b, batch, tokens) for b in blocks)

    @staticmethod
    def _layer(block: Block, batch: int, tokens: int) -> nn.Module:
        layer = nn.Module()
        layer.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        layer.out = nn.Linear(HIDDEN, HIDDEN)
        kind, variant = block.kind, block.variant
        if kind == "cached":
            layer.k_cache = nn.Buffer(torch.zeros(batch, tokens, HIDDEN))
            layer.v_cache = nn.Buffer(torch.zeros(batch, tokens, HIDDEN))
        elif kind == "codebook":
            codebook = torch.randn(CODES, HIDDEN)
            held = nn.Parameter(codebook) if variant == "parameter" else nn.Buffer(codebook)
            layer.codebook = held
        elif kind == "dequantised":
            for name in ("k", "v"):
                values = torch.randint(-127, 127, (CODES, HIDDEN), dtype=torch.int8)
                held = (
                    nn.Parameter(values, requires_grad=False)
                    if variant == "parameter"
                    else nn.Buffer(values)
                )
                setattr(layer, f"{name}_int8", held)
                setattr(layer, f"{name}_scale", nn.Buffer(torch.rand(CODES) / 64))
        elif kind == "learned_queries":
            layer.latents = nn.Parameter(torch.randn(LATENTS, HIDDEN))
        elif kind == "gating":
            layer.router = nn.Linear(HIDDEN, EXPERTS)
            layer.router_weight = nn.Parameter(torch.randn(HIDDEN, EXPERTS))
            layer.experts = nn.Linear(HIDDEN, EXPERTS * HIDDEN)
        elif kind == "state_values":
            layer.table = nn.Parameter(torch.randn(tokens, HIDDEN))
        return layer

    def forward(self, x, memory, positions):
        h = x
        for block, layer in zip(self.specs, self.layers, strict=True):
            h = h + layer.out(self._block(block, layer, h, memory, positions))
        return h

    def _block(self, block: Block, layer: nn.Module, h, memory, positions):
        kind, forms, variant = block.kind, block.forms, block.variant
        b, t, _ = h.shape
        marked = kind in ATTENTION
        if kind == "gating":
            if variant == "linear":
                logits = layer.router(h)
            elif variant == "weight":
                logits = h @ layer.router_weight
            else:
                logits = h[..., :EXPERTS]
            experts = layer.experts(h).view(b, t, EXPERTS, HIDDEN)
            p = _weights(logits.unsqueeze(-2), forms, False)
            return _contract(p, experts, forms, False).squeeze(-2)
        q, k, v = layer.qkv(h).chunk(3, -1)
        if kind == "cross":
            _, k, v = layer.qkv(memory).chunk(3, -1)
        elif kind == "cached":
            if variant == "index_copy":
                layer.k_cache.index_copy_(1, positions, k)
                layer.v_cache.index_copy_(1, positions, v)
            else:
                layer.k_cache[:, positions] = k
                layer.v_cache[:, positions] = v
            k, v = layer.k_cache, layer.v_cache
        elif kind in ("codebook", "dequantised"):
            if kind == "codebook":
                k = v = layer.codebook
            else:
                k = layer.k_int8.float() * layer.k_scale[:, None]
                v = layer.v_int8.to(torch.float32) * layer.v_scale[:, None]
            return _contract(_weights(_scores(q, k, forms, False), forms, False), v, forms, False)
        elif kind == "learned_queries":
            q = layer.latents if variant == "latents" else layer.qkv(layer.latents)[:, :HIDDEN]
        elif kind == "state_values":
            v = layer.table
        heads = block.heads and kind != "state_values"
        if heads:
            q, k, v = (y.unflatten(-1, (HEADS, -1)).transpose(-2, -3) for y in (q, k, v))
        p = _weights(_scores(q, k, forms, marked), forms, marked)
        if kind == "unused":
            return h * p.amax(-1).mean(1 if heads else -1, keepdim=True).view(b, -1, 1)[:, :t]
        out = _contract(p, v, forms, marked)
        if heads:
            out = out.transpose(-2, -3).flatten(-2)
        if kind == "learned_queries":
            return out.mean(-2, keepdim=True)
        return out


@st.composite
def _forms(draw):
    return Forms(
        scores=draw(st.sampled_from(SCORES)),
        scale=draw(st.sampled_from(SCALES)),
        mask=draw(st.sampled_from(MASKS)),
        softmax=draw(st.sampled_from(SOFTMAXES)),
        after=draw(st.sampled_from(AFTER)),
        values=draw(st.sampled_from(VALUES)),
        keywords=draw(st.booleans()),
    )


@st.composite
def _blocks(draw):
    kind = draw(st.sampled_from(ATTENTION + NOT_ATTENTION))
    variant = draw(st.sampled_from(VARIANTS.get(kind, ("",))))
    return Block(kind, draw(_forms()), draw(st.booleans()), variant)


@settings(max_examples=max(settings.default.max_examples // 5, 1))
@given(
    blocks=st.lists(_blocks(), min_size=1, max_size=2).map(tuple),
    batch=st.sampled_from((1, 2)),
    tokens=st.sampled_from((3, 5)),
    memory=st.sampled_from((4, 7)),
    dynamic=st.booleans(),
)
def test_the_pattern_finds_exactly_the_attention_the_program_wrote(
    blocks, batch, tokens, memory, dynamic
):
    """Every block the program writes as attention is found, from its scores' contraction to
    its values' contraction, and nothing else: no softmax over the model's state, gating,
    learned queries or unused weights."""
    model = Program(blocks, batch, tokens)
    x, mem = torch.randn(batch, tokens, HIDDEN), torch.randn(batch, memory, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found, marked = _found_and_marked(model, x, mem, torch.arange(tokens), dynamic=dynamic)
    assert found == marked, (
        f"found but not marked: {sorted(found - marked)}; marked but not found: "
        f"{sorted(marked - found)}"
    )
    assert bool(marked) == any(b.kind in ATTENTION for b in blocks)
