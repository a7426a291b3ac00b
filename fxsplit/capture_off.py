"""The one line saying that capture is off: ``capture="auto"`` (the default) captures CUDA graphs
only where a graph's tensors are on a CUDA or ROCm device, so on a CPU machine it captures and
replays nothing, and counters full of zeros would otherwise be the only sign. Logged (never
warned: fxsplit's warnings are errors in its own test suite and in users' strict setups) on the
``fxsplit`` logger, once per process, by the backend's first such graph and by
``fxsplit.explain``; the demo prints the same reason.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("fxsplit")

EMULATOR = "the CPU capture emulator (CUDA-graph semantics on the CPU)"

_lock = threading.Lock()
_told = False


def reason(capture: str, cuda_device: torch.device | None) -> str | None:
    """Why ``capture`` captures nothing for a graph whose CUDA device is ``cuda_device`` (None
    where its tensors are on none), or None where it captures or was chosen other than "auto"."""
    if capture != "auto" or cuda_device is not None:
        return None
    if torch.cuda.is_available():
        return "the graph's tensors are not on a CUDA device"
    return "torch sees no CUDA or ROCm device"


def message(why: str) -> str:
    """The line, for the reason :func:`reason` gave."""
    return (
        f"fxsplit: capture is off ({why}): capture='auto' captures CUDA graphs only on a CUDA "
        f"or ROCm device, so nothing is captured or replayed; capture='emulate' runs {EMULATOR}"
    )


def tell_once(capture: str, cuda_device: torch.device | None) -> bool:
    """Log :func:`message` if ``capture`` captures nothing here and no graph of this process
    said so before; returns whether it logged."""
    global _told
    why = reason(capture, cuda_device)
    if why is None:
        return False
    with _lock:
        if _told:
            return False
        _told = True
    log.warning(message(why))
    return True
