"""Small models that more than one test module compiles, each with what it is for.

A model used by one module only stays in that module; one that two modules share lives here, so
that a change to it is one change. The models build their weights on the device torch defaults
to; callers move them (``.to("cuda")``) and turn gradients off as their tests need.
"""

from __future__ import annotations

import torch
from torch import nn

import fxsplit

EAGER_MID = "eager_mid"
"""The region name :class:`RegionMlp` marks by default; tests name it in ``eager_regions``."""


class RegionMlp(nn.Module):
    """``Linear(width, width)``, an eager region ``region`` around :meth:`mid` (``relu(h) + 1``:
    returns a fresh tensor), ``Linear(width, width)``; input ``[rows, width]`` float32.

    Compiled with ``eager_regions=[region]`` it plans three pieces, captured, eager, captured:
    the smallest program in which a captured piece reads an eager piece's output and another
    captured piece's output feeds the eager piece (tests/test_runtime.py, test_runtime_devices.py,
    test_field_cases.py). Weights come from torch's global generator: seed it before building
    to get the same weights twice. Subclasses change :meth:`mid` to change what the eager
    region computes.
    """

    def __init__(self, width: int = 8, region: str = EAGER_MID):
        super().__init__()
        self.region = region
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x):
        h = self.a(x)
        with fxsplit.region(self.region):
            h = self.mid(h)
        return self.b(h)

    def mid(self, h):
        """What the eager region computes."""
        return torch.relu(h) + 1


class KeyFree(nn.Module):
    """``x [rows, width]`` to ``(sin(x.T @ x * 1.5) + 3 * (2 * w) * cos(w), x.T @ x * 1.5)``,
    with the ``sin`` in an eager region ``region`` and a ``[width, width]`` weight ``w`` (seeded,
    no gradient).

    Three pieces: piece_0 (``x.T @ x``) is keyed by the batch size; piece_2 reads only the
    weight and the eager value of static shape ``[width, width]``, so its capture key is empty
    and one graph serves every batch size. Its scratch holds two ``[width, width]`` blocks at
    once (tests/test_pool.py: pool placement; test_runtime_devices.py: a piece captured out of
    capture order).
    """

    def __init__(self, width: int = 16, region: str = fxsplit.ATTENTION):
        super().__init__()
        torch.manual_seed(0)
        self.region = region
        self.w = nn.Parameter(torch.randn(width, width), requires_grad=False)

    def forward(self, x):
        o0 = (x.t() @ x) * 1.5
        with fxsplit.region(self.region):
            e = o0.sin()
        h = ((self.w * 2) * self.w.cos()) * 3  # two scratch blocks live at once
        return e + h, o0
