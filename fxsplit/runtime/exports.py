"""Tensors exported to NumPy or DLPack: a captured output moves out of the pool first.

A NumPy array (``t.numpy()``, ``np.asarray(t)``) or a DLPack capsule (``torch.to_dlpack(t)``,
``t.__dlpack__()``, which ``np.from_dlpack`` and other libraries call) holds the memory's
address, not the tensor: no later move of the tensor's storage reaches it. Made from an output a
pool handed out or lent, it would read whatever the next replay writes there, silently. So while
a pool is open those entry points ask first (:func:`install`): an output still over a pool's
memory moves to memory of its own with its values (its storage and every view of it follow; the
array then shares the tensor's memory, as in eager), and the pool forgets it. A torch that cannot
move a storage (2.11) raises instead, naming the output.

``torch.utils.dlpack.to_dlpack`` imported by name before the first pool opened keeps torch's own
function, which this cannot reach.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.dlpack

from fxsplit.facts import op_facts

__all__ = ["install"]

_installed = False


def install(before_export: Callable[[torch.Tensor], None]) -> None:
    """Make ``Tensor.numpy``, ``Tensor.__dlpack__`` and ``torch.to_dlpack`` (also
    ``torch.utils.dlpack.to_dlpack``) call ``before_export(tensor)`` before they export; once per
    process, later calls do nothing."""
    global _installed
    if _installed:
        return
    _installed = True
    numpy, dlpack, to_dlpack = torch.Tensor.numpy, torch.Tensor.__dlpack__, torch.to_dlpack

    def exported_numpy(self, *, force=False):
        before_export(self)
        return numpy(self, force=force)

    def exported_dlpack(self, *args, **kwargs):
        before_export(self)
        return dlpack(self, *args, **kwargs)

    def exported_to_dlpack(tensor, *args, **kwargs):
        before_export(tensor)
        return to_dlpack(tensor, *args, **kwargs)

    for wrapper, original in (
        (exported_numpy, numpy),
        (exported_dlpack, dlpack),
        (exported_to_dlpack, to_dlpack),
    ):
        wrapper.__name__, wrapper.__qualname__ = original.__name__, original.__qualname__
        wrapper.__doc__ = original.__doc__
    # a torch-function mode is handed the attribute it finds on torch.Tensor: the emulator's
    # host-read check (op_facts.HOST_READS) must know the wrapper as the method it wraps
    op_facts.HOST_READS[exported_numpy] = op_facts.HOST_READS[numpy]
    torch.Tensor.numpy = exported_numpy
    torch.Tensor.__dlpack__ = exported_dlpack
    torch.to_dlpack = torch.utils.dlpack.to_dlpack = exported_to_dlpack
