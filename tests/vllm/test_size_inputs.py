"""The size inputs fxsplit reads from a model's ``dynamic_arg_dims`` are the arguments whose
leading dim vLLM itself marks dynamic, negative dims normalised by vLLM's own code
(``@support_torch_compile`` counts them from the end of each tensor's rank)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

from tests.vllm import backends

TOKENS = 5
DIMS = {
    "input_ids": 0,
    "positions": -1,  # [tokens]: its leading dim
    "inputs_embeds": -2,  # [tokens, hidden]: its leading dim
    "mrope_positions": -1,  # [3, tokens]: the tokens last
    "hidden_states": {-2: None},  # vLLM's dict form, shape ids as values
    "scales": [-3],  # [tokens, 2, 4]
    "blocks": -2,  # [2, tokens, 4]: the tokens second
}


@support_torch_compile(dynamic_arg_dims=DIMS)
class DeclaresDims(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()

    def forward(
        self, input_ids, positions, inputs_embeds, mrope_positions, hidden_states, scales, blocks
    ):
        tokens = input_ids + positions + mrope_positions[0] + inputs_embeds.sum(-1)
        return tokens + hidden_states.sum(-1) + scales.sum((1, 2)) + blocks.sum((0, 2))


def test_the_size_inputs_are_the_arguments_vllm_marks_dynamic_in_their_leading_dim():
    config = VllmConfig(
        compilation_config=CompilationConfig(mode=2, backend="tests.vllm.backends.sizes")
    )
    torch._dynamo.reset()
    backends.sizes.seen.clear()
    n = TOKENS
    with set_current_vllm_config(config):
        DeclaresDims(vllm_config=config)(
            torch.arange(n),
            torch.arange(n),
            torch.randn(n, 8),
            torch.arange(3 * n).view(3, n),
            torch.randn(n, 8),
            torch.randn(n, 2, 4),
            torch.randn(2, n, 4),
        )
    ((read, marked),) = backends.sizes.seen
    assert marked == {"input_ids", "positions", "inputs_embeds", "hidden_states", "scales"}
    assert read == tuple(name for name in DIMS if name in marked)
