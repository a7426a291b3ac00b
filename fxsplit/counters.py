"""Process-wide counters of what every fxsplit backend did.

``fxsplit.counters.snapshot()`` returns a dict; ``fxsplit.counters.reset()`` zeroes it. Per-piece,
per-key figures live on each backend (``Backend.stats``). :data:`DEFINITIONS` says what each
counter counts, in the words docs/capture.md and the demo's legend use.
"""

from __future__ import annotations

from collections import Counter

DEFINITIONS = {
    "graphs": "graphs Dynamo handed to an fxsplit backend, each split once",
    "pieces": "pieces those graphs were split into, captured and eager",
    "captured_pieces": "pieces planned to be captured (capture off: run uncaptured)",
    "eager_pieces": "pieces planned to run eagerly, never captured",
    "captures": "runs of a captured piece that recorded its graph",
    "replays": "runs of a captured piece that replayed its recorded graph",
    "uncaptured_runs": "runs of a captured piece without a graph (warm-up, capture off)",
    "input_copies": "tensors copied into the buffers a recorded graph reads",
    "input_copy_bytes": "bytes those input copies moved",
    "recaptures": "graphs that dropped their recordings to record anew (weights moved)",
    "pieces_compiled": "distinct captured pieces Inductor compiled in this process",
    "piece_cache_hits": "distinct captured pieces loaded already compiled (memory, disk)",
}
"""One line per counter: what it counts. A recording is a CUDA graph, or the CPU emulator's
under ``capture="emulate"``; an uncaptured run is a warm-up run, a size or key seen first, a
refusal (counted per reason in ``Backend.stats``), or any run with capture off."""

NAMES = tuple(DEFINITIONS)

totals: Counter[str] = Counter()


def snapshot() -> dict[str, int]:
    """Every counter (all names in :data:`NAMES`, zeros included) as a plain dict."""
    return {name: totals[name] for name in NAMES}


def reset() -> None:
    """Zero every counter."""
    totals.clear()
