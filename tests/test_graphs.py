"""What fxsplit does around CUDA graph capture, tested on CPU: the decisions of
:mod:`fxsplit.runtime.cuda.graphs` (which pool, which stream, what happens after a failed capture
or a
reset) with torch.cuda's objects replaced by recorders. The CUDA tests in
``tests/test_runtime_devices.py`` check the same on a real device.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import warnings
from typing import ClassVar

import pytest
import torch

import fxsplit
from fxsplit import counters
from fxsplit.runtime.cuda import graphs


class _Stream:
    def __init__(self, device=None):
        self.waited: list[object] = []

    def wait_stream(self, other):
        self.waited.append(other)


class _Graph:
    """Records what a torch.cuda.CUDAGraph is asked to do; ``fail_end`` makes capture_end raise
    like an invalidated capture; a capture whose function ran no kernel (``kernels`` left 0)
    warns at capture_end as CUDAGraph.cpp does."""

    made: ClassVar[list[_Graph]] = []
    fail_end = False
    kernels = 0  # kernels launched into the graph being captured (a function sets it)

    def __init__(self):
        self.calls: list[tuple] = []
        _Graph.made.append(self)

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.calls.append(("begin", pool, capture_error_mode))

    def capture_end(self):
        self.calls.append(("end",))
        if _Graph.fail_end:
            raise RuntimeError("operation failed due to a previous error during capture")
        if not _Graph.kernels:
            warnings.warn(
                "The CUDA Graph is empty. This usually means that the graph was attempted to be "
                "captured on wrong device or stream.",
                UserWarning,
                stacklevel=2,
            )
        _Graph.kernels = 0

    def replay(self):
        self.calls.append(("replay",))

    def reset(self):
        self.calls.append(("reset",))

    def register_generator_state(self, generator):
        self.calls.append(("register", generator))


@pytest.fixture
def fake_cuda(monkeypatch):
    pools = itertools.count(1)
    ended: list[tuple] = []
    current = _Stream()
    _Graph.made.clear()
    _Graph.fail_end = False
    _Graph.kernels = 0
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", next(pools)))
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(
        torch._C, "_cuda_endAllocateToPool", lambda d, p: ended.append((d, p)), raising=False
    )
    return ended


def test_failed_capture_raises_the_original_error_and_moves_to_a_fresh_pool(fake_cuda):
    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    first_pool = shared.pool

    def illegal():
        raise RuntimeError("operation not permitted when stream is capturing (.item())")

    graph = graphs.CudaGraph(shared)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        graph.capture(illegal)
    failed = graph._graph
    assert failed.calls[0] == ("begin", first_pool, "thread_local")
    assert ("end",) in failed.calls and ("reset",) in failed.calls
    assert fake_cuda == [(0, first_pool)]  # the allocator stops recording into the old pool
    assert shared.pool != first_pool and shared.renewals == 1

    graph = graphs.CudaGraph(shared)
    out = graph.capture(lambda: "ok")  # the next capture works, in the new pool
    assert out == "ok" and graph._graph.calls[0] == ("begin", shared.pool, "thread_local")


def test_capture_end_failure_also_releases_and_renews_the_pool(fake_cuda):
    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    first_pool = shared.pool
    shared.keep_alive()
    _Graph.fail_end = True
    with pytest.raises(RuntimeError, match="previous error during capture"):
        graphs.CudaGraph(shared).capture(lambda: "fn swallowed its own error")
    assert fake_cuda == [(0, first_pool)] and shared.pool != first_pool


def test_every_capture_on_a_device_uses_one_stream_and_one_pool(fake_cuda):
    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    for _ in range(3):
        graphs.CudaGraph(shared).capture(lambda: None)
    assert {g.calls[0] for g in _Graph.made} == {("begin", shared.pool, "thread_local")}
    # three captures and the pool's keeper
    assert len(shared.stream.waited) == 4 and shared.renewals == 0


def test_an_empty_keeper_graph_holds_each_pool_before_its_first_capture(fake_cuda):
    """A graph reset right after its capture (an output that requires grad) must not free the
    pool: the allocator would then fail the next capture_begin on that handle."""
    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    first = graphs.CudaGraph(shared)
    first.capture(lambda: None)
    keeper = _Graph.made[1]  # made after the first graph, captured before it
    assert keeper.calls == [("begin", shared.pool, "thread_local"), ("end",)]
    first.reset()
    graphs.CudaGraph(shared).capture(lambda: None)
    assert len(_Graph.made) == 3 and ("reset",) not in keeper.calls  # one keeper per pool
    shared.renew("test")
    graphs.CudaGraph(shared).capture(lambda: None)
    assert len(_Graph.made) == 5 and _Graph.made[4].calls[0][1] == shared.pool


def test_a_graph_registers_the_generators_its_piece_draws_from_before_capture(fake_cuda):
    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    generator = object()  # stands in for a torch.Generator(device="cuda")
    graph = graphs.CudaGraph(shared, generators=[generator])
    graph.capture(lambda: None)
    assert graph._graph.calls[0] == ("register", generator)
    assert graph._graph.calls[1][0] == "begin"


def test_the_cublas_workspaces_are_cleared_around_each_capture(fake_cuda, monkeypatch):
    cleared = []
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(1), raising=False
    )
    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    graph = graphs.CudaGraph(shared)

    def fn():
        assert len(cleared) == 1  # before capture_begin
        return "out"

    assert graph.capture(fn) == "out" and len(cleared) == 2


def test_reset_of_captured_graphs_takes_a_fresh_pool(fake_cuda, monkeypatch):
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)
    torch._dynamo.reset()
    counters.reset()

    @torch.library.custom_op("fxsplit_graphs::fresh", mutates_args=())
    def fresh(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    fresh.register_fake(lambda x: torch.empty_like(x))

    def f(x):
        return torch.ops.fxsplit_graphs.fresh(x.sin()) + 1

    backend = fxsplit.Backend(capture="emulate", splitting_ops=["fxsplit_graphs::fresh"])
    model = torch.compile(f, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(3, 4))
    runtime = backend.runtimes[0]
    runtime.pool.cuda = shared = graphs.DeviceCapture(torch.device("cuda", 0))
    pool = shared.pool
    assert runtime.reset() > 0
    assert shared.pool != pool and shared.renewals == 1
    assert runtime.reset() == 0 and shared.renewals == 1  # nothing dropped: pool kept
    torch._dynamo.reset()


def _kernel():
    _Graph.kernels += 1
    return "out"


def test_no_empty_graph_warning_reaches_the_user_and_an_empty_capture_is_known(fake_cuda):
    """torch warns "The CUDA Graph is empty" at capture_end for a graph without a kernel: the
    pool's keeper (empty on purpose) must not show it, and a piece's capture that launched no
    kernel is known as such (its piece then runs as its Python), never shown either."""
    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        working = graphs.CudaGraph(shared)
        assert working.capture(_kernel) == "out" and not working.empty
        views = graphs.CudaGraph(shared)
        views.capture(lambda: "views only")
    assert views.empty


def test_other_warnings_of_capture_end_still_reach_the_user(fake_cuda, monkeypatch):
    def end(self):
        self.calls.append(("end",))
        warnings.warn("something else", UserWarning, stacklevel=2)

    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    shared.keep_alive()
    monkeypatch.setattr(_Graph, "capture_end", end)
    with pytest.warns(UserWarning, match="something else"):
        graphs.CudaGraph(shared).capture(_kernel)


def test_closing_a_failed_captures_state_completes_an_empty_capture_of_its_generators(
    fake_cuda,
):
    """torch 2.11 leaves the default CUDA generator (and those registered) capturing when
    capture_end raises; a completed capture on the capture stream, with the same generators
    registered, into a pool of its own, closes that state."""
    shared = graphs.DeviceCapture(torch.device("cuda", 0))
    generator = object()  # stands in for a torch.Generator(device="cuda")
    graph = graphs.CudaGraph(shared, generators=[generator])
    _Graph.fail_end = True
    with pytest.raises(RuntimeError):
        graph.capture(_kernel)
    _Graph.fail_end = False
    made = len(_Graph.made)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph.close_capture_state()
    (closer,) = _Graph.made[made:]
    assert closer.calls == [
        ("register", generator),
        ("begin", None, "thread_local"),
        ("end",),
        ("reset",),
    ]
