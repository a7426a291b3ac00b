"""A CPU user who leaves ``capture`` at "auto" is told, once, that nothing is captured and what
runs the CPU emulator (:mod:`fxsplit.capture_off`): a log line, not a warning (fxsplit's
warnings are errors here)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxsplit
from fxsplit import capture_off, counters
from tests.timeouts import scaled

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def untold(monkeypatch):
    """The process has not said it yet (the line comes once per process)."""
    monkeypatch.setattr(capture_off, "_told", False)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "capture is off" in r.getMessage()]


def _run(backend, n: int = 3) -> None:
    model = torch.compile(lambda x: x.sin() * 2, backend=backend)
    with torch.no_grad():
        for _ in range(n):
            model(torch.randn(4))


def test_the_line_names_the_reason_and_the_emulator():
    assert capture_off.message("torch sees no CUDA or ROCm device") == (
        "fxsplit: capture is off (torch sees no CUDA or ROCm device): capture='auto' captures "
        "CUDA graphs only on a CUDA or ROCm device, so nothing is captured or replayed; "
        "capture='emulate' runs the CPU capture emulator (CUDA-graph semantics on the CPU)"
    )


def test_auto_on_cpu_tensors_logs_one_line_for_the_first_graph_only(untold, caplog):
    why = capture_off.reason("auto", None)
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        _run(fxsplit.Backend(eager_regions=[]))
        _run(fxsplit.Backend(eager_regions=[]))  # another backend, another graph: said already
    assert _lines(caplog) == [capture_off.message(why)]
    assert counters.snapshot()["captures"] == counters.snapshot()["replays"] == 0


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_a_chosen_capture_logs_nothing(untold, caplog, capture):
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        _run(fxsplit.Backend(capture=capture, eager_regions=[]))
    assert _lines(caplog) == []


def test_explain_says_it_for_the_options_it_was_given(untold, caplog):
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        fxsplit.explain(lambda x: x.sin(), torch.randn(4), capture="emulate", eager_regions=[])
        assert _lines(caplog) == []
        fxsplit.explain(lambda x: x.cos(), torch.randn(4), eager_regions=[])
    assert len(_lines(caplog)) == 1


def test_explain_checks_the_capture_it_turns_off():
    with pytest.raises(ValueError, match="did you mean 'emulate'"):
        fxsplit.explain(lambda x: x.sin(), torch.randn(4), capture="emulated")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cpu_user_of_the_string_backend_sees_the_line_once_on_stderr():
    """No logging set up, as in a user's script: Python prints the warning-level line."""
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: x.sin(), backend='fxsplit')\n"
        "g = torch.compile(lambda x: x.cos(), backend='fxsplit')\n"
        "with torch.no_grad():\n"
        "    for _ in range(3):\n"
        "        f(torch.randn(4)), g(torch.randn(4))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=scaled(120),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "capture is off" in line]
    assert said == [capture_off.message("torch sees no CUDA or ROCm device")], done.stderr


class _TwoCaptured(torch.nn.Module):
    """Two captured pieces around one eager region."""

    def forward(self, x):
        h = x.sin()
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return h.cos()


@pytest.mark.parametrize("capture", ["off", "auto"])
def test_with_capture_off_every_captured_piece_counts_as_an_uncaptured_run(untold, capture):
    """Four calls of a graph planned with two captured pieces: 8 uncaptured runs, no capture or
    replay (the counters showed captured pieces that seemed never to run)."""
    if capture == "auto" and torch.cuda.is_available():
        pytest.skip("capture='auto' captures on a machine with CUDA")
    backend = fxsplit.Backend(capture=capture, input_binding="copy")
    model = torch.compile(_TwoCaptured(), backend=backend)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            assert torch.equal(model(x), _TwoCaptured()(x))
    (plan,) = backend.plans
    assert len(plan.captured) == 2
    snapshot = counters.snapshot()
    assert snapshot["captured_pieces"] == 2
    assert (snapshot["captures"], snapshot["replays"], snapshot["uncaptured_runs"]) == (0, 0, 8)


def test_with_capture_off_a_graph_of_eager_pieces_only_counts_no_run():
    backend = fxsplit.Backend(capture="off", eager_modules=["*"], input_binding="copy")
    model = torch.compile(torch.nn.Linear(4, 4), backend=backend)
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert backend.plans[0].captured == []
    assert counters.snapshot()["uncaptured_runs"] == 0
