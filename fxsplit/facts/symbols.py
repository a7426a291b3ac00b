"""Free symbols of traced values, and Dynamo's source names in the model's terms: what the
step-sizes pass and the replay watch both read of a graph's sizes."""

from __future__ import annotations

import re

import torch

__all__ = ["describe", "symbols"]

_HOST = (torch.SymInt, torch.SymFloat, torch.SymBool)


def symbols(value: object, cache: dict | None = None) -> set:
    """The free symbols of a node's value (a tensor's sizes, strides and offset, a SymInt, or
    tuples and lists of them), after the ShapeEnv's replacements; ``cache`` keeps each
    expression's symbols across calls (sympy computes them anew every time)."""
    found: set = set()
    _collect(value, found, {} if cache is None else cache)
    return found


def _collect(value: object, found: set, cache: dict) -> None:
    if isinstance(value, torch.Tensor):
        strided = value.layout == torch.strided
        parts = (*value.shape, *value.stride(), value.storage_offset()) if strided else value.shape
        for size in parts:
            if isinstance(size, torch.SymInt):
                _expression(size, found, cache)
    elif isinstance(value, _HOST):
        _expression(value, found, cache)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found, cache)


def _expression(value, found: set, cache: dict) -> None:
    expr = value.node.expr
    known = cache.get(expr)
    if known is None:
        known = cache[expr] = expr.free_symbols
    found.update(known)


_NESTED = re.compile(r"^L\['(?:kwargs|args)'\]\['([A-Za-z_]\w*)'\]")
_SIZE = re.compile(r"\.size\(\)\[(\d+)\]")
_STRIDE = re.compile(r"\.stride\(\)\[(\d+)\]")


def describe(source: str) -> str:
    """Dynamo's source name in the model's terms: ``L['kwargs']['cache'].layers[0].keys.size()[2]``
    -> ``cache.layers[0].keys.size(2)``, ``L['x']`` -> ``x``; other names are returned as they
    are."""
    text = _NESTED.sub(r"\1", source, count=1)
    if text == source:
        text = re.sub(r"^L\['([A-Za-z_]\w*)'\]", r"\1", source, count=1)
    text = _SIZE.sub(r".size(\1)", text)
    return _STRIDE.sub(r".stride(\1)", text)
