"""``fxsplit demo --tp N``: the DeepSeek-V4 decode steps tensor-parallel over N CPU processes.

Spawns N processes (``torch.multiprocessing``, start method spawn) that form a gloo group on a
free loopback port. Each rank builds the tensor-parallel model (its shards of the single-process
model's weights), compiles it with ``backend=fxsplit.Backend(runner=..., capture="emulate")`` and
decodes the demo's steps under runners v1 and v2, next to an eager copy of the same
tensor-parallel model and the single-process model. Per step it records the largest difference
of its logits from the single-process model's, whether they equal the eager tensor-parallel
model's bit for bit (the split and the replays, collectives included, change no number), and the
step's captures and replays. The parent prints one table and returns 1 on any difference.

:func:`spawn` (with its hard timeout) is what the distributed tests use as well.
"""

from __future__ import annotations

import datetime
import queue
import socket
import time
from collections.abc import Callable

import torch

# Logits of the tensor-parallel model differ from the single-process model's only by the order
# of floating-point sums (partial products summed across ranks).
ATOL = 1e-4
RUNNERS = ("v1", "v2")
TIMEOUT_S = 240.0


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> None:
    """Join the gloo group of ``world_size`` ranks on ``127.0.0.1:port``; a collective that
    waits longer than ``timeout_s`` raises instead of hanging."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _entry(rank: int, fn: Callable, world_size: int, port: int, results, args: tuple) -> None:
    """Runs in each spawned process: join the group, run ``fn``, report its result or error."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share the machine's cores
    try:
        init_gloo(rank, world_size, port)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException as error:
        results.put((rank, "error", f"{type(error).__name__}: {error}"))


