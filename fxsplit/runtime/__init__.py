"""The run time of a compiled graph with capture on, in the rooms a replay walks through:

- ``step/``: one call of a graph (:mod:`~fxsplit.runtime.step.graph_runtime`), the backend's
  session of steps and pools (:mod:`~fxsplit.runtime.step.session`), and what its pieces read
  of it (:mod:`~fxsplit.runtime.step.context`);
- ``piece/``: a captured piece and its entries, one per capture key: the hot path
  (:mod:`~fxsplit.runtime.piece.captured`), one capture, the entry record, verify, the
  strict check with capture off, counters and the replay watch;
- ``inputs/``: how each input is bound (:mod:`~fxsplit.runtime.inputs.binding`), fxsplit's own
  static buffers, and the parameters read by address;
- ``memory/``: the pool and its capture order, the outputs handed out and lent, which memory
  fxsplit produced, storage helpers;
- ``emulation/``: the CPU capture emulator and its memory pool;
- ``cuda/``: CUDA/HIP graphs and the capture stream and pool they share.
"""
