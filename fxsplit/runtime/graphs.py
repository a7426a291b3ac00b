"""Graph objects behind a captured piece: CUDA/HIP graphs or the CPU emulator, one interface.

Both give ``capture(fn, *args) -> outputs`` (outputs already hold ``fn(*args)``'s result) and
``replay()`` (recomputes into the same outputs from whatever the captured input tensors hold).
"""

from __future__ import annotations

import torch

from fxsplit.runtime.emulator import CaptureError, EmulatedGraph

__all__ = ["CaptureError", "CudaGraph", "EmulatedGraph", "new_graph"]


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` (a hipGraph on ROCm) captured into a shared memory pool.

    Capture runs on a side stream (capture on the default stream is illegal) and the current
    stream then waits for it; replay is launched on the current stream. Unlike
    ``torch.cuda.graph``, entering a capture does not run ``gc.collect()`` or empty the cache:
    the backend collects garbage once per capture session instead of once per piece.

    Args:
        pool: a handle from ``torch.cuda.graph_pool_handle()`` shared by every graph of a backend
            on this device.
        device: the CUDA device of the piece's tensors.
    """

    def __init__(self, pool, device: torch.device):
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool
        self._device = device

    def capture(self, fn, *args):
        """Capture ``fn(*args)`` and replay it once so the outputs hold this call's result.

        Raises:
            RuntimeError: torch's error when ``fn`` runs an op illegal under capture.
        """
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._graph.capture_begin(pool=self._pool)
            try:
                outputs = fn(*args)
            finally:
                self._graph.capture_end()
        current.wait_stream(side)
        self._graph.replay()
        return outputs

    def replay(self) -> None:
        """Launch the graph on the current stream."""
        self._graph.replay()

    def reset(self) -> None:
        """Free the graph (its pool memory returns to the pool)."""
        self._graph.reset()


def new_graph(mode: str, pool=None, device: torch.device | None = None):
    """A fresh graph object for capture mode ``"cuda"`` or ``"emulate"``."""
    if mode == "cuda":
        return CudaGraph(pool, device)
    return EmulatedGraph()
