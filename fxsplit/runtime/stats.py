"""Run-time figures per piece and capture key, mirrored into the process-wide counters."""

from __future__ import annotations

from collections import Counter

from fxsplit import counters


class PieceStats:
    """Counters of one piece: ``per_key[key_str]`` holds captures, replays, uncaptured_runs,
    input_copies, input_copy_bytes; ``copies_by_input[name]`` counts copies per input."""

    __slots__ = ("copies_by_input", "per_key")

    def __init__(self):
        self.per_key: dict[str, Counter] = {}
        self.copies_by_input: Counter = Counter()

    def key(self, key: object) -> Counter:
        """The counters of ``key`` (created on first use)."""
        text = str(key)
        found = self.per_key.get(text)
        if found is None:
            found = self.per_key[text] = Counter()
        return found

    def add(self, key: object, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name`` of ``key`` and to the process-wide total."""
        self.key(key)[name] += amount
        counters.totals[name] += amount

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{key: {counter: value}}`` as plain dicts."""
        return {k: dict(v) for k, v in self.per_key.items()}
