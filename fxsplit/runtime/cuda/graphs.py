"""Graph objects behind a captured piece: CUDA/HIP graphs or the CPU emulator, one interface.

Both give ``capture(fn, *args) -> outputs`` (outputs already hold ``fn(*args)``'s result),
``replay()`` (recomputes into the same outputs from whatever the captured input tensors hold) and
``reset()``. CUDA graphs of one backend and device share a :class:`DeviceCapture`: one memory
pool and one capture stream, as Inductor's cudagraph trees and the serving engines do.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch

from fxsplit.runtime.emulation.emulated_pool import EmulatedPool
from fxsplit.runtime.emulation.emulator import CaptureError, EmulatedGraph

__all__ = ["CaptureError", "CudaGraph", "DeviceCapture", "EmulatedGraph", "new_graph"]

log = logging.getLogger("fxsplit")


class DeviceCapture:
    """What every CUDA/HIP graph of one backend on one device shares: a memory pool handle and
    the stream all warmups and captures run on.

    One stream, because the caching allocator reuses memory per stream (a new side stream per
    capture gets new scratch memory and cuBLAS workspaces) and because graphs sharing a pool are
    only safe when replayed in capture order, which one stream keeps.

    The pool is replaced by a fresh handle (:meth:`renew`) after a failed capture (the old pool
    may still be marked as being captured into) and when the backend's graphs are reset. Each
    pool is first captured into by an empty *keeper* graph that lives as long as the handle is in
    use: the caching allocator frees a private pool when its last graph is reset, and a later
    ``capture_begin`` on the freed handle fails its use-count check (Inductor's cudagraph trees
    keep their pool the same way). A graph reset after its capture (an output that requires
    grad) then never takes the pool with it.

    Args:
        device: a CUDA device (``torch.device("cuda", i)``).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.renewals = 0
        self._keeper = None

    def keep_alive(self) -> None:
        """Capture the pool's keeper graph if it has none yet (before the first capture)."""
        if self._keeper is not None:
            return
        keeper = torch.cuda.CUDAGraph()
        index = self.device.index if self.device.index is not None else 0
        with torch.cuda.device(index):
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream), warnings.catch_warnings():
                # empty on purpose; torch warns of every empty graph, once per pool (cudagraph
                # trees silence their keeper the same way)
                warnings.filterwarnings("ignore", _EMPTY)
                keeper.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                keeper.capture_end()
        self._keeper = keeper

    def renew(self, reason: str) -> None:
        """Take a fresh pool handle; graphs captured earlier keep the old pool alive."""
        self.pool = torch.cuda.graph_pool_handle()
        self._keeper = None
        self.renewals += 1
        log.info("fxsplit: new capture memory pool on %s (%s)", self.device, reason)