def spawn(fn: Callable, world_size: int, *args, timeout_s: float = TIMEOUT_S) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in a gloo
    group; return each rank's result, in rank order.

    ``fn`` must be importable by name (a module-level function) and return a picklable value.
    An exception on a rank is returned as the string ``"error: <type>: <message>"`` in that
    rank's slot (the others still finish or time out).

    Raises:
        TimeoutError: the ranks did not all finish within ``timeout_s`` (a hang); every
            process is killed first.
        RuntimeError: a process died without reporting (killed, crashed).
    """
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        raise RuntimeError("this torch is built without torch.distributed")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, port, results, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    got: dict[int, object] = {}
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(got))} did not finish within "
                    f"{timeout_s:.0f} s (a hang?); killed all {world_size} processes"
                )
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p.pid for p in context.processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"spawned processes {dead} died without reporting") from None
                continue
            got[rank] = value if status == "ok" else f"error: {value}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join(timeout=10)
    return [got[r] for r in range(world_size)]


def decode(rank: int, world_size: int, runners=RUNNERS, steps=None, config=None, **options) -> dict:
    """One rank of the demo (run by :func:`spawn`): the demo's decode ``steps`` (batch sizes)
    of the DeepSeek-V4 model with ``config`` (the default when None) under each runner.

    Returns:
        ``{"rows": [...], "plans": {runner: [plan text, ...]}, "split_plans": {runner:
        [SplitPlan, ...]}}``: per runner and step, a row dict with ``runner``, ``step``,
        ``batch``, ``diff`` (largest difference from the single-process model), ``exact``
        (equal to the eager tensor-parallel model bit for bit), ``captures`` and ``replays``
        (this rank's, during that step); each runner's plans as text and as data.

    ``options`` go to :class:`fxsplit.Backend` on top of the runner and ``capture="emulate"``.
    """
    import torch.distributed as dist

    import fxsplit
    from fxsplit.models import deepseek_v4
    from fxsplit.tools.demo import STEPS

    steps = STEPS if steps is None else steps
    group = dist.group.WORLD
    rows, plans, split_plans = [], {}, {}
    for runner in runners:
        torch._dynamo.reset()
        persistent = fxsplit.runners.get(runner).persistent_inputs
        single = deepseek_v4.build(config)
        model = deepseek_v4.build(config, group=group)
        eager = deepseek_v4.clone_model(model)
        backend = fxsplit.Backend(runner=runner, capture="emulate", **options)
        compiled = torch.compile(model, backend=backend, dynamic=True)
        feeds = [
            deepseek_v4.DecodeRunner(single.config, max(steps), persistent=persistent)
            for _ in range(3)
        ]
        with torch.no_grad():
            for step, batch in enumerate(steps):
                before = fxsplit.counters.snapshot()
                got = compiled(*feeds[0].step(batch)).clone()
                after = fxsplit.counters.snapshot()
                want_tp = eager(*feeds[1].step(batch))
                want = single(*feeds[2].step(batch))
                rows.append(
                    {
                        "runner": runner,
                        "step": step,
                        "batch": batch,
                        "diff": (got - want).abs().max().item(),
                        "exact": torch.equal(got, want_tp),
                        "captures": after["captures"] - before["captures"],
                        "replays": after["replays"] - before["replays"],
                    }
                )
        plans[runner] = [plan.format() for plan in backend.plans]
        split_plans[runner] = list(backend.plans)
    return {"rows": rows, "plans": plans, "split_plans": split_plans}


def run(world_size: int) -> int:
    """``fxsplit demo --tp N``; returns the exit status (0 when every rank matched)."""
    from rich.console import Console

    from fxsplit.tools import demo

    console = Console()
    processes = f"{world_size} CPU process{'es' if world_size != 1 else ''}"
    console.print(
        f"tensor parallel: {processes}, gloo, capture emulated; torch {torch.__version__}",
        highlight=False,
    )
    # The words its tables show: plans titled without a step, captures and replays per rank.
    meanings = dict(demo.LEGEND)
    legend = (
        ("graph_<n>", "the n-th graph Dynamo compiled"),
        *((word, meanings[word]) for word in ("captures", "replays")),
    )
    demo.print_legend(console, legend)
    try:
        # N ranks share the machine's cores: allow more time for more ranks.
        results = spawn(decode, world_size, timeout_s=max(TIMEOUT_S, 120.0 * world_size))
    except (TimeoutError, RuntimeError) as error:
        console.print(f"[red]tensor-parallel demo failed: {error}[/]")
        return 1
    errors: dict[str, list[int]] = {}  # one line per distinct error, naming its ranks
    for rank, result in enumerate(results):
        if isinstance(result, str):
            errors.setdefault(result, []).append(rank)
    if errors:
        for error, ranks in errors.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            console.print(f"[red]{who}: {error}[/]", highlight=False, soft_wrap=True)
        return 1
    console.print(render(results, world_size))
    ok = all(row["ok"] for row in _rows(results))
    for runner in RUNNERS:  # the captured path must have run, on every rank
        for rank, result in enumerate(results):
            if not any(r["replays"] for r in result["rows"] if r["runner"] == runner):
                ok = False
                console.print(f"[red]rank {rank}, runner {runner}: no replay[/]")
    console.print(
        f"max diff: the largest over the ranks against the single-process model (allowed "
        f"{ATOL:g}: sums run in another order); every rank's compiled logits must also equal "
        "its eager tensor-parallel model's bit for bit",
        highlight=False,
    )
    console.print("[green]all comparisons passed[/]" if ok else "[red]a comparison FAILED[/]")
    return 0 if ok else 1


def _rows(results: list[dict]) -> list[dict]:
    """Rank 0's rows, each with ``ranks`` (every rank's row of that step) and ``ok``."""
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        per_rank = [result["rows"][i] for result in results]
        good = all(r["diff"] <= ATOL and r["exact"] for r in per_rank)
        good &= len({(r["captures"], r["replays"]) for r in per_rank}) == 1
        rows.append({**row, "ranks": per_rank, "ok": good})
    return rows


def render(results: list[dict], world_size: int):
    """The demo's output for ``results`` (one :func:`decode` result per rank) as one rich
    ``Group``: rank 0's plans (every rank split alike: ``check_ranks``), each titled with its
    runner, then per runner and step the largest difference over the ranks, the ranks whose
    logits differ from their eager tensor-parallel model's, the captures and replays (the same
    on every rank, or the row fails) and whether the row passed."""
    from rich.console import Group
    from rich.table import Table

    import fxsplit
    from fxsplit.tools.dump import plan_table

    parts = [plan_table(plan) for plans in results[0]["split_plans"].values() for plan in plans]
    default = fxsplit.runners.default_runner("DeepseekV4ForCausalLM")
    title = f"DeepSeek-V4 decode, tensor parallel {world_size}, vs one process, all ranks"
    caption = f"{default}: DeepSeek-V4's default_runner"
    steps = Table(title=title, caption=caption, min_width=len(title))
    steps.add_column("runner")
    for column in ("step", "batch"):
        steps.add_column(column, justify="right")
    steps.add_column("max diff", justify="right")
    steps.add_column("ranks not equal to eager", justify="right")
    steps.add_column("captures per rank", justify="right")
    steps.add_column("replays per rank", justify="right")
    steps.add_column("ok")
    shown = None
    for row in _rows(results):
        runner = row["runner"]  # named on its first row only
        label = "" if runner == shown else runner
        shown = runner
        steps.add_row(
            label,
            str(row["step"]),
            str(row["batch"]),
            f"{max(r['diff'] for r in row['ranks']):.2g}",
            " ".join(str(k) for k, r in enumerate(row["ranks"]) if not r["exact"]) or "-",
            str(row["captures"]),
            str(row["replays"]),
            "yes" if row["ok"] else "NO",
        )
    parts.append(steps)
    return Group(*parts)
