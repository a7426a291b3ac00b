"""A small model of identical layers, each with an eager attention region: the layers' pieces
are structurally identical (tests of shared code and compiled pieces)."""

from __future__ import annotations

import torch

import fxsplit


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x).relu() * 0.5
        with fxsplit.region(fxsplit.ATTENTION):
            # each layer's -inf is its own float object: equal constants must still share code
            h = h.masked_fill(h > 3, float("-inf")).softmax(-1)
        return x + h


class Stack(torch.nn.Module):
    """``layers`` Layers, seeded weights; input ``[tokens, 8]`` float32."""

    def __init__(self, layers: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * 2
