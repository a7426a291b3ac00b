"""Shared pytest configuration: hypothesis profiles for tests/test_property.py, the ``slow``
marker of the modules left out of the quick subset, the ``fresh_capture_state`` fixture, and the
teardown check that no test leaves fxsplit's pool memory in use (:func:`pytest_runtest_teardown`).

``HYPOTHESIS_PROFILE`` selects one: ``ci`` (default; 200 examples, derandomized so CI is
deterministic) or ``long`` (10,000 random examples, or ``HYPOTHESIS_MAX_EXAMPLES``, for a soak
run; two processes with different ``--hypothesis-seed`` values split it over two cores):
``HYPOTHESIS_PROFILE=long python3 -m pytest tests/test_property.py --hypothesis-show-statistics``.

hypothesis is optional here: a bare GPU box (torch, pytest, numpy) has none, and its test
modules then skip (``scripts/check_bare_env.sh`` checks that in CI).
"""

import gc
import os
import sys

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
    """``fresh_capture_state`` with the real ``gc.collect``: for tests/test_runtime_devices.py,
    whose captures on a device run the session's collection before capture as they do in use.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    import torch

    from fxsplit import counters

    torch._dynamo.reset()
    counters.reset()
    yield
    torch._dynamo.reset()
    counters.reset()


# -- the teardown check -------------------------------------------------------------------------
#
# After every test, nothing of the memory pools the test made may still be in use once its
# compiled models are gone (PyTorch's cudagraph-trees tests assert the same of their pools): no
# output handed out or lent still referenced while the sessions are open, and, after
# ``torch._dynamo.reset()``, no allocated block in an emulated pool and no dropped pool's memory
# still held. Memory still in use then was kept past the test: by fxsplit (a cache holding a
# reference: a leak for the rest of the process) or by the test (which says so with
# ``@pytest.mark.keeps_pool_memory(reason)``). See fxsplit/runtime/memory/live.py.

_collect = gc.collect  # fresh_capture_state stubs it out for the test's duration
_SINCE = pytest.StashKey[tuple]()  # the pool serial numbers when the test began
_RAISED = pytest.StashKey[bool]()


def _live():
    """fxsplit.runtime.memory.live, once fxsplit's runtime is imported (before that, no pool
    exists)."""
    if "fxsplit.runtime.memory.pool" not in sys.modules:
        return None
    from fxsplit.runtime.memory import live

    return live


def pytest_runtest_setup(item):
    """Remember which pools exist already: the check asks only about the test's own."""
    live = _live()
    item.stash[_SINCE] = live.serials() if live is not None else (0, 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Note a test that raised (failed, xfailed, errored in setup): its traceback holds its
    frames, and their locals the test's tensors, until the report is gone; nothing is checked."""
    report = yield
    if report.when in ("setup", "call") and (not report.passed or hasattr(report, "wasxfail")):
        item.stash[_RAISED] = True
    return report


def kept_pool_memory(since=(0, 0), kinds=("hand-out", "loan", "block", "outliving")) -> list:
    """What :func:`fxsplit.runtime.memory.live.live_memory` finds of ``kinds`` in the pools made
    after ``since``, once garbage is collected: a reference cycle (a module and its hooks)
    keeps what it holds until a collection, which is no leak. Collecting costs ~0.3 s with
    torch loaded, so a generation-1 collection comes first and a full one only when that left
    something."""
    from fxsplit.runtime.memory.live import live_memory

    found = [m for m in live_memory(since) if m.kind in kinds]
    for generation in (1, 2):
        if not found:
            break
        _collect(generation)
        found = [m for m in live_memory(since) if m.kind in kinds]
    return found


@pytest.fixture(autouse=True)
def _generator_capture_closed():
    """A test that makes a raw emulated capture fail and never completes another leaves the
    default generator capturing, as torch 2.11's CUDA does (fxsplit's runtime closes that state
    itself after every failed capture: tests/test_runtime_devices.py): close it for the next
    test."""
    yield
    if "fxsplit.runtime.emulation.emulator" in sys.modules:
        sys.modules["fxsplit.runtime.emulation.emulator"].close_capture_state()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The teardown check (see above): hand-outs and loans before the fixtures' teardown (their
    ``torch._dynamo.reset()`` moves any that is held to memory of its own), the pools' blocks
    after it (resetting Dynamo here too where a test left graphs compiled)."""
    live = _live()
    check = (
        live is not None
        and not item.stash.get(_RAISED, False)
        and item.get_closest_marker("keeps_pool_memory") is None
        and live.serials() != item.stash.get(_SINCE, (0, 0))
    )
    since = item.stash.get(_SINCE, (0, 0))
    handed = kept_pool_memory(since, ("hand-out", "loan")) if check else []
    result = yield
    if not check:
        return result
    blocks = [m for m in live.live_memory(since) if m.kind in ("block", "outliving")]
    if blocks:
        import torch

        torch._dynamo.reset()
        blocks = kept_pool_memory(since, ("block", "outliving"))
    if handed or blocks:
        pytest.fail(
            "fxsplit pool memory still in use after the test (kept past its end: a leak, or "
            "@pytest.mark.keeps_pool_memory(reason)):\n"
            + "\n".join(f"  {m}" for m in handed + blocks),
            pytrace=False,
        )
    return result
