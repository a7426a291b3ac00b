"""Process-wide counters of what every fxsplit backend did.

``fxsplit.counters.snapshot()`` returns a dict; ``fxsplit.counters.reset()`` zeroes it. Per-piece,
per-key figures live on each backend (``Backend.stats``).
"""

from __future__ import annotations

from collections import Counter

NAMES = (
    "graphs",
    "pieces",
    "captured_pieces",
    "eager_pieces",
    "captures",
    "replays",
    "uncaptured_runs",
    "input_copies",
    "input_copy_bytes",
    "recaptures",
    "pieces_compiled",
    "piece_cache_hits",
)

totals: Counter[str] = Counter()


def snapshot() -> dict[str, int]:
    """Every counter (all names in :data:`NAMES`, zeros included) as a plain dict."""
    return {name: totals[name] for name in NAMES}


def reset() -> None:
    """Zero every counter."""
    totals.clear()
