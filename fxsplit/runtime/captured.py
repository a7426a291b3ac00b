"""A captured piece at run time: one graph per capture key, bound inputs, replay.

Hot path per call (:meth:`CapturedPiece.__call__`): build the key, look up its entry, compare
the data pointers of the runner and internal inputs against the table made at capture, copy or
refuse as the binding says, replay, copy mutated inputs back. Parameters are not looked at here:
the graph runtime checks them once per step.
"""

from __future__ import annotations

import logging

import torch

from fxsplit import counters
from fxsplit.runtime import binding
from fxsplit.runtime.binding import HOST, INTERNAL, PARAM, RUNNER, BindingError, InputSpec
from fxsplit.runtime.graphs import new_graph
from fxsplit.runtime.stats import PieceStats

_TOTALS = counters.totals

log = logging.getLogger("fxsplit")

_STRICT, _COPY = 1, 2


class VerifyError(RuntimeError):
    """``verify=True`` found a replay whose result differs from running the piece uncaptured."""


class _Entry:
    """One capture key of a piece: its graph, static inputs, the address table and counters."""

    __slots__ = ("checks", "counts", "graph", "key", "mutated", "outputs", "ptrs", "statics")

    def __init__(self, key, graph, statics, outputs, checks, mutated, counts):
        self.key = key
        self.graph = graph
        self.statics = statics
        self.outputs = outputs
        self.checks = checks  # (index, static, data_ptr, mode) per checked input
        self.mutated = mutated  # (index, static, data_ptr) per mutated tensor input
        self.ptrs = tuple(s.data_ptr() if isinstance(s, torch.Tensor) else None for s in statics)
        self.counts = counts


