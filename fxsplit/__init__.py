"""fxsplit: a torch.compile backend that splits Dynamo graphs for piecewise CUDA/HIP graph capture.

``torch.compile(model, backend="fxsplit")`` marks the regions a runner needs eager (attention input
preparation, the sparse top-k indexer, attention, capture-unsafe ops), splits the graph there, and
runs the remaining pieces captured.

The names below are imported on first use (PEP 562), so ``import fxsplit`` and the ``fxsplit``
command's ``--version`` and ``--help`` do not import torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from fxsplit.warn import FxsplitRuntimeWarning, FxsplitWarning

try:
    __version__ = version("fxsplit")
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

_SUBMODULES = ("counters", "presets", "runners")
# name -> the module that defines it.
_LAZY = {
    "ATTENTION": "fxsplit.regions",
    "ATTN_PREP": "fxsplit.regions",
    "SPARSE_INDEXER": "fxsplit.regions",
    "region": "fxsplit.regions",
    "Backend": "fxsplit.backend",
    "plans": "fxsplit.backend",
    "BindingError": "fxsplit.runtime.inputs.binding",
    "CaptureError": "fxsplit.runtime.emulation.emulator",
    "CaptureRefusedError": "fxsplit.runtime.piece.captured",
    "ConcurrentCallError": "fxsplit.runtime.step.session",
    "HostValueChangedError": "fxsplit.runtime.emulation.emulator",
    "Config": "fxsplit.config",
    "Piece": "fxsplit.plan",
    "RankMismatchError": "fxsplit.distributed",
    "SplitPlan": "fxsplit.plan",
    "StaleOutputError": "fxsplit.runtime.memory.output_lifetime",
    "StateMovedError": "fxsplit.runtime.emulation.emulator",
    "VerifyError": "fxsplit.runtime.piece.verify",
    "explain": "fxsplit.explain",
}

if TYPE_CHECKING:
    from fxsplit import counters, presets, runners
    from fxsplit.backend import Backend, plans
    from fxsplit.config import Config
    from fxsplit.distributed import RankMismatchError
    from fxsplit.explain import explain
    from fxsplit.plan import Piece, SplitPlan
    from fxsplit.regions import ATTENTION, ATTN_PREP, SPARSE_INDEXER, region
    from fxsplit.runtime.emulation.emulator import (
        CaptureError,
        HostValueChangedError,
        StateMovedError,
    )
    from fxsplit.runtime.inputs.binding import BindingError
    from fxsplit.runtime.memory.output_lifetime import StaleOutputError
    from fxsplit.runtime.piece.captured import CaptureRefusedError
    from fxsplit.runtime.piece.verify import VerifyError
    from fxsplit.runtime.step.session import ConcurrentCallError


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"fxsplit.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'fxsplit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    # Importing fxsplit.explain binds the module to that name; the function replaces it.
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = [
    "ATTENTION",
    "ATTN_PREP",
    "SPARSE_INDEXER",
    "Backend",
    "BindingError",
    "CaptureError",
    "CaptureRefusedError",
    "ConcurrentCallError",
    "Config",
    "FxsplitRuntimeWarning",
    "FxsplitWarning",
    "HostValueChangedError",
    "Piece",
    "RankMismatchError",
    "SplitPlan",
    "StaleOutputError",
    "StateMovedError",
    "VerifyError",
    "counters",
    "explain",
    "plans",
    "presets",
    "region",
    "runners",
]
