"""A graph's parameters and buffers at run time: read by address while they hold still, and
copied like runner inputs while the model rebinds them (the rebinding state machine).

Dynamo lifts the parameters and buffers a graph reads into inputs. A captured graph reads them
where they were at capture, so they are checked once per step (:meth:`StaticInputs.follow`):

- unchanged: nothing to do (the steady state);
- moved once in a while, to the caller's memory (``load_state_dict(assign=True)``): every
  captured graph of the graph is dropped and captured again on the new weights;
- moved on consecutive steps, or to memory fxsplit produced (the model rebinds them,
  ``self.t = self.t + 1``, or several instances of one module call one graph): *rebound*, from
  then on copied into fxsplit's own buffers every call, like runner inputs
  (:meth:`StaticInputs.rebind`), until they hold still for ``SETTLED`` calls in the caller's
  memory (:meth:`StaticInputs.settled`), when they are read by address again.

A marked-static cache handed in as an argument (``torch._dynamo.mark_static_address``) is no
parameter here: the capture key reads its address (:mod:`fxsplit.runtime.inputs.binding`).
"""

from __future__ import annotations

import operator
import weakref

import torch

from fxsplit.facts.inputs import is_static_input
from fxsplit.runtime.memory import provenance
from fxsplit.runtime.memory.storage import storage_ptr

__all__ = ["SETTLED", "StaticInputs"]

_DATA_PTR = torch.Tensor.data_ptr

# Calls a rebound parameter must hold still before it is read by address again: a model that
# rebinds its state hands a new tensor every call, so it never gets there.
SETTLED = 3

FIRST, SAME, REBOUND, MOVED = "first", "same", "rebound", "moved"


