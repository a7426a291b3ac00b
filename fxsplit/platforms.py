"""Platform detection: which graph API the installed torch drives (CUDA, HIP on ROCm) or none."""

from __future__ import annotations

import functools
from typing import Literal

import torch

Platform = Literal["cuda", "rocm", "cpu"]
PLATFORMS: tuple[Platform, ...] = ("cuda", "rocm", "cpu")


@functools.cache
def current_platform() -> Platform:
    """``"rocm"`` for a HIP build of torch with a device, ``"cuda"`` for CUDA, else ``"cpu"``.

    Cached for the process; tests that fake a platform call ``current_platform.cache_clear()``.
    """
    if not torch.cuda.is_available():
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"
