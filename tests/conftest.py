"""Shared pytest configuration: hypothesis profiles for tests/test_property.py.

``HYPOTHESIS_PROFILE`` selects one: ``ci`` (default; 200 examples, derandomized so CI is
deterministic) or ``long`` (10,000 random examples, or ``HYPOTHESIS_MAX_EXAMPLES``, for a soak
run; two processes with different ``--hypothesis-seed`` values split it over two cores):
``HYPOTHESIS_PROFILE=long python3 -m pytest tests/test_property.py --hypothesis-show-statistics``.

hypothesis is optional here: a bare GPU box (torch, pytest, numpy) has none, and its test
modules then skip (``scripts/check_bare_env.sh`` checks that in CI).
"""

import os

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
