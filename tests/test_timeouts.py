"""The limits of tests that wait on another process grow with the setting and the load
(``tests/timeouts.py``), so a busy machine is never taken for a hung one."""

from __future__ import annotations

import os

import pytest

from tests import timeouts


def test_idle_machine_and_no_setting_keep_the_limit(monkeypatch):
    monkeypatch.delenv(timeouts.SCALE_VARIABLE, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert timeouts.scaled(120) == 120


def test_the_load_per_core_and_the_setting_multiply_it(monkeypatch):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * cores, 0.0, 0.0))
    monkeypatch.setenv(timeouts.SCALE_VARIABLE, "2.5")
    assert timeouts.scaled(120) == 120 * 4 * 2.5


@pytest.mark.parametrize("value", ["0", "-1", "fast", ""])
def test_a_setting_that_is_not_a_positive_number_is_named(monkeypatch, value):
    monkeypatch.setenv(timeouts.SCALE_VARIABLE, value)
    with pytest.raises(ValueError, match=f"FXSPLIT_TEST_TIMEOUT_SCALE={value!r}: expected a"):
        timeouts.scaled(1)
