"""What the capture counters say, for tests of capture features: a test that shows numbers equal
eager proves nothing about capture unless its pieces replayed."""

from __future__ import annotations

import fxsplit
from fxsplit.runtime.piece.capture import NO_KERNEL


def replays(backend: fxsplit.Backend) -> dict[str, int]:
    """``{"<graph>/<piece>": replays summed over capture keys}`` for every captured piece of
    every graph ``backend`` compiled that launches a kernel (a piece of views and allocations
    only runs as its Python: it has nothing to replay)."""
    python = {
        f"{runtime.graph_id}/{piece.name}"
        for runtime in backend.runtimes
        for piece in runtime.pieces
        if piece.failed is NO_KERNEL
    }
    return {
        f"{graph}/{piece}": sum(counts.get("replays", 0) for counts in keys.values())
        for graph, pieces in backend.stats.items()
        for piece, keys in pieces.items()
        if f"{graph}/{piece}" not in python
    }


def assert_replayed(backend: fxsplit.Backend, at_least: int = 1) -> None:
    """Every captured piece of every graph of ``backend`` replayed ``at_least`` times.

    Raises:
        AssertionError: ``backend`` has no captured piece, or one replayed fewer times (the
            message lists each piece's replays).
    """
    counts = replays(backend)
    assert counts, "no captured piece"
    assert all(n >= at_least for n in counts.values()), f"replays per piece: {counts}"
