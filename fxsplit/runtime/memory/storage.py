"""Storages: their address, views over them, and copies that keep aliasing (tensors sharing
memory stay views of one copy).

The copies serve wherever fxsplit must copy values a model may see through several views:
outputs cloned for ``clone_outputs``, earlier outputs handed back in, and verify's snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["clone_sharing", "is_strided", "may_move", "move_out", "storage_ptr", "view_over"]


def is_strided(value: object) -> bool:
    """Whether ``value`` is a strided tensor (one with a storage and strides)."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided


def storage_ptr(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage (its views share it); None for a tensor without one
    (sparse and other layouts)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def view_over(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A tensor over ``storage`` with ``like``'s dtype, size, stride, offset and conjugate and
    negative bits."""
    view = torch.empty(0, dtype=like.dtype, device=like.device)
    view = view.set_(storage, like.storage_offset(), like.size(), like.stride())
    if like.is_conj():
        view = view.conj()
    if like.is_neg():
        view = torch._neg_view(view)
    return view


def clone_sharing(values: Sequence[object]) -> list[object]:
    """Clones of the tensors in ``values`` (other values as they are) that share memory as the
    originals do: each distinct storage is cloned once and each tensor rebuilt over its clone.

    Returns:
        the clones, in order.
    """
    storages: dict[int, torch.UntypedStorage] = {}
    out: list[object] = []
    for value in values:
        if not isinstance(value, torch.Tensor):
            out.append(value)
            continue
        storage = value.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -id(value)  # empty: all at address 0
        copy = storages.get(key)
        if copy is None:
            copy = storages[key] = storage.clone()
        out.append(view_over(copy, value))
    return out


def may_move() -> bool:
    """Whether a held output may move to memory of its own now: this torch can move a storage,
    and no CUDA capture is under way on this thread (a collected backend's finalizer may run
    inside one: the copy would be recorded into that graph, its memory taken from its pool)."""
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def move_out(cdata: int) -> None:
    """Give the storage ``cdata`` a copy of its values in memory of its own (outside any pool:
    never during a capture, see :func:`may_move`)."""
    storage = torch.UntypedStorage._new_with_weak_ptr(cdata)
    if storage is None:
        return
    copy = torch.UntypedStorage(storage.nbytes(), device=storage.device)
    copy.copy_(storage)
    storage._swap_data_ptr_(copy)
