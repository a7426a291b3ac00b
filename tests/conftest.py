"""Shared pytest configuration: hypothesis profiles for tests/test_property.py, the ``slow``
marker of the modules left out of the quick subset, and the ``fresh_capture_state`` fixture.

``HYPOTHESIS_PROFILE`` selects one: ``ci`` (default; 200 examples, derandomized so CI is
deterministic) or ``long`` (10,000 random examples, or ``HYPOTHESIS_MAX_EXAMPLES``, for a soak
run; two processes with different ``--hypothesis-seed`` values split it over two cores):
``HYPOTHESIS_PROFILE=long python3 -m pytest tests/test_property.py --hypothesis-show-statistics``.

hypothesis is optional here: a bare GPU box (torch, pytest, numpy) has none, and its test
modules then skip (``scripts/check_bare_env.sh`` checks that in CI).
"""

import gc
import os

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:
    settings = None

if settings is not None:
    _COMMON = {
        "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
        "print_blob": True,
    }
    settings.register_profile("ci", max_examples=200, derandomize=True, **_COMMON)
    settings.register_profile(
        "long", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 10_000)), **_COMMON
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Modules that take most of the suite's time (the whole suite, under load average 7 on 2 cores,
# 2026-12-01: 35 min; these ~29 of them): marked slow, so ``python3 -m pytest -m "not slow"``
# runs the rest in a few minutes. A single slow test elsewhere carries @pytest.mark.slow.
SLOW_MODULES = frozenset(
    {
        "test_demo",  # the demo itself, at 80 columns
        "test_distributed",  # two spawned gloo ranks
        "test_hf_architectures",  # the transformers sweep and its coverage table
        "test_hf_deepseek_v4",
        "test_hf_generate",
        "test_hf_zoo",
        "test_inductor",  # Inductor compiles (minutes where its cache folder is empty)
        "test_piece_cache",
        "test_precompile",  # save and load in fresh processes
        "test_property",  # hypothesis: 200 random programs per property
        "test_step_sizes_property",
    }
)


def pytest_collection_modifyitems(config, items):
    """Mark every test of :data:`SLOW_MODULES` ``slow``."""
    for item in items:
        if item.path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Load this profile again after each test module is imported: importing
    ``torch.testing._internal`` (tests/test_opinfo.py) loads PyTorch's own profile (10 random
    examples), and ``@given`` takes the profile loaded when its module is imported."""
    report = yield
    if settings is not None:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
    return report


@pytest.fixture
def fresh_capture_state(monkeypatch):
    """Dynamo's caches and fxsplit's counters cleared before and after the test, and
    ``gc.collect`` stubbed out: a capture session collects garbage once (~0.3 s with torch
    loaded), which changes nothing an emulated capture computes. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("fresh_capture_state")``."""
    import torch

    from fxsplit import counters

    torch._dynamo.reset()
    counters.reset()
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)
    yield
    torch._dynamo.reset()
    counters.reset()


@pytest.fixture
def fresh_dynamo():
    """``fresh_capture_state`` with the real ``gc.collect``: for tests/test_runtime_cuda.py,
    whose captures on a device run the session's collection before capture as they do in use.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    import torch

    from fxsplit import counters

    torch._dynamo.reset()
    counters.reset()
    yield
    torch._dynamo.reset()
    counters.reset()
