"""GPU check of the tensor-parallel path: NCCL with world size 1, collectives captured in CUDA
graphs (run by ``scripts/gpu_check.sh``; needs one CUDA/ROCm device).

One process joins a one-rank NCCL group, builds the tensor-parallel DeepSeek-V4 model over it
(every ``all_reduce``, ``all_gather`` and ``reduce_scatter`` really runs through NCCL), compiles
it with ``capture="cuda"`` and ``on_capture_error="raise"`` under runners v1 and v2, and decodes
changing batch sizes. Checks, per step, the logits against an eager copy of the same model and
against the single-process model (within 1e-4: replayed kernels may differ from eager ones), and
at the end that pieces holding collectives were captured and replayed. Prints one line per
runner and exits 1 on any failure. Tears down in the one order that cannot hang (see
:func:`teardown`).

Usage: python3 scripts/tp_nccl_check.py
"""

from __future__ import annotations

import datetime
import gc
import sys

import torch
import torch.distributed as dist

import fxsplit
from fxsplit import collectives
from fxsplit.models import deepseek_v4
from fxsplit.tools.tp_demo import free_port

STEPS = (4, 4, 4, 2, 4, 8, 8, 8)
ATOL = 1e-4


def _collective_pieces(backend: fxsplit.Backend) -> set[str]:
    """Names of captured pieces that hold a functional collective."""
    found = set()
    for split in backend.compiled:
        nodes = {n.name: n for n in split.graph_module.graph.nodes}
        for piece in split.plan.captured:
            if any(collectives.is_collective_node(nodes[name]) for name in piece.nodes):
                found.add(f"{split.plan.graph_id}.{piece.name}")
    return found


def check(runner: str, device: str = "cuda", capture: str = "cuda") -> tuple[bool, str]:
    """Decode under ``runner`` on ``device`` (a process group must be initialised); returns
    (ok, one line of figures). ``device="cpu", capture="emulate"`` over gloo runs the same
    check on a CPU machine."""
    torch._dynamo.reset()
    group = dist.group.WORLD
    persistent = fxsplit.runners.get(runner).persistent_inputs
    single = deepseek_v4.build().to(device)
    model = deepseek_v4.build(group=group).to(device)
    eager = deepseek_v4.clone_model(model)
    backend = fxsplit.Backend(runner=runner, capture=capture, on_capture_error="raise")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    feeds = [
        deepseek_v4.DecodeRunner(single.config, max(STEPS), persistent=persistent, device=device)
        for _ in range(3)
    ]
    worst_eager = worst_single = 0.0
    before = fxsplit.counters.snapshot()
    with torch.no_grad():
        for batch in STEPS:
            got = compiled(*feeds[0].step(batch)).clone()
            worst_eager = max(worst_eager, (got - eager(*feeds[1].step(batch))).abs().max().item())
            worst_single = max(
                worst_single, (got - single(*feeds[2].step(batch))).abs().max().item()
            )
    after = fxsplit.counters.snapshot()
    captures = after["captures"] - before["captures"]
    replays = after["replays"] - before["replays"]
    pieces = _collective_pieces(backend)
    replayed = {
        f"{graph}.{piece}"
        for graph, by_piece in backend.stats.items()
        for piece, keys in by_piece.items()
        if any(k.get("replays", 0) for k in keys.values())
    }
    ok = worst_eager <= ATOL and worst_single <= ATOL and bool(pieces & replayed)
    line = (
        f"{runner}: max diff vs eager TP {worst_eager:.3g}, vs one process {worst_single:.3g}; "
        f"{captures} captures, {replays} replays; captured pieces with collectives "
        f"{len(pieces)}, of them replayed {len(pieces & replayed)}: {'ok' if ok else 'FAILED'}"
    )
    return ok, line


def teardown(device: torch.device) -> None:
    """Free every captured graph, wait for ``device``, then destroy the default process group.

    Destroying an NCCL communicator while CUDA graphs that captured its kernels are alive can
    block for good, so the graphs go first: ``torch._dynamo.reset()`` resets every backend
    (releasing its graphs and memory pool) and drops Dynamo's compiled code, ``gc.collect()``
    frees what cycles still hold, and ``torch.cuda.synchronize`` lets queued work finish.
    """
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.destroy_process_group()


def main() -> int:
    if not torch.cuda.is_available() or not dist.is_available():
        print("tp_nccl_check: needs a CUDA/ROCm device and torch.distributed; skipped")
        return 0
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", 0),  # the communicator exists before any capture
    )
    ok = True
    try:
        for runner in ("v1", "v2"):
            try:
                good, line = check(runner)
            except Exception as error:  # report and go on to the other runner
                good, line = False, f"{runner}: FAILED: {type(error).__name__}: {error}"
            ok &= good
            print(line, flush=True)
    finally:
        teardown(torch.device("cuda", 0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
