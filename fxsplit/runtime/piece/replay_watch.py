"""Replay watch: say when a graph's captured pieces never replay, or recapture step after step
to keep the pool's capture order, and sum up what they did.

A captured piece replays only when a capture key repeats (:mod:`fxsplit.runtime.inputs.binding`).
When a
size or host value in the key changes on every call, each call captures a new graph (or runs
uncaptured once the key limit is reached): numbers stay right and nothing replays. The split runs
the sizes it can tell change every step eagerly (:mod:`fxsplit.passes.step_sizes`); this module
catches the rest at run time: a piece that met :data:`NEW_KEYS` capture keys without one replay
warns once per graph, naming the piece, what changed every call (in the model's terms where
Dynamo traced it to a source) and what to do.

A piece recaptured to keep capture order (:mod:`fxsplit.runtime.memory.pool`) in
:data:`REORDERS` of the last :data:`REORDER_STEPS` steps warns as well: graphs
of one backend called in an order that changes from step to step (inside another graph's call)
recapture at every step, and nothing but a pool of their own stops it (once per backend: the
cause is the order of its graphs).

Fed by :class:`fxsplit.runtime.piece.stats.PieceStats` when a piece first meets a capture key,
and by the piece's recapture, so the replay path costs nothing. :func:`summary` renders one
line per graph for the log (``TORCH_LOGS=fxsplit``) and the dump's report.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping

import torch

from fxsplit.facts.symbols import describe, symbols
from fxsplit.warn import FxsplitRuntimeWarning, warn_at_caller

log = logging.getLogger("fxsplit")

NEW_KEYS = 8
"""Capture keys a piece meets without a replay before the watch warns."""

REORDERS, REORDER_STEPS = 4, 10
"""Steps with a recapture for capture order, among the last steps, before the watch warns."""

_WARNED: weakref.WeakSet = weakref.WeakSet()  # graph contexts that warned already
_WARNED_ORDER: weakref.WeakSet = weakref.WeakSet()  # sessions warned of capture order


class Watch:
    """The replay watch of one captured piece.

    Args:
        piece: the :class:`~fxsplit.runtime.piece.captured.CapturedPiece` (its ``name``, ``specs``
            and ``runtime`` are read only when it warns).
        reads: what its capture key reads, one ``(input index, dim or None)`` per key part
            (:func:`fxsplit.runtime.inputs.binding.key_reads`).
    """

    __slots__ = ("piece", "reads", "reordered_at", "up_front")

    def __init__(self, piece, reads) -> None:
        self.piece = piece
        self.reads = tuple(reads)
        self.up_front: set = set()  # keys met under Backend.capture: captured to be replayed
        self.reordered_at: list[int] = []  # the recent steps that recaptured for capture order

    def reordered(self) -> None:
        """Called when the piece recaptures to keep capture order; warns once per backend
        where it did in :data:`REORDERS` of the last :data:`REORDER_STEPS` steps."""
        context = self.piece.context
        step = context.session.step
        recent = [s for s in self.reordered_at if s > step - REORDER_STEPS and s != step]
        self.reordered_at = recent = [*recent, step]
        if len(recent) < REORDERS or context.session in _WARNED_ORDER:
            return
        _WARNED_ORDER.add(context.session)
        message = (
            f"fxsplit {context.graph_id}: {self.piece.name} was recaptured in {len(recent)} of "
            f"the last {REORDER_STEPS} steps to keep the capture order of its memory pool: its "
            "graph replays after graphs captured later than it, in an order that changes from "
            "step to step (models of one backend called inside another's call in a changing "
            "order), so every such step captures again. Compile the models called in a "
            "changing order with an fxsplit.Backend each (a pool of their own)."
        )
        log.info("%s", message)
        warn_at_caller(message, FxsplitRuntimeWarning)

    def new_key(self, key: tuple, per_key: Mapping) -> None:
        """Called when the piece meets capture key ``key`` for the first time; ``per_key`` holds
        the piece's counters per key (``None``: runs outside capture). Keys met while
        ``Backend.capture`` captures sizes up front do not count, nor, under ``capture_sizes``,
        keys that differ only in the token count (a warm-up of each size: bounded by the
        sizes, each replayed later)."""
        context = self.piece.context
        if context.session.up_front:
            self.up_front.add(key)
            return
        keys = [k for k in per_key if k is not None and k not in self.up_front]
        if len(keys) < NEW_KEYS:
            return
        if context in _WARNED or any(c["replays"] for c in per_key.values()):
            return
        keys = keys[-NEW_KEYS:]
        changes = self._changes(keys)
        if context.capture_sizes is not None and changes and all(t for _, _, t in changes):
            return
        _WARNED.add(context)
        message = self.message(keys, changes)
        log.info("%s", message)
        warn_at_caller(message, FxsplitRuntimeWarning)

    def _changes(self, keys: list[tuple]) -> list[tuple[int, str, bool]]:
        """``(key part, what it reads, whether that is the token count)`` for each part that
        differs between ``keys``."""
        return [
            (j, *self._label(*self.reads[j]))
            for j in range(len(self.reads))
            if len({k[j] for k in keys}) > 1
        ]

    def message(self, keys: list[tuple], changes: list[tuple[int, str, bool]]) -> str:
        """The warning for a piece whose last ``keys`` never repeated; ``changes`` from
        :meth:`_changes`."""
        piece = self.piece
        context = piece.context
        parts = []
        for j, what, _ in changes:
            values = ", ".join(_shown(k[j]) for k in keys[:3])
            parts.append(f"{what} ({values}, ..., {_shown(keys[-1][j])})")
        tokens = all(t for _, _, t in changes)
        what = " and ".join(parts) if parts else "its capture key"
        return (
            f"fxsplit {context.graph_id}: {piece.name} met {len(keys)} new capture keys in a row "
            f"and replayed none: {what} changed every time, so every call captures a graph or "
            f"runs uncaptured. To replay, "
            f"{self._advice(keys[-1], [j for j, _, _ in changes], bool(parts) and tokens)}."
        )

    def _advice(self, key: tuple, changed: list[int], tokens: bool) -> str:
        """What to do about the parts ``changed`` of capture keys like ``key`` (``tokens``:
        they are all the token count)."""
        if tokens:
            return (
                "pad the token count to a few sizes and pass them as capture_sizes, so each "
                "size is captured once and replayed after"
            )
        if any(_host_float(key[j]) for j in changed):
            return (
                "pass the float as a 0-dim tensor: a captured graph bakes a host float into its "
                "kernels, so each value needs a capture of its own"
            )
        advice = (
            "run the work that reads it eagerly (fxsplit.region, eager_modules, "
            "splitting_ops) or keep it fixed (persistent buffers of a fixed size, such as "
            "transformers' StaticCache)"
        )
        steps = self.piece.context.split.steps
        if steps is not None and steps.every_size:
            advice += (
                ", or compile without dynamic=True so that fxsplit sees it change and runs "
                "that work eagerly itself"
            )
        return advice

    def _label(self, i: int, dim: int | None) -> tuple[str, bool]:
        """(what key part ``(i, dim)`` reads, in the model's terms; whether it is the token
        count)."""
        piece = self.piece
        spec = piece.specs[i]
        split = piece.context.split
        steps = split.steps
        node = next((n for n in split.graph_module.graph.nodes if n.name == spec.name), None)
        value = node.meta.get("example_value") if node is not None else None
        if dim is not None and isinstance(value, torch.Tensor):
            value = value.shape[dim] if dim >= 0 else value.shape
        found = symbols(value) if steps is not None else set()
        names = sorted({steps.names[s] for s in found if s in steps.names}) if found else []
        if names:
            token = all(s in steps.tokens for s in found)
            prefix = "the token count " if token else ""
            return prefix + " and ".join(names), token
        where = describe(spec.source)
        if dim is None:
            return f"host value {where}", False
        return f"{where}.size({dim})" if dim >= 0 else f"the shape of {where}", False


def _host_float(part: object) -> bool:
    """Whether a capture key part is a host float (kept as ``(float, value)``)."""
    return isinstance(part, tuple) and len(part) == 2 and part[0] is float


def _shown(part: object) -> str:
    """A key part as the user wrote it: host values are kept as ``(class, value)``."""
    if _host_float(part):
        return f"{part[1]:.6g}"
    if isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], type):
        return str(part[1])
    return str(part)


def summary(graph_id: str, stats: Mapping) -> str | None:
    """One line summing up a graph's captured pieces: calls, captures, replays (share of calls)
    and uncaptured runs; None when no captured piece ran.

    Args:
        graph_id: the graph's name, e.g. ``"graph_2"``.
        stats: piece -> capture key -> counters (:meth:`fxsplit.Backend.stats` of one graph, or
            a dump's ``runtime.json`` pieces).
    """
    totals = dict.fromkeys(("captures", "replays", "uncaptured_runs"), 0)
    for keys in stats.values():
        for counts in keys.values():
            for name in totals:
                totals[name] += counts.get(name, 0)
    calls = sum(totals.values())
    if not calls:
        return None
    share = 100 * totals["replays"] / calls
    return (
        f"fxsplit {graph_id}: {_count(len(stats), 'captured piece')}, {_count(calls, 'call')}: "
        f"{_count(totals['replays'], 'replay')} ({share:.0f} %), "
        f"{_count(totals['captures'], 'capture')}, "
        f"{_count(totals['uncaptured_runs'], 'uncaptured run')}"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def log_summary(graph_id: str, stats: Mapping) -> None:
    """Log :func:`summary` at INFO (``TORCH_LOGS=fxsplit``) where a captured piece ran."""
    line = summary(graph_id, stats)
    if line is not None:
        log.info("%s", line)
