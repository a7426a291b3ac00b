"""The one line saying that capture is off: ``capture="auto"`` (the default) captures CUDA graphs
only where a graph's tensors are on a CUDA or ROCm device, so on a CPU machine it captures and
replays nothing, and counters full of zeros would otherwise be the only sign. Logged (never
warned: fxsplit's warnings are errors in its own test suite and in users' strict setups) on the
``fxsplit`` logger, once per process, by the backend's first such graph and by
``fxsplit.explain``; the demo prints the same reason.

With capture off a graph has no run time (nothing to capture, replay or check), so its captured
pieces run as the stitched module's plain calls: :func:`counted` counts them as uncaptured runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from fxsplit import counters

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


def counted(forward: Callable, captured: int) -> Callable:
    """``forward`` (a stitched module's, run with capture off) adding its ``captured`` pieces
    to the ``uncaptured_runs`` counter at every call: each of them runs once per call, never
    captured. Without it the counters showed captured pieces with neither captures nor
    uncaptured runs, as if the pieces had not run at all. ``forward`` itself where
    ``captured`` is 0."""
    if captured == 0:
        return forward

    def run_uncaptured(*args):
        counters.totals["uncaptured_runs"] += captured
        return forward(*args)

    return run_uncaptured