# torch's warning at capture_end for a graph without a kernel (CUDAGraph.cpp)
_EMPTY = "The CUDA Graph is empty"


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _end_allocating(device: torch.device, pool) -> None:
    """Tell the caching allocator that capture into ``pool`` ended (``capture_end`` raises
    before doing so when the capture was invalidated)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        with contextlib.suppress(RuntimeError):  # it was already told
            end(device.index if device.index is not None else 0, pool)


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` (a hipGraph on ROCm) captured into a shared memory pool.

    Capture runs on the device's capture stream (capture on the default stream is illegal) with
    ``capture_error_mode="thread_local"`` (another thread's CUDA work cannot break it) under a
    device guard; the current stream then waits for it. cuBLAS's workspaces are dropped before
    and after each capture (as cudagraph trees do): a workspace a captured matmul needs is then
    allocated inside the pool during that capture, and freed into it like the graph's scratch,
    never memory of the eager allocator that the graph would keep using after it is freed.
    Unlike ``torch.cuda.graph``, entering a capture does not run ``gc.collect()`` or empty the
    cache: the backend collects garbage once per capture session instead of once per piece.

    Args:
        capture: the backend's :class:`DeviceCapture` for the piece's device.
        generators: CUDA generators other than the default one that the piece draws from; each
            is registered with the graph (``register_generator_state``), without which a
            capture drawing from it fails.
    """

    def __init__(self, capture: DeviceCapture, generators=()):
        self._graph = torch.cuda.CUDAGraph()
        self._capture = capture
        self._index = capture.device.index if capture.device.index is not None else 0
        self._generators = tuple(generators)
        for generator in self._generators:
            self._graph.register_generator_state(generator)
        self.empty = False  # captured no kernel

    def capture(self, fn, *args):
        """Capture ``fn(*args)`` and replay it once so the outputs hold this call's result.

        Raises:
            the exception ``fn`` raised (an op illegal under capture, a model error), never the
            follow-up "operation failed due to a previous error during capture"; the pool is
            then released and replaced, so later captures of other pieces still work.
        """
        shared = self._capture
        shared.keep_alive()
        pool = shared.pool
        with torch.cuda.device(self._index):
            current = torch.cuda.current_stream()
            shared.stream.wait_stream(current)
            with torch.cuda.stream(shared.stream):
                _clear_cublas_workspaces()
                self._graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    outputs = fn(*args)
                except BaseException:
                    self._abandon(pool, ended=False)
                    raise
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        self._graph.capture_end()
                except BaseException:
                    self._abandon(pool, ended=True)
                    raise
                for warning in caught:
                    if _EMPTY in str(warning.message):
                        self.empty = True  # known, not shown: the piece runs as its Python
                    else:
                        warnings.warn_explicit(
                            warning.message, warning.category, warning.filename, warning.lineno
                        )
                _clear_cublas_workspaces()
            current.wait_stream(shared.stream)
            self._graph.replay()
        return outputs

    def capture_piece(self, fn, statics, written, uncompiled=None, validate=None):
        """:meth:`capture` of a piece, ``fn(*statics)``, then ``validate(outputs)`` (which may
        raise). CUDA checks what capture rejects itself, so ``uncompiled`` (a compiled piece's
        generated Python) is not needed, and ``written`` (what the piece writes) is not
        restored: the capture executes nothing before its one replay.

        Raises:
            as :meth:`capture`, or what ``validate`` raised.
        """
        outputs = self.capture(fn, *statics)
        if validate is not None:
            validate(outputs)
        return outputs

    def _abandon(self, pool, ended: bool) -> None:
        """After a failed capture: end it, release the pool's recording, take a fresh pool."""
        if not ended:
            # invalidated: its own error is secondary; not invalidated: maybe empty
            with contextlib.suppress(RuntimeError), warnings.catch_warnings():
                warnings.filterwarnings("ignore", _EMPTY)
                self._graph.capture_end()
        _end_allocating(self._capture.device, pool)
        with contextlib.suppress(RuntimeError):
            self._graph.reset()
        self._capture.renew("a capture failed")

    def close_capture_state(self) -> None:
        """After a failed capture: close the capture state it left the device's generators in.
        torch 2.11's ``capture_end`` raises before the generators' capture epilogue runs, so
        the default CUDA generator (and those registered) still count themselves as capturing,
        and every later draw outside a capture raises "Offset increment outside graph capture
        encountered unexpectedly" until a capture completes: an empty one completes here, on
        the capture stream, into a pool of its own (freed with it)."""
        closer = torch.cuda.CUDAGraph()
        for generator in self._generators:
            closer.register_generator_state(generator)
        shared = self._capture
        with torch.cuda.device(self._index):
            shared.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(shared.stream), warnings.catch_warnings():
                warnings.filterwarnings("ignore", _EMPTY)
                closer.capture_begin(capture_error_mode="thread_local")
                closer.capture_end()
            torch.cuda.current_stream().wait_stream(shared.stream)
        closer.reset()

    def replay(self) -> None:
        """Launch the graph on the current stream (under a guard for another device)."""
        if torch.cuda.current_device() == self._index:
            self._graph.replay()
        else:
            with torch.cuda.device(self._index):
                self._graph.replay()

    def reset(self) -> None:
        """Free the graph (its pool memory returns to the pool)."""
        self._graph.reset()


def new_graph(
    mode: str,
    capture: DeviceCapture | None = None,
    pool: EmulatedPool | None = None,
    generators=(),
):
    """A fresh graph object for capture mode ``"cuda"`` (needs ``capture``) or ``"emulate"``
    (into ``pool``, a private one when None); either registers ``generators``, the generators
    other than the default one that the piece draws from."""
    if mode == "cuda":
        return CudaGraph(capture, generators)
    return EmulatedGraph(pool, generators)
