"""What a graph's placeholders are, from Dynamo's own metadata: a compile-time fact both halves
read (the split decides with it which work runs eagerly; the runtime how each input is bound).
"""

from __future__ import annotations

import torch
from torch.fx import Node

__all__ = ["is_static_argument", "is_static_input"]


def is_static_input(node: Node) -> bool:
    """Whether a placeholder is a parameter, buffer or ``mark_static_address`` tensor."""
    if "_dynamo_static_input_type" in node.meta.get("tensor_dict", {}):
        return True
    example = getattr(node.meta.get("grapharg"), "example", None)
    return isinstance(example, torch.nn.Parameter)


def is_static_argument(node: Node) -> bool:
    """Whether a placeholder is a static tensor the caller handed in as an argument of the
    frame (``L['cache']``, ``L['caches'][0]``: a ``mark_static_address`` cache), reached
    through no attribute (a module's parameters and buffers are) nor Dynamo's stack at a graph
    break. (Never through ``grapharg.example``: it raises once the tensor died, as a buffer
    the model rebinds does.)"""
    from torch._dynamo.source import AttrSource, LocalSource

    if not is_static_input(node):
        return False
    source = getattr(node.meta.get("grapharg"), "source", None)
    while source is not None and not isinstance(source, LocalSource):
        if isinstance(source, AttrSource):
            return False
        source = getattr(source, "base", None)
    return source is not None and not source.local_name.startswith("___")