class StaticInputs:
    """Which of a graph's inputs are parameters and buffers read by address, which are runner
    inputs (copied), and the rebinding state machine between them.

    Args:
        placeholders: the stitched graph's placeholders.
        example_inputs: Dynamo's example inputs (one per placeholder).
        static_arguments: names of the marked-static caches handed in as arguments.
        captured_reads: names of the placeholders captured pieces read (None: all); a
            parameter no captured piece reads is not followed.

    Attributes:
        params: indices of the parameters and buffers read by address.
        runner_inputs: indices of the tensor inputs copied into fxsplit's buffers (the caller's
            and the rebound parameters).
        volatile: names of the rebound parameters and buffers.
    """

    def __init__(
        self, placeholders, example_inputs, static_arguments: frozenset[str], captured_reads=None
    ):
        self.placeholders = placeholders
        static = [
            i
            for i, n in enumerate(placeholders)
            if is_static_input(n) and n.name not in static_arguments
        ]
        self.params = [
            i for i in static if captured_reads is None or placeholders[i].name in captured_reads
        ]
        self._static = static  # every parameter and buffer: their memory is frozen
        self.runner_inputs = [
            i
            for i, value in enumerate(example_inputs)
            if isinstance(value, torch.Tensor) and i not in self.params
        ]
        self.volatile: set[str] = set()
        self._ptrs: tuple | None = None
        self._frozen: frozenset[int] = frozenset()  # storages of the params
        self._moves: dict[int, int] = {}  # placeholder index -> the last step it moved on
        # rebound placeholder index -> (weak reference, address, calls it held still)
        self._settling: dict[int, tuple] = {}

    def names(self, indices) -> list[str]:
        return [self.placeholders[i].name for i in indices]

    def is_frozen_memory(self, value: torch.Tensor) -> bool:
        """Whether ``value`` lives in a parameter's or buffer's storage."""
        return bool(self._frozen) and storage_ptr(value) in self._frozen

    def follow(self, args, step: int) -> tuple[str, list[int]]:
        """Look at the parameters' addresses in this call's ``args`` (call ``step``):
        ``(FIRST, pooled)`` at the first look (``pooled``: those in a capture pool, another
        graph's outputs the model rebound them to), ``(SAME, [])``, ``(REBOUND, moved)`` for
        those the model rebinds, ``(MOVED, moved)`` for weights moved to the caller's memory."""
        ptrs = self._addresses(args)
        if self._ptrs is None:
            self._remember(args)
            # A captured graph's output: the pool's memory, which that graph's next output
            # reuses and the ledger may move a held tensor out of, so its address says nothing
            # of the tensor it holds. (An output of an uncaptured run, a KV cache made in a
            # prefill, is the caller's.)
            return FIRST, [i for i in self.params if provenance.RECORD.in_pool(args[i])]
        if ptrs == self._ptrs:
            return SAME, []
        moved = [i for i, a, b in zip(self.params, ptrs, self._ptrs, strict=True) if a != b]
        self._remember(args)
        # The model rebinding its buffers moves them on consecutive steps, or to memory fxsplit
        # produced (an output); reloading weights (load_state_dict(assign=True)) moves them once
        # in a while, to the caller's memory.
        produced = any(provenance.RECORD.produced(args[i]) for i in moved)
        rebound = []
        for i in moved:
            if produced or self._moves.get(i) == step - 1:
                rebound.append(i)
            self._moves[i] = step
        return (REBOUND, rebound) if rebound else (MOVED, moved)

    def rebind(self, indices: list[int], args) -> None:
        """The parameters at ``indices`` become runner inputs, copied every call."""
        self.volatile.update(self.names(indices))
        self.params = [i for i in self.params if i not in indices]
        self.runner_inputs = sorted({*self.runner_inputs, *indices})
        # The others keep following from this step's addresses: forgetting them (None) took the
        # next step's move for the first look, and a graph captured on the old weights replayed.
        self._remember(args)

    def rebound(self) -> list[int]:
        """Indices of the rebound parameters among the runner inputs."""
        volatile = self.volatile
        return [i for i in self.runner_inputs if self.placeholders[i].name in volatile]

    def settled(self, args) -> list[int]:
        """Rebound parameters that were the same tensor at the same address, in the caller's
        memory, for the last ``SETTLED`` calls (weights reloaded on two consecutive calls, then
        left alone) become parameters again, read by address; returns their indices."""
        settled = []
        for i in self.rebound():
            value = args[i]
            ref, ptr, calls = self._settling.get(i, (None, None, 0))
            if ref is not None and ref() is value and ptr == value.data_ptr():
                calls += 1
            else:
                ref, ptr, calls = weakref.ref(value), value.data_ptr(), 1
            self._settling[i] = (ref, ptr, calls)
            # in the pool, a replay may move it (an address says nothing of the tensor); an
            # uncaptured run's output (a cache made in a prefill) is the caller's memory, and
            # stays "produced" until its graph runs again
            if calls >= SETTLED and not provenance.RECORD.in_pool(value):
                settled.append(i)
        if settled:
            for i in settled:
                self.volatile.discard(self.placeholders[i].name)
                del self._settling[i]
            self.runner_inputs = [i for i in self.runner_inputs if i not in settled]
            self.params = sorted({*self.params, *settled})
            self._remember(args)
        return settled

    @property
    def params(self) -> list[int]:
        """Indices of the parameters and buffers captured pieces read by address."""
        return self._params

    @params.setter
    def params(self, indices: list[int]) -> None:
        self._params = indices
        # read once per step: C loops, no Python one (itemgetter of one index is no tuple)
        if len(indices) > 1:
            self._pick = operator.itemgetter(*indices)
        else:
            self._pick = lambda args, picked=tuple(indices): tuple(args[i] for i in picked)

    def _addresses(self, args) -> tuple[int, ...]:
        """The data pointers of the parameters in ``args``."""
        return tuple(map(_DATA_PTR, self._pick(args)))

    def _remember(self, args) -> None:
        self._ptrs = self._addresses(args)
        volatile = self.volatile
        self._frozen = frozenset(
            storage_ptr(args[i]) for i in self._static if self.placeholders[i].name not in volatile
        )
