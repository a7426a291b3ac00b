"""The GPU check's logic, on CPU: the teardown order of ``scripts/tp_nccl_check.py``, the time
budget of ``bench/decode_latency.py``, and the time limits, plan and summary of
``scripts/gpu_check.sh`` (run by ``bash``, its parts stopped at their limits)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import fxsplit
from fxsplit.tools.tp_demo import free_port

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("fresh_capture_state")


def _load(path: str):
    """A script of the repository imported as a module (scripts/ and bench/ are no packages)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# scripts/tp_nccl_check.py: graphs go before the process group


def test_tp_teardown_frees_every_graph_then_synchronises_then_destroys_the_group(monkeypatch):
    """Destroying a communicator while graphs that captured its collectives are alive can hang
    on NCCL; the teardown must free them, then wait for the device, then destroy the group.
    Here over gloo with a captured all_reduce (the CUDA synchronise is recorded, not run)."""
    tp = _load("scripts/tp_nccl_check.py")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        group = dist.group.WORLD
        backend = fxsplit.Backend(capture="emulate", splitting_ops=["aten::topk"])

        def f(x):
            y = funcol.all_reduce(x * 2, "sum", group) + 1
            return y + torch.topk(y, 2).values.sum(-1, keepdim=True)

        compiled = torch.compile(f, backend=backend)
        x = torch.randn(4, 8)
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(compiled(x), f(x))
        assert fxsplit.counters.snapshot()["replays"] > 0
        runtimes = list(backend.runtimes)

        def graphs_held() -> int:
            return sum(len(piece.entries) for rt in runtimes for piece in rt.pieces)

        assert graphs_held() > 0
        events = []
        reset, destroy = torch._dynamo.reset, dist.destroy_process_group
        monkeypatch.setattr(torch._dynamo, "reset", lambda: (events.append("reset"), reset()))
        monkeypatch.setattr(
            torch.cuda, "synchronize", lambda device=None: events.append(f"synchronize {device}")
        )

        def destroy_recorded(group=None):
            events.append(f"destroy with {graphs_held()} graphs held")
            destroy(group)

        monkeypatch.setattr(dist, "destroy_process_group", destroy_recorded)
        tp.teardown(torch.device("cuda", 0))
        assert events == ["reset", "synchronize cuda:0", "destroy with 0 graphs held"]
        assert backend.runtimes == [] and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
