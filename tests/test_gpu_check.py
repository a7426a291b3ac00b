"""The GPU check's logic, on CPU: the teardown order of ``scripts/tp_nccl_check.py``, the time
budget of ``bench/decode_latency.py``, and the time limits, plan and summary of
``scripts/gpu_check.sh`` (run by ``bash``, its parts stopped at their limits)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import unittest
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import fxsplit
from fxsplit.tools.tp_demo import free_port
from tests.timeouts import scaled

try:
    import expecttest
except ImportError:  # a bare GPU box: the golden plans below skip
    expecttest = None

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("fresh_capture_state")


def _load(path: str):
    """A script of the repository imported as a module (scripts/ and bench/ are no packages)."""
    name = f"_script_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
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


# ---------------------------------------------------------------------------------------------
# bench/decode_latency.py: the time budget


@pytest.fixture(scope="module")
def latency():
    return _load("bench/decode_latency.py")


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_budget_counts_from_the_process_start_cuts_the_last_part_and_keeps_the_reserve(latency):
    clock = Clock(30.0)  # 30 s of imports before the first part
    budget = latency.Budget(part_timeout=60, total=160, start=0.0, clock=clock)
    assert budget.limit() == 60
    clock.now = 100.0
    assert budget.limit() == 50  # 160 - 10 kept for the table and JSON - 100
    clock.now = 144.0
    assert budget.limit() == 6
    clock.now = 146.0
    assert budget.limit() is None  # under 5 s left: the part does not start
    short = latency.Budget(part_timeout=2, total=160, start=0.0, clock=clock)
    assert short.limit() == 2  # 4 s left are enough for a 2 s part
    clock.now = 148.5
    assert short.limit() is None  # 1.5 s left: under its 2 s
    assert latency.Budget(part_timeout=60, clock=clock).limit() == 60  # no budget


def test_run_parts_reports_every_part_a_timeout_spares_later_batches_a_failure_does_not(latency):
    """A cold compile over its limit does not cost the variant its later batches; a failure
    does (it would repeat); the budget's end skips the rest; every part is accounted for."""
    clock = Clock(5.0)
    budget = latency.Budget(part_timeout=60, total=160, start=0.0, clock=clock)
    parts = latency.plan(
        ["eager", "fxsplit_inductor", "fxsplit_eager", "cuda_graph"], [32, 1, 8], "cuda"
    )
    calls = []

    def run_part(name, batch, seconds):
        calls.append((name, batch, seconds))
        if name == "fxsplit_eager":
            clock.now += 2
            raise RuntimeError("capture refused\nsecond line")
        if (name, batch) in (("fxsplit_inductor", 1), ("cuda_graph", 8)):
            clock.now += seconds
            if name == "cuda_graph":  # a library that wraps it keeps it as the cause
                raise RuntimeError("backend compiler failed") from latency.PartTimeout()
            raise latency.PartTimeout
        clock.now += 10
        return float(batch)

    ms, notes = latency.run_parts(parts, budget, run_part)
    assert calls == [
        ("eager", 1, 60),
        ("fxsplit_inductor", 1, 60),
        ("fxsplit_eager", 1, 60),
        ("cuda_graph", 1, 60),
        ("eager", 8, 60),
        ("fxsplit_inductor", 8, 53),  # cut to what is left before the last 10 s
        ("cuda_graph", 8, 43),
    ]
    assert ms == {
        "eager": {1: 1.0, 8: 8.0, 32: None},
        "fxsplit_inductor": {1: None, 8: 8.0, 32: None},
        "fxsplit_eager": {1: None, 8: None, 32: None},
        "cuda_graph": {1: 1.0, 8: None, 32: None},
    }
    assert notes == [
        "fxsplit_inductor batch 1: ran over its 60 s limit",
        "fxsplit_eager batch 1 failed: RuntimeError: capture refused",
        "fxsplit_eager batch 8: skipped (after batch 1 failed)",
        "cuda_graph batch 8: ran over its 43 s limit",
        "eager batch 32: skipped (over the 160 s budget at 150 s)",
        "fxsplit_inductor batch 32: skipped (over the 160 s budget at 150 s)",
        "fxsplit_eager batch 32: skipped (after batch 1 failed)",
        "cuda_graph batch 32: skipped (over the 160 s budget at 150 s)",
    ]


