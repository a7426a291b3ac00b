"""The memory pool a backend's captured graphs share on one device, and its ordering rule.

Graphs captured into one pool are safe only when replayed in the order they were captured
(``ATen/cuda/CUDAGraph.h``): a graph's scratch was free when later graphs were captured, so they
may have placed their outputs there, and replaying it overwrites them. fxsplit keeps that rule
by construction:

- every captured graph gets a capture *order* (:meth:`MemoryPool.next_order`);
- within a step (one call of the model: from a call of the graph the caller entered, or the next
  call of any graph already called in this step), replays must come in increasing order. A piece
  whose graph was captured before one already replayed in this step (a piece refused at one step
  and captured at a later one, a compiled piece that captured a step after the plain ones, a
  capture key without the token count) is recaptured first: its new graph is the newest, so
  nothing it writes is live (:meth:`MemoryPool.in_order`). A graph called again in a step
  (inside another graph's call) replays graphs of its own for that call
  (:class:`~fxsplit.runtime.piece.stats.Repeat`), so its calls keep that order step after step;
- outputs that leave fxsplit are handed out through the pool's
  :class:`~fxsplit.runtime.memory.output_lifetime.OutputLedger`, which invalidates them before a
  replay that may overwrite them.

On CUDA the pool's memory is the caching allocator's private pool (:class:`DeviceCapture`); in
the emulator an :class:`~fxsplit.runtime.emulation.emulated_pool.EmulatedPool` with the same reuse.
"""

from __future__ import annotations

import weakref

import torch

from fxsplit.runtime.cuda.graphs import DeviceCapture, new_graph
from fxsplit.runtime.emulation.emulated_pool import EmulatedPool
from fxsplit.runtime.memory.output_lifetime import OutputLedger

__all__ = ["MemoryPool"]


class MemoryPool:
    """One backend's capture memory on one device.

    Args:
        mode: ``"cuda"`` or ``"emulate"``.
        device: the device of the graphs' tensors.

    Attributes:
        ledger: the outputs handed out of this pool.
        high: the highest capture order replayed or captured in the current step.
        owners: data pointer of each captured graph's output storage -> that graph's order.
        serial: this pool's number among the memory pools of the process (1 for the first).
    """

    def __init__(self, mode: str, device: torch.device):
        global _SERIAL
        _SERIAL += 1
        self.serial = _SERIAL
        _POOLS.add(self)
        self.mode = mode
        self.device = device
        self.cuda = DeviceCapture(device) if mode == "cuda" else None
        self.emulated = EmulatedPool(device) if mode == "emulate" else None
        self.ledger = OutputLedger()
        self.owners: dict[int, int] = {}
        self.high = -1
        self.step = 0
        self._order = 0
        if self.emulated is not None:
            # The emulator's segments would go with this pool: what the model still holds over
            # them (an output it kept, handed out or lent) keeps them alive. A finalizer, not
            # __del__: its arguments (the ledger's weak references) stay reachable, so a
            # collection of a cycle through this pool cannot finalize them first.
            weakref.finalize(self, _gone, self.emulated, self.ledger).atexit = False

    def new_graph(self, generators=()):
        """A fresh graph that captures into this pool (``generators``: the CUDA generators other
        than the default one that it draws from)."""
        return new_graph(self.mode, self.cuda, self.emulated, generators)

    def next_order(self) -> int:
        """The capture order of a graph being captured now (the newest); it is the step's
        highest from here on."""
        self._order += 1
        self.high = self._order
        return self._order

    def in_order(self, order: int) -> bool:
        """Whether a graph of capture order ``order`` may replay now: no graph captured after
        it has replayed or captured in this step."""
        return order >= self.high

    def before_replay(self, order: int) -> None:
        """Move out of the pool the held outputs the replay of a graph of capture order
        ``order`` may overwrite, and make it the step's highest."""
        self.ledger.before_write(order)
        self.high = order

    def begin_step(self, step: int) -> None:
        """A new step of the model: any capture order may replay first."""
        self.step = step
        self.high = -1


def _gone(emulated: EmulatedPool, ledger: OutputLedger) -> None:
    emulated.outlive(ledger.live_refs())


# Every memory pool alive, and the serial number of the last one made: a test's teardown asks
# which pools it made still hand memory out (fxsplit.runtime.memory.live).
_POOLS: weakref.WeakSet[MemoryPool] = weakref.WeakSet()
_SERIAL = 0  # the last pool's serial number
