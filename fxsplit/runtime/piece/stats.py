"""Run-time figures per piece and capture key, mirrored into the process-wide counters, and the
keys they are kept under: a marked cache's address in a key (:class:`StaticAddress`), and the
entry key of a graph's further call in a step (:class:`Repeat`), counted under its capture key."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import NamedTuple

import torch

from fxsplit import counters


class PieceStats:
    """Counters of one piece: ``per_key[key]`` holds captures, replays, uncaptured_runs,
    input_copies, input_copy_bytes (bytes); ``copies_by_input[name]`` counts copies per input.
    Keys are capture keys (tuples); None collects runs outside capture (a step that may not
    capture). ``refusals[reason]`` counts calls that ran uncaptured for ``reason``; ``watch``
    (a :class:`fxsplit.runtime.piece.replay_watch.Watch`) hears of every capture key met for the
    first time."""

    __slots__ = ("copies_by_input", "per_key", "refusals", "watch")

    def __init__(self, watch=None):
        self.per_key: dict[object, Counter] = {}
        self.copies_by_input: Counter = Counter()
        self.refusals: Counter = Counter()
        self.watch = watch

    def key(self, key: object) -> Counter:
        """The counters of ``key`` (created on first use); those of a :class:`Repeat` key are
        its capture key's, added up over the calls of the graph in a step."""
        if type(key) is Repeat:
            key = key.key
        found = self.per_key.get(key)
        if found is None:
            found = self.per_key[key] = Counter()
            if self.watch is not None and key is not None:
                self.watch.new_key(key, self.per_key)
        return found

    @staticmethod
    def add(counts: Counter, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name`` in ``counts`` and to the process-wide total."""
        counts[name] += amount
        counters.totals[name] += amount

    def carry_over(self, old: PieceStats) -> None:
        """Start from ``old``'s figures (the piece it replaces, made anew when the state moved);
        the keys it met are not new to the watch."""
        self.per_key = old.per_key
        self.copies_by_input = old.copies_by_input
        self.refusals = old.refusals

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{str(key): {counter: value}}`` as plain dicts (``"uncaptured"`` for key None), and
        ``{"refused": {reason: calls}}`` when a call ran uncaptured for a reason. Keys read as
        :func:`key_text` writes them."""
        out = {
            ("uncaptured" if k is None else key_text(k)): dict(v) for k, v in self.per_key.items()
        }
        if self.refusals:
            out["refused"] = dict(self.refusals)
        return out


def key_text(key: tuple) -> str:
    """A capture key as text: ``"4, (4, 8), float 2.0, bool True"``: a size or a shape as is,
    a host value with its type (so ``1``, ``1.0`` and ``True`` stay three keys), any other
    object (a branch of ``torch.cond``, an opaque object) by its type and the order in which
    this process first showed one of that type (``"GraphModule #2"``): never by its address,
    which differs from run to run and which the allocator hands out again."""
    parts = []
    for part in key:
        if isinstance(part, StaticAddress):
            parts.append(f"static #{_address_ordinal(part)}")
        elif isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], type):
            cls, value = part
            shown = value if isinstance(value, _PLAIN) else f"#{_ordinal(value)}"
            parts.append(f"{cls.__name__} {shown}")
        else:
            parts.append(str(tuple(part)) if isinstance(part, tuple) else str(part))
    return ", ".join(parts)


_PLAIN = (int, float, bool, complex, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool)
# object -> its ordinal among the objects of its type shown so far (objects that cannot be
# weakly referenced are held by id with a strong reference, so the id stays theirs)
_ORDINALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HELD: dict[int, tuple[object, int]] = {}
_SHOWN: Counter = Counter()


class Repeat(NamedTuple):
    """The entry key of a piece's call in the ``call``-th call (from 1) of its graph within
    one step, a graph called again inside another graph's call: a graph of its own per call,
    so that the step's replays keep capture order from one step to the next instead of
    recapturing at each call (cudagraph trees record a node per whole call path; here only the
    call's place among its graph's calls tells calls apart). ``key`` is the call's capture key,
    under which it is counted."""

    call: int
    key: tuple


class StaticAddress(int):
    """The address of a marked cache in a capture key (a graph per cache), shown as
    ``static #<n>``: the n-th distinct address this process showed, never the address."""

    __slots__ = ()


_ADDRESSES: dict[int, int] = {}


def _address_ordinal(address: int) -> int:
    return _ADDRESSES.setdefault(int(address), len(_ADDRESSES) + 1)


def _ordinal(value: object) -> int:
    try:
        found = _ORDINALS.get(value)
    except TypeError:  # unhashable, or no weak reference to it
        held = _HELD.get(id(value))
        found = held[1] if held is not None else None
    if found is None:
        _SHOWN[type(value)] += 1
        found = _SHOWN[type(value)]
        try:
            _ORDINALS[value] = found
        except TypeError:
            _HELD[id(value)] = (value, found)
    return found
