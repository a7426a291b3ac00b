"""Golden plans and stitched code (expecttest). Regenerate: EXPECTTEST_ACCEPT=1 pytest <this file>."""

from __future__ import annotations

import pytest
import torch

import fxsplit
from fxsplit.models import deepseek_v4, llama
from tests.golden import compile_and_run, stitched_code

TestCase = pytest.importorskip("expecttest").TestCase


def _deepseek(runner: str):
    model, inputs = deepseek_v4.example(batch_size=4)
    reference = deepseek_v4.clone_model(model)
    backend, out = compile_and_run(model, inputs, runner=runner)
    torch.testing.assert_close(out, reference(*inputs), rtol=0, atol=0)
    return backend


class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.proj(x).relu()
        with fxsplit.region("outer"):
            x = x * 2
            with fxsplit.region(fxsplit.ATTENTION):
                x = x.softmax(-1)
            x = x + 1
        return self.proj(x).sigmoid()


class GoldenPlans(TestCase):
    def test_deepseek_v4_v1_one_eager_piece_per_layer(self):
        backend = _deepseek("v1")
        self.assertExpectedInline(
            backend.plans[0].format(),
            """\
graph_0 runner=v1 eager_regions=attention,attn_prep,sparse_indexer: 5 pieces, 3 captured, 2 eager
piece    kind      ops  regions                             reasons
piece_0  captured   16  -                                   -
piece_1  eager      78  attention,attn_prep,sparse_indexer  region:attention,region:attn_prep,region:sparse_indexer
piece_2  captured   24  -                                   -
piece_3  eager      78  attention,attn_prep,sparse_indexer  region:attention,region:attn_prep,region:sparse_indexer
piece_4  captured   11  -                                   -""",
        )

    def test_deepseek_v4_v2_captures_prep(self):
        backend = _deepseek("v2")
        self.assertExpectedInline(
            backend.plans[0].format(),
            """\
graph_0 runner=v2 eager_regions=attention,sparse_indexer: 5 pieces, 3 captured, 2 eager
piece    kind      ops  regions                   reasons
piece_0  captured   73  attn_prep                 -
piece_1  eager      21  attention,sparse_indexer  region:attention,region:sparse_indexer
piece_2  captured   81  attn_prep                 -
piece_3  eager      21  attention,sparse_indexer  region:attention,region:sparse_indexer
piece_4  captured   11  -                         -""",
        )

    def test_deepseek_v4_v1_stitched_code(self):
        backend = _deepseek("v1")
        self.assertExpectedInline(
            stitched_code(backend),
            """\
def forward(self, IN0, IN1, IN2, IN3, IN4, IN5, IN6, IN7, IN8, IN9, IN10, IN11, IN12, IN13, IN14, IN15, IN16, IN17, IN18, IN19, IN20, IN21, IN22, IN23, IN24, IN25, IN26, IN27, IN28, IN29, IN30, IN31, IN32, IN33, IN34, IN35, IN36, IN37, IN38, IN39, IN40, IN41, IN42, IN43, IN44, IN45, IN46, IN47, IN48, IN49, IN50, IN51, IN52, IN53, IN54, IN55, IN56, IN57, IN58, IN59, IN60, IN61, IN62, IN63, IN64, IN65, IN66, IN67):
    in0 = IN0
    in2 = IN2
    in3 = IN3
    in4 = IN4
    in5 = IN5
    in6 = IN6
    in7 = IN7
    in8 = IN8
    in9 = IN9
    in10 = IN10
    in11 = IN11
    in12 = IN12
    in13 = IN13
    in14 = IN14
    in15 = IN15
    in16 = IN16
    in17 = IN17
    in18 = IN18
    in19 = IN19
    in20 = IN20
    in21 = IN21
    in22 = IN22
    in23 = IN23
    in24 = IN24
    in25 = IN25
    in27 = IN27
    in28 = IN28
    in29 = IN29
    in30 = IN30
    in31 = IN31
    in32 = IN32
    in33 = IN33
    in34 = IN34
    in35 = IN35
    in36 = IN36
    in37 = IN37
    in38 = IN38
    in39 = IN39
    in40 = IN40
    in41 = IN41
    in42 = IN42
    in43 = IN43
    in44 = IN44
    in45 = IN45
    in46 = IN46
    in47 = IN47
    in48 = IN48
    in49 = IN49
    in50 = IN50
    in51 = IN51
    in52 = IN52
    in53 = IN53
    in54 = IN54
    in55 = IN55
    in56 = IN56
    in57 = IN57
    in58 = IN58
    in59 = IN59
    in60 = IN60
    in61 = IN61
    in62 = IN62
    in63 = IN63
    in64 = IN64
    in65 = IN65
    in66 = IN66
    in67 = IN67
    item = in3.item();  in3 = None
    item_1 = in5.item();  in5 = None
    item_2 = in8.item();  in8 = None
    item_3 = in12.item();  in12 = None
    item_4 = in17.item();  in17 = None
    item_5 = in19.item();  in19 = None
    item_6 = in30.item();  in30 = None
    item_7 = in33.item();  in33 = None
    item_8 = in38.item();  in38 = None
    item_9 = in41.item();  in41 = None
    item_10 = in45.item();  in45 = None
    item_11 = in50.item();  in50 = None
    item_12 = in52.item();  in52 = None
    item_13 = in58.item();  in58 = None
    item_14 = in61.item();  in61 = None
    item_15 = in66.item();  in66 = None
    piece_0 = self.piece_0(in2, in0, item, in4, item_1, in6, in7, item_2, in9, in10, in11, item_3, in13, in14, in15, in16, item_4, in18, item_5);  in2 = in0 = item = in4 = item_1 = in6 = in7 = item_2 = in9 = in10 = in11 = item_3 = in13 = in14 = in15 = in16 = item_4 = in18 = item_5 = None
    h = piece_0[0]
    q_nope = piece_0[1]
    q_pe = piece_0[2]
    k_pe = piece_0[3]
    latent_1 = piece_0[4]
    iq = piece_0[5]
    ik = piece_0[6]
    iw = piece_0[7];  piece_0 = None
    piece_1 = self.piece_1(in21, in20, IN1, q_pe, k_pe, iq, ik, in22, in23, latent_1, in24, in25, in27, in28, iw, in29, q_nope, item_6);  in20 = q_pe = k_pe = iq = ik = in22 = latent_1 = in24 = in25 = iw = in29 = q_nope = item_6 = None
    piece_2 = self.piece_2(piece_1, in31, h, in32, item_7, in34, in35, in36, in37, item_8, in39, in40, item_9, in42, in43, in44, item_10, in46, in47, in48, in49, item_11, in51, item_12);  piece_1 = in31 = h = in32 = item_7 = in34 = in35 = in36 = in37 = item_8 = in39 = in40 = item_9 = in42 = in43 = in44 = item_10 = in46 = in47 = in48 = in49 = item_11 = in51 = item_12 = None
    h_2 = piece_2[0]
    q_nope_1 = piece_2[1]
    q_pe_2 = piece_2[2]
    k_pe_2 = piece_2[3]
    latent_3 = piece_2[4]
    iq_2 = piece_2[5]
    ik_2 = piece_2[6]
    iw_1 = piece_2[7];  piece_2 = None
    piece_3 = self.piece_3(in21, in53, IN1, q_pe_2, k_pe_2, iq_2, ik_2, in54, in23, latent_3, in55, in56, in27, in28, iw_1, in57, q_nope_1, item_13);  in21 = in53 = IN1 = q_pe_2 = k_pe_2 = iq_2 = ik_2 = in54 = in23 = latent_3 = in55 = in56 = in27 = in28 = iw_1 = in57 = q_nope_1 = item_13 = None
    piece_4 = self.piece_4(piece_3, in59, h_2, in60, item_14, in62, in63, in64, in65, item_15, in67);  piece_3 = in59 = h_2 = in60 = item_14 = in62 = in63 = in64 = in65 = item_15 = in67 = None
    return (piece_4,)""",
        )

    def test_nested_regions_fold_into_one_eager_piece(self):
        backend, _ = compile_and_run(Nested(), (torch.randn(3, 8),), runner="v1")
        self.assertExpectedInline(
            backend.plans[0].format(),
            """\
graph_0 runner=v1 eager_regions=attention,attn_prep,sparse_indexer: 3 pieces, 2 captured, 1 eager
piece    kind      ops  regions          reasons
piece_0  captured    3  outer            -
piece_1  eager       1  attention,outer  region:attention
piece_2  captured    3  outer            -""",
        )
        self.assertExpectedInline(
            stitched_code(backend),
            """\
def forward(self, IN0, IN1, IN2, IN3):
    in0 = IN0
    in1 = IN1
    in3 = IN3
    piece_0 = self.piece_0(in3, in0, in1);  in3 = None
    piece_1 = self.piece_1(piece_0);  piece_0 = None
    piece_2 = self.piece_2(piece_1, in0, in1);  piece_1 = in0 = in1 = None
    return (piece_2,)""",
        )

    def test_nested_regions_outer_eager(self):
        backend, _ = compile_and_run(
            Nested(), (torch.randn(3, 8),), eager_regions=["outer"], dynamic=False
        )
        self.assertExpectedInline(
            backend.plans[0].format(),
            """\
graph_0 runner=v1 eager_regions=outer: 3 pieces, 2 captured, 1 eager
piece    kind      ops  regions          reasons
piece_0  captured    2  -                -
piece_1  eager       3  attention,outer  region:outer
piece_2  captured    2  -                -""",
        )

    def test_splitting_ops_llama(self):
        model, inputs = llama.example()
        backend, out = compile_and_run(model, inputs, splitting_ops=list(llama.SPLITTING_OPS))
        torch.testing.assert_close(out, model(*inputs), rtol=0, atol=0)
        self.assertExpectedInline(
            backend.plans[0].format(),
            """\
graph_0 runner=v1 eager_regions=attention,attn_prep,sparse_indexer: 5 pieces, 3 captured, 2 eager
piece    kind      ops  regions  reasons
piece_0  captured   30  -        -
piece_1  eager       1  -        op:fxsplit::llama_attention
piece_2  captured   35  -        -
piece_3  eager       1  -        op:fxsplit::llama_attention
piece_4  captured   12  -        -""",
        )

    def test_module_regions(self):
        model, inputs = llama.example()
        backend, _ = compile_and_run(
            model,
            inputs,
            module_regions={"layers.*.k_proj": "attention", "RMSNorm": "norms"},
            eager_regions=["attention"],
        )
        self.assertExpectedInline(
            backend.plans[0].format(),
            """\
graph_0 runner=v1 eager_regions=attention: 5 pieces, 3 captured, 2 eager
piece    kind      ops  regions    reasons
piece_0  captured   16  norms      -
piece_1  eager       1  attention  module:layers.*.k_proj,region:attention
piece_2  captured   35  norms      -
piece_3  eager       1  attention  module:layers.*.k_proj,region:attention
piece_4  captured   26  norms      -""",
        )
