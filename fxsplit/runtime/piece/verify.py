"""``verify=True``: each replay checked against the piece run uncaptured on snapshots of the
same inputs, through the same replay path.
"""

from __future__ import annotations

import logging

import torch

from fxsplit.runtime.memory.storage import clone_sharing
from fxsplit.runtime.piece.entry import Entry, flat

__all__ = ["VerifyError", "same", "verified_replay"]

log = logging.getLogger("fxsplit")


class VerifyError(RuntimeError):
    """``verify=True`` found a replay whose result differs from running the piece uncaptured."""


def verified_replay(piece, entry: Entry, inputs):
    # Snapshots of every input, sharing memory as the inputs do: the uncaptured re-run must
    # read what the replay read, writes through aliases included.
    snapshots = clone_sharing(inputs)
    written = [i for i, spec in enumerate(piece.specs) if spec.written]
    moved = [
        piece.specs[i].name
        for i, ptr in enumerate(entry.capture_ptrs)
        if ptr is not None and inputs[i].data_ptr() != ptr
    ]
    pool = piece.context.pool
    pool.before_replay(entry.order)
    if piece.random and piece.context.mode != "emulate":
        # A CUDA graph draws from its own RNG offsets: an uncaptured run cannot repeat them.
        if "verify-random" not in piece.warned:
            piece.warned.add("verify-random")
            log.info("fxsplit: verify skips %s: it draws random numbers", piece.name)
        entry.graph.replay()
        piece.stats.add(entry.counts, "replays")
        return piece.results(entry, inputs)
    before = torch.get_rng_state()
    entry.graph.replay()
    piece.stats.add(entry.counts, "replays")
    got = piece.results(entry, inputs)
    after = torch.get_rng_state()
    torch.set_rng_state(before)  # the emulator replays on the CPU generator: draw the same
    try:
        expected = piece.run_uncaptured(*snapshots)
    finally:
        torch.set_rng_state(after)
    pairs = [
        pair
        for j, pair in enumerate(zip(flat(got), flat(expected), strict=True))
        if j not in piece.unset
    ]
    pairs += [(inputs[i], snapshots[i]) for i in written]
    exact = piece.context.mode == "emulate"
    how = "" if exact else " beyond torch.testing.assert_close's tolerances"
    for a, b in pairs:
        if isinstance(a, torch.Tensor) and not same(a, b, exact):
            raise VerifyError(
                f"verify: replay of {piece.name} (regions: "
                f"{', '.join(sorted(piece.regions)) or '-'}) differs from running it "
                f"uncaptured{how}; inputs whose address changed since capture: "
                f"{', '.join(moved) or 'none'}"
            )
    return got


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Equal: bit for bit with NaN equal to NaN where ``exact`` (the emulator replays the same
    kernels), else within ``torch.testing.assert_close``'s default tolerances for the dtype (a
    CUDA graph may launch other cuBLAS algorithms or workspaces than an uncaptured run)."""
    if not exact:
        try:
            torch.testing.assert_close(a, b, equal_nan=True)
        except AssertionError:
            return False
        return True
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or not (a.is_floating_point() or a.is_complex()):
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(
        a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    )
