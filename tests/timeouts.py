"""Time limits of the tests that wait on another process, from one setting.

Such a limit only catches a hang: it must never fail a test that is merely slow because the
machine is busy. :func:`scaled` multiplies a limit (chosen for an idle 2-core machine) by
``FXSPLIT_TEST_TIMEOUT_SCALE`` (default 1) and by the load per core when that is above 1 (the
1-minute load average over the cores this process may use), measured when the limit is taken.
A machine shared with 6 CPU-bound jobs on 2 cores (load about 4 per core) thus gets 4 times
the idle limits without any setting.
"""

from __future__ import annotations

import os

SCALE_VARIABLE = "FXSPLIT_TEST_TIMEOUT_SCALE"


def scale() -> float:
    """The factor :func:`scaled` applies now.

    Raises:
        ValueError: ``FXSPLIT_TEST_TIMEOUT_SCALE`` is not a positive number.
    """
    raw = os.environ.get(SCALE_VARIABLE, "1")
    try:
        setting = float(raw)
    except ValueError:
        setting = 0.0
    if not setting > 0:
        raise ValueError(f"{SCALE_VARIABLE}={raw!r}: expected a positive number, such as 1 or 4")
    return setting * max(1.0, _load_per_core())


def scaled(seconds: float) -> float:
    """``seconds`` (a limit for an idle 2-core machine) times :func:`scale`."""
    return seconds * scale()


def _load_per_core() -> float:
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return load / max(1, cores or 1)