def test_a_stop_signal_ends_the_run_with_the_rest_reported(latency):
    clock = Clock()
    parts = latency.plan(["eager", "fxsplit_eager"], [1, 8], "cpu")

    def run_part(name, batch, seconds):
        clock.now += 7
        if batch == 8:
            raise KeyboardInterrupt  # SIGINT, or SIGTERM as main() turns it
        return 1.0

    budget = latency.Budget(part_timeout=60, total=100, start=0.0, clock=clock)
    ms, notes = latency.run_parts(parts, budget, run_part)
    assert ms == {"eager": {1: 1.0, 8: None}, "fxsplit_eager": {1: 1.0, 8: None}}
    assert notes == [
        "eager batch 8: not measured (the run stopped by SIGINT or SIGTERM at 21 s)",
        "fxsplit_eager batch 8: not measured (the run stopped by SIGINT or SIGTERM at 21 s)",
    ]


def test_a_part_over_its_limit_is_stopped_inside_fxsplit_and_dynamo_not_swallowed(
    latency, monkeypatch
):
    """The real SIGALRM handler, the signal sent while fxsplit's backend splits the graph that
    Dynamo hands it: the timeout must reach the bench through Dynamo and fxsplit (which treat
    their own errors as a reason to run uncaptured), and the variant's next batch is still
    tried. The signal is raised at that point rather than by a short timer: a timer lands
    anywhere, inside an import or a finaliser called from C++, where an exception aborts."""
    import signal

    import fxsplit.backend

    split = fxsplit.backend.split

    def split_then_alarm(*args, **kwargs):
        signal.raise_signal(signal.SIGALRM)
        return split(*args, **kwargs)

    monkeypatch.setattr(fxsplit.backend, "split", split_then_alarm)
    budget = latency.Budget(part_timeout=120)
    result = latency.measure("cpu", [1, 2], 2, 1, budget, ("fxsplit_eager",))
    assert result["ms_per_step"] == {"fxsplit_eager": {1: None, 2: None}}
    assert result["skipped"] == [
        "fxsplit_eager batch 1: ran over its 120 s limit",
        "fxsplit_eager batch 2: ran over its 120 s limit",
    ]


