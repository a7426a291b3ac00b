"""Rank functions for ``tests/test_distributed.py``, run in spawned processes by
:func:`fxsplit.tools.tp_demo.spawn` (module level, so a spawned process can import them).

:func:`every_check` runs all of them in one spawn: starting the processes (importing torch in
each) costs about as much as a check.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import fxsplit
from fxsplit.models import deepseek_v4
from fxsplit.tools import tp_demo

IN, HIDDEN = 8, 16


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(HIDDEN, IN, generator=gen), torch.randn(IN, HIDDEN, generator=gen)


def column_row_parallel(rank: int, world_size: int):
    """``f(x)``: a column-parallel then row-parallel linear pair (the partial sums all-reduced in
    a captured piece), then ``topk`` (a splitting op), and the single-process ``reference(x)``."""
    w1, w2 = _weights()
    block = HIDDEN // world_size
    a = w1[rank * block : (rank + 1) * block]
    b = w2[:, rank * block : (rank + 1) * block].contiguous()
    group = dist.group.WORLD

    def f(x):
        y = funcol.all_reduce(F.linear(F.linear(x, a).relu(), b), "sum", group) * 2 + 1
        return y.sum(-1, keepdim=True) + torch.topk(y, 2).values.sum(-1, keepdim=True)

    def reference(x):
        y = F.linear(F.linear(x, w1).relu(), w2) * 2 + 1
        return y.sum(-1, keepdim=True) + torch.topk(y, 2).values.sum(-1, keepdim=True)

    return f, reference


def _inputs(step: int, batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, IN, generator=torch.Generator().manual_seed(step))


def replay_collective(rank: int, world_size: int) -> dict:
    """Decode-like steps of :func:`column_row_parallel` compiled with emulated capture, with and
    without ``verify``, then ``Backend.capture`` over two sizes: per run, the largest
    difference from the single-process function and the replays; the capture keys in the
    order they were captured."""
    f, reference = column_row_parallel(rank, world_size)
    out = {}
    with torch.no_grad():
        for verify in (False, True):
            torch._dynamo.reset()
            before = fxsplit.counters.snapshot()["replays"]
            backend = fxsplit.Backend(
                capture="emulate", splitting_ops=["aten::topk"], verify=verify
            )
            compiled = torch.compile(f, backend=backend)
            diffs = []
            for step in range(5):
                x = _inputs(step)
                diffs.append((compiled(x) - reference(x)).abs().max().item())
            out[f"verify={verify}"] = {
                "diffs": diffs,
                "replays": fxsplit.counters.snapshot()["replays"] - before,
            }
        torch._dynamo.reset()
        backend = fxsplit.Backend(capture="emulate", splitting_ops=["aten::topk"])
        compiled = torch.compile(f, backend=backend)
        backend.capture(compiled, {2: (_inputs(0, 2),), 6: (_inputs(0, 6),), 4: (_inputs(0, 4),)})
        out["capture_order"] = [
            (graph, piece, key)
            for graph, pieces in backend.stats.items()
            for piece, keys in pieces.items()
            for key in keys
        ]
    return out


def diverge(rank: int, world_size: int) -> tuple[str, str, list, str]:
    """Rank 1 makes ``relu`` a splitting op, the others do not: the compile must fail with the
    rank-agreement error on every rank (never hang at the all-reduce). Returns the error's
    type name, message, rank groups and piece."""
    f, _ = column_row_parallel(rank, world_size)
    ops = ["aten::topk", "aten::relu"] if rank == 1 else ["aten::topk"]
    backend = fxsplit.Backend(capture="emulate", splitting_ops=ops)
    try:
        with torch.no_grad():
            torch.compile(f, backend=backend)(_inputs(0))
    except Exception as error:  # torch wraps the backend's error in BackendCompilerFailed
        inner = getattr(error, "inner_exception", error)
        return (
            type(inner).__name__,
            str(inner),
            getattr(inner, "groups", None),
            getattr(inner, "piece", None),
        )
    return ("none", "compiled without an error", None, None)


def diverge_compiled(rank: int, world_size: int) -> dict:
    """Two ways ranks run a captured piece differently: ``compile_pieces`` differs per rank, and
    Inductor fails on rank 1 only (its piece falls back to the generated Python). Both must fail
    with the rank-agreement error on every rank, never hang. Returns, per way, what
    :func:`diverge` returns."""
    import os
    import tempfile
    from unittest import mock

    f, _ = column_row_parallel(rank, world_size)
    out = {}
    for way in ("option", "inductor_failed"):
        torch._dynamo.reset()
        mode = "eager" if way == "option" and rank == 1 else "inductor"
        folder = os.path.join(tempfile.gettempdir(), f"fxsplit_diverge_{os.getpid()}_{way}")
        backend = fxsplit.Backend(
            capture="emulate",
            splitting_ops=["aten::topk"],
            compile_pieces=mode,
            cache_dir=folder,
        )
        failing = mock.patch.object(
            torch._inductor,
            "standalone_compile",
            side_effect=RuntimeError("Inductor failed on this rank"),
        )
        try:
            with torch.no_grad(), failing if way == "inductor_failed" and rank == 1 else _noop():
                torch.compile(f, backend=backend)(_inputs(0))
            out[way] = ("none", "compiled without an error", None, None)
        except Exception as error:
            inner = getattr(error, "inner_exception", error)
            out[way] = (
                type(inner).__name__,
                str(inner),
                getattr(inner, "groups", None),
                getattr(inner, "piece", None),
            )
    return out


def _noop():
    import contextlib

    return contextlib.nullcontext()


def hang(rank: int, world_size: int) -> None:
    """Rank 0 waits in an all-reduce that rank 1 never joins (rank 1 sleeps): a hang."""
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    time.sleep(3600)


def decode(rank: int, world_size: int) -> dict:
    """:func:`fxsplit.tools.tp_demo.decode` under v1 and v2 on a one-layer model (compile time
    rules this check), steps long enough to capture and replay size 4."""
    config = deepseek_v4.DeepseekV4Config(num_layers=1)
    return tp_demo.decode(rank, world_size, tp_demo.RUNNERS, (4, 4, 4, 2, 4), config)


def llama_prefill(rank: int, world_size: int) -> dict:
    """The tensor-parallel Llama model compiled with its attention op as the splitting op,
    capture emulated, over three prefills of one shape (warm-up, capture, replay): the largest
    difference from the single-process model, equality with the eager tensor-parallel copy, and
    the replays."""
    from fxsplit.models import llama

    single, (ids, positions) = llama.example()
    model = llama.build(group=dist.group.WORLD)
    eager = llama.build(group=dist.group.WORLD)
    torch._dynamo.reset()
    backend = fxsplit.Backend(capture="emulate", splitting_ops=list(llama.SPLITTING_OPS))
    compiled = torch.compile(model, backend=backend)
    before = fxsplit.counters.snapshot()["replays"]
    diffs, exact = [], []
    with torch.no_grad():
        for shift in range(3):
            step_ids = (ids + shift) % single.config.vocab_size
            got = compiled(step_ids, positions)
            diffs.append((got - single(step_ids, positions)).abs().max().item())
            exact.append(torch.equal(got, eager(step_ids, positions)))
    return {
        "diffs": diffs,
        "exact": exact,
        "replays": fxsplit.counters.snapshot()["replays"] - before,
    }


def indivisible(rank: int, world_size: int) -> list[str]:
    """The errors of tensor-parallel models whose sizes the group does not divide."""
    from fxsplit.models import llama

    group = dist.group.WORLD
    errors = []
    for build in (
        lambda: deepseek_v4.build(deepseek_v4.DeepseekV4Config(num_heads=3), group=group),
        lambda: llama.build(llama.LlamaConfig(num_heads=3, num_kv_heads=1), group=group),
    ):
        try:
            build()
        except ValueError as error:
            errors.append(str(error))
    return errors


CHECKS = {
    "decode": decode,
    "replay_collective": replay_collective,
    "diverge": diverge,
    "diverge_compiled": diverge_compiled,
    "llama_prefill": llama_prefill,
    "indivisible": indivisible,
}


def every_check(rank: int, world_size: int) -> dict:
    """``{check name: its result, or "error: <type>: <message>"}`` for every check in
    :data:`CHECKS`, run in that order on every rank."""
    out = {}
    for name, check in CHECKS.items():
        try:
            out[name] = check(rank, world_size)
        except Exception as error:
            out[name] = f"error: {type(error).__name__}: {error}"
    return out