class CapturedPiece(torch.nn.Module):
    """Stands in for a captured :class:`~fxsplit.passes.materialise.PieceModule` in the stitched
    module when capture is on.

    Args:
        piece: the piece module (its ``forward`` is the uncaptured code).
        specs: one :class:`~fxsplit.runtime.binding.InputSpec` per input.
        regions: region names of the piece (for error messages).
        runtime: the :class:`~fxsplit.runtime.graph_runtime.GraphRuntime` that owns it.
    """

    def __init__(self, piece, specs: list[InputSpec], key_reads, regions, runtime):
        super().__init__()
        self.name = piece.name
        self.kind = piece.kind
        self.code = piece.code
        self.run_uncaptured = piece.forward
        self.specs = specs
        self.regions = frozenset(regions)
        self.runtime = runtime
        self.entries: dict[tuple, _Entry] = {}
        self.warmups: dict[tuple, int] = {}
        self.failed: str | None = None
        self.stats = PieceStats()
        self.key = _key_function(key_reads)

    def __call__(self, *inputs):
        runtime = self.runtime
        if not runtime.capture_step or self.failed is not None:
            return self._uncaptured(inputs, None)
        key = self.key(inputs)
        entry = self.entries.get(key)
        if entry is None:
            return self._miss(key, inputs)
        for i, static, ptr, mode in entry.checks:
            value = inputs[i]
            if value.data_ptr() != ptr:
                if mode == _STRICT and not runtime.session.produced(value):
                    raise self._moved(i, value, ptr)
                static.copy_(value)
                self.stats.add(entry.counts, "input_copies")
                self.stats.add(entry.counts, "input_copy_bytes", value.nbytes)
                self.stats.copies_by_input[self.specs[i].name] += 1
        if runtime.verify:
            return self._verified_replay(entry, inputs)
        entry.graph.replay()
        for i, static, ptr in entry.mutated:
            if inputs[i].data_ptr() != ptr:
                inputs[i].copy_(static)
        entry.counts["replays"] += 1
        _TOTALS["replays"] += 1
        return entry.outputs

    def _uncaptured(self, inputs, key):
        self.stats.add(self.stats.key(key), "uncaptured_runs")
        return self.run_uncaptured(*inputs)

    def _miss(self, key, inputs):
        runtime = self.runtime
        done = self.warmups.get(key, 0)
        if done < runtime.warmup_runs:
            self.warmups[key] = done + 1
            return self._uncaptured(inputs, key)
        if len(self.entries) >= runtime.max_captured_keys:
            runtime.warn_key_limit(self)
            return self._uncaptured(inputs, key)
        try:
            entry = self._capture(key, inputs)
        except BindingError:
            raise
        except Exception as error:
            # A failed capture leaves nothing behind (see _capture). Running the piece uncaptured
            # tells a model error (it raises again, unchanged, and capture stays on for the next
            # input) from an op that cannot be captured (it runs).
            out = self._uncaptured(inputs, key)
            if runtime.on_capture_error == "raise":
                raise
            self.failed = f"{type(error).__name__}: {error}"
            log.warning("fxsplit: %s runs uncaptured from now on: %s", self.name, self.failed)
            return out
        self.entries[key] = entry
        self.stats.add(entry.counts, "captures")
        for i, static, ptr in entry.mutated:
            if inputs[i].data_ptr() != ptr:
                inputs[i].copy_(static)
        return entry.outputs

    def _capture(self, key, inputs) -> _Entry:
        """Capture ``key``; the returned entry's outputs hold this call's result.

        Raises:
            CaptureError / RuntimeError: an op illegal under capture, or inputs whose aliasing a
                captured graph cannot keep (see :meth:`_check_aliasing`). Nothing the piece
                writes is left changed by a failed capture.
        """
        runtime = self.runtime
        persistent = runtime.persistent_inputs
        self._check_aliasing(inputs)
        statics = []
        for spec, value in zip(self.specs, inputs, strict=True):
            if (
                not isinstance(value, torch.Tensor)
                or spec.kind in (PARAM, HOST)
                or (spec.kind == RUNNER and persistent)
                or (spec.kind == INTERNAL and id(value) in runtime.static_outputs)
            ):
                statics.append(value)
            else:
                statics.append(value.clone())
        graph = new_graph(runtime.mode, runtime.pool, runtime.device)
        # The emulator runs the piece while recording; if the capture then fails, the fallback
        # run must find what the piece writes as it was (a CUDA capture executes nothing).
        saved = (
            [(s, s.clone()) for s, spec in zip(statics, self.specs, strict=True)
             if spec.mutated and isinstance(s, torch.Tensor)]
            if runtime.mode == "emulate" else []
        )  # fmt: skip
        runtime.capture_session.collect_once()
        try:
            outputs = graph.capture(self.run_uncaptured, *statics)
            self._check_outputs(outputs, statics)
        except BaseException:
            for static, copy in saved:
                static.copy_(copy)
            raise
        callers = {  # storage fxsplit does not own: a persistent runner input, a parameter
            s.untyped_storage().data_ptr()
            for s, value in zip(statics, inputs, strict=True)
            if isinstance(s, torch.Tensor) and s is value
        }
        for out in _flat(outputs):
            if isinstance(out, torch.Tensor):
                runtime.static_outputs[id(out)] = out
                storage = out.untyped_storage().data_ptr()
                if storage not in callers:
                    runtime.static_ptrs.add(out.data_ptr())
                    runtime.static_storages.add(storage)
        checks, mutated = [], []
        for i, (spec, static) in enumerate(zip(self.specs, statics, strict=True)):
            if not isinstance(static, torch.Tensor) or spec.kind in (PARAM, HOST):
                continue
            ptr = static.data_ptr()
            if spec.mutated:
                mutated.append((i, static, ptr))
            if spec.kind == RUNNER:
                if runtime.binding == "trust":
                    continue
                mode = _STRICT if runtime.binding == "strict" else _COPY
            else:
                mode = _COPY
            checks.append((i, static, ptr, mode))
        counts = self.stats.key(key)
        return _Entry(key, graph, statics, outputs, tuple(checks), tuple(mutated), counts)

    def _check_aliasing(self, inputs) -> None:
        """Refuse to capture when two tensor inputs share storage and the piece writes one: the
        static buffers are separate copies, so the write would not reach the other."""
        if not any(spec.mutated for spec in self.specs):
            return
        storages: dict[int, str] = {}
        for spec, value in zip(self.specs, inputs, strict=True):
            if isinstance(value, torch.Tensor) and spec.kind in (RUNNER, INTERNAL):
                ptr = value.untyped_storage().data_ptr()
                if ptr in storages:
                    raise RuntimeError(
                        f"{self.name}: inputs {storages[ptr]!r} and {spec.name!r} share storage "
                        "and the piece writes into its inputs; captured static buffers cannot "
                        "keep that aliasing"
                    )
                storages[ptr] = spec.name

    def _check_outputs(self, outputs, statics) -> None:
        """Refuse outputs that are views of a copied runner input: eagerly they alias the
        caller's tensor, replayed they would alias fxsplit's static copy."""
        copied = {
            s.untyped_storage().data_ptr(): spec.name
            for s, spec in zip(statics, self.specs, strict=True)
            if isinstance(s, torch.Tensor) and spec.kind == RUNNER
        }
        if self.runtime.persistent_inputs:
            return
        for out in _flat(outputs):
            if isinstance(out, torch.Tensor):
                name = copied.get(out.untyped_storage().data_ptr())
                if name is not None:
                    raise RuntimeError(
                        f"{self.name}: an output is a view of runner input {name!r}; a replay "
                        "would return a view of fxsplit's static copy instead of the caller's "
                        "tensor"
                    )

    def _moved(self, i: int, value, ptr: int) -> BindingError:
        spec = self.specs[i]
        return BindingError(
            f"{self.name} (regions: {', '.join(sorted(self.regions)) or '-'}): input "
            f"{spec.name!r} from {spec.source} is at 0x{value.data_ptr():x}, but the captured "
            f"graph reads 0x{ptr:x}; with input_binding='strict' a runner must hand the same "
            "tensor every step (use persistent buffers, or input_binding='copy')"
        )

    def _verified_replay(self, entry: _Entry, inputs):
        snapshots = list(inputs)
        written = [i for i, spec in enumerate(self.specs) if spec.mutated]
        for i in written:
            snapshots[i] = inputs[i].clone()
        moved = [
            self.specs[i].name
            for i, ptr in enumerate(entry.ptrs)
            if ptr is not None
            and isinstance(inputs[i], torch.Tensor)
            and inputs[i].data_ptr() != ptr
        ]
        entry.graph.replay()
        for i, static, ptr in entry.mutated:
            if inputs[i].data_ptr() != ptr:
                inputs[i].copy_(static)
        self.stats.add(entry.counts, "replays")
        expected = self.run_uncaptured(*snapshots)
        got = entry.outputs
        pairs = list(zip(_flat(got), _flat(expected), strict=True))
        pairs += [(inputs[i], snapshots[i]) for i in written]
        for a, b in pairs:
            if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                raise VerifyError(
                    f"verify: replay of {self.name} (regions: "
                    f"{', '.join(sorted(self.regions)) or '-'}) differs from running it "
                    f"uncaptured; inputs whose address changed since capture: "
                    f"{', '.join(moved) or 'none'}"
                )
        return got


def _key_function(reads):
    """``inputs -> capture key``: every host value the piece reads and each distinct dynamic size
    of its tensor inputs (see :func:`fxsplit.runtime.binding.key_reads`). Generated as one tuple
    expression because this runs on every call."""
    parts = [
        f"a[{i}]" if d is None else f"a[{i}].shape" if d < 0 else f"a[{i}].shape[{d}]"
        for i, d in reads
    ]
    return eval(f"lambda a: ({''.join(p + ', ' for p in parts)})")


def _flat(value):
    return value if isinstance(value, tuple) else (value,)


__all__ = ["BindingError", "CapturedPiece", "VerifyError", "binding"]