def test_the_alarm_waits_for_an_import_to_finish(latency, tmp_path, monkeypatch):
    """An import interrupted half-way leaves its module broken for every later part: the alarm
    that arrives inside one is taken after it, at the next check (0.1 s)."""
    import importlib
    import time

    (tmp_path / "alarmed_module.py").write_text(
        "import signal\nsignal.raise_signal(signal.SIGALRM)\nFINISHED = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "alarmed_module", raising=False)
    with pytest.raises(latency.PartTimeout), latency._time_limit(60):
        module = importlib.import_module("alarmed_module")
        deadline = time.monotonic() + scaled(5)  # the check comes within 0.1 s when idle
        while time.monotonic() < deadline:
            time.sleep(0.01)
    assert module.FINISHED


@pytest.mark.skipif(expecttest is None, reason="needs expecttest")
class DryRunPlans(expecttest.TestCase if expecttest else unittest.TestCase):
    """The worst-case plans ``--dry-run`` prints (regenerate: EXPECTTEST_ACCEPT=1)."""

    def test_the_gpu_checks_latency_part(self):
        latency = _load("bench/decode_latency.py")
        variants = ["eager", "fxsplit_inductor", "cuda_graph", "fxsplit_eager", "reduce_overhead"]
        parts = latency.plan(variants, [1, 8, 32], "cuda")
        budget = latency.Budget(part_timeout=60, total=160, start=0.0, clock=Clock(4.0))
        lines, fits = latency.dry_run(parts, budget)
        assert fits
        self.assertExpectedInline(
            "\n".join(lines),
            """\
15 parts, at most 60 s each; budget 160 s from the process start
(the last 10 s kept for the table and JSON)
worst case, every part running to its limit, from 4 s (the time so far):
      4 -  64 s  eager batch 1
     64 - 124 s  fxsplit_inductor batch 1
    124 - 150 s  cuda_graph batch 1
  not started: fxsplit_eager batch 1, reduce_overhead batch 1, eager batch 8, fxsplit_inductor
    batch 8, cuda_graph batch 8, fxsplit_eager batch 8, reduce_overhead batch 8, eager batch 32,
    fxsplit_inductor batch 32, cuda_graph batch 32, fxsplit_eager batch 32, reduce_overhead
    batch 32
parts end by 150 s, the table and JSON by 160 s <= 160 s: fits""",
        )

    def test_no_budget_and_a_budget_the_imports_used_up(self):
        latency = _load("bench/decode_latency.py")
        parts = latency.plan(["eager", "cuda_graph"], [2, 1], "cpu")
        none = latency.Budget(part_timeout=30, start=0.0, clock=Clock(3.0))
        lines, fits = latency.dry_run(parts, none)
        assert fits
        self.assertExpectedInline(
            "\n".join(lines),
            """\
2 parts, at most 30 s each, no budget
worst case, every part running to its limit, from 3 s (the time so far):
      3 -  33 s  eager batch 1
     33 -  63 s  eager batch 2
parts end by 63 s""",
        )
        used_up = latency.Budget(part_timeout=30, total=12, start=0.0, clock=Clock(3.0))
        lines, fits = latency.dry_run(parts, used_up)
        assert not fits
        self.assertExpectedInline(
            "\n".join(lines),
            """\
2 parts, at most 30 s each; budget 12 s from the process start
(the last 10 s kept for the table and JSON)
worst case, every part running to its limit, from 3 s (the time so far):
  not started: eager batch 1, eager batch 2
parts end by 3 s, the table and JSON by 13 s > 12 s: OVER the budget""",
        )


# ---------------------------------------------------------------------------------------------
# scripts/timed_part.sh and scripts/gpu_check.sh


def _bash(*args, cwd=ROOT, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=scaled(120),
        **kwargs,
    )


def _sigint_blocked() -> None:
    """In the child before it runs bash: SIGINT held pending (the mask passes through bash,
    ``timeout`` and exec) until the command unblocks it, so when the limit's SIGINT lands does
    not depend on how fast a busy machine starts the command."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def test_a_part_stopped_at_its_limit_keeps_pytests_failure_summary(tmp_path):
    """The SIGINT at the limit reaches pytest inside test_hangs, after test_fails failed, on an
    idle machine or a busy one (SIGINT stays pending until test_hangs unblocks it)."""
    # _signal's own function: the pending SIGINT then interrupts test_hangs itself, not the
    # Python wrapper in signal.py
    (tmp_path / "test_slow.py").write_text(
        "import _signal, signal, time\n"
        "def test_fails(): assert 1 == 2\n"
        "def test_hangs(): _signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
        "time.sleep(600)\n"
        "def test_never_reached(): pass\n"
    )
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    script = ROOT / "scripts/timed_part.sh"
    # A grace longer than any start-up: only a command deaf to SIGINT meets the SIGKILL.
    done = _bash(
        script,
        "tests",
        3,
        int(scaled(120)),
        tmp_path,
        *pytest_run,
        "test_slow.py",
        cwd=tmp_path,
        preexec_fn=_sigint_blocked,
    )
    log = (tmp_path / "tests.log").read_text()
    assert done.returncode == 124, log
    assert "short test summary info" in log and "FAILED test_slow.py::test_fails" in log
    assert "test_slow.py:3: KeyboardInterrupt" in log  # where it hung
    assert log.rstrip().endswith("tests: stopped at its 3 s limit")
    status, _ = (tmp_path / "tests.status").read_text().split()
    assert status == "124"  # SIGINT ended it: the SIGKILL after the grace gives 137
    assert log in done.stdout  # also shown as it came


def test_a_part_deaf_to_sigint_is_killed_after_its_grace(tmp_path):
    """Deaf from its first instruction: SIGINT is blocked before the command starts (and
    ignored once it runs), so the SIGKILL after the grace is what ends it, however slow the
    start."""
    deaf = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"
    script = ROOT / "scripts/timed_part.sh"
    done = _bash(
        script, "deaf", 1, 1, tmp_path, sys.executable, "-c", deaf, preexec_fn=_sigint_blocked
    )
    assert done.returncode == 137
    assert (tmp_path / "deaf.status").read_text().split()[0] == "137"


def test_a_sigterm_as_soon_as_the_log_exists_stops_the_part_and_leaves_its_status(tmp_path):
    """The moment a caller sees the log is the moment it may stop the part (gpu_check.sh's
    stop test does): the script must already stop its command and write the status then. It
    did not, in 28 of 40 tries: its trap came after the log, so SIGTERM killed the script
    alone, the command ran on and the summary said the part was "not run"."""
    for attempt in range(20):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        part = subprocess.Popen(
            ["bash", ROOT / "scripts/timed_part.sh", "t", "60", "5", folder, "sleep", "30"],
            stdout=subprocess.DEVNULL,
        )
        while not (folder / "t.log").exists():
            time.sleep(0.001)
        part.send_signal(signal.SIGTERM)
        assert part.wait(timeout=scaled(30)) != 0
        assert (folder / "t.status").exists(), f"attempt {attempt}: no status file"


@pytest.mark.skipif(expecttest is None, reason="needs expecttest")
class GpuCheckPlan(expecttest.TestCase if expecttest else unittest.TestCase):
    def test_the_time_plan_adds_up_to_at_most_8_minutes(self):
        done = _bash(
            "scripts/gpu_check.sh", "--dry-run", env={**os.environ, "PYTHON": sys.executable}
        )
        assert done.returncode == 0, done.stdout + done.stderr
        table, decode_plan = done.stdout.split("bench/decode.py, worst case:\n")
        self.assertExpectedInline(
            table,
            """\
part      limit grace
device       20    10
tests       110    10  each test at most 60 s where pytest-timeout is installed
decode      150    10  bench/decode.py --budget 140
demo         70    10
tp_nccl      50    10
summary      10
in all: 460 s <= 480 s: fits
""",
        )
        assert decode_plan.rstrip().endswith("<= 140 s: fits")


def test_a_stopped_gpu_check_stops_its_part_and_still_prints_the_summary(tmp_path):
    """On CPU (the parts needing a GPU skip): SIGTERM while the tests part runs stops that part
    as its limit would and the summary follows; the parts after it do not run."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    check = subprocess.Popen(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    folder = tmp_path / "gpu_check"
    # Waits for the tests part to start however long the device part takes (its own limit
    # bounds that); only a hang meets this limit.
    deadline = time.monotonic() + scaled(120)
    while not (folder / "tests.log").exists():
        assert time.monotonic() < deadline, "the tests part never started"
        time.sleep(0.1)
    check.send_signal(signal.SIGTERM)
    out, _ = check.communicate(timeout=scaled(60))
    assert check.returncode == 143
    summary = (folder / "summary.txt").read_text()
    assert summary in out
    rows = [line.split()[0] for line in summary.splitlines()[1:]]
    assert rows[:2] == ["device", "tests"] and "tp" in rows and "decode" in rows
    assert "tp nccl  not run" in summary and "decode   not run" in summary
    # the device part imports torch under a 30 s limit, which a busy machine may reach
    assert "device   exit " in summary and "tests    exit " in summary
