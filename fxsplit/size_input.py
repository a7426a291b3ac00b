"""The size input: the graph inputs whose leading dim is the token count, where ``capture_sizes``,
``compile_sizes`` and the step-sizes pass read it; found in one place for all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule

from fxsplit.facts.inputs import is_static_input
from fxsplit.warn import warn_at_caller

if TYPE_CHECKING:
    from fxsplit.config import Config
    from fxsplit.frame import Frame
    from fxsplit.split_result import Split

__all__ = ["argument_name", "size_input_index", "size_input_indices", "size_inputs", "traced_size"]


def size_input_index(
    placeholders, example_inputs, params, arg_names, size_input, warn: bool = True
) -> int | None:
    """Index of the graph input whose leading dim is the token count: the first tensor argument
    of the compiled frame in its signature's order (Dynamo orders graph inputs by first use, so
    a model that reads ``block_table`` first would key on the number of sequences), or the first
    argument named by ``size_input`` (a tuple of names) that the graph has (names matching none
    warn, where ``warn``)."""
    found = size_input_indices(placeholders, example_inputs, params, arg_names, size_input, warn)
    return found[0] if found else None


def size_input_indices(
    placeholders, example_inputs, params, arg_names, size_input, warn: bool = True
) -> tuple[int, ...]:
    """Indices of every graph input whose leading dim is the token count, the one
    :func:`size_input_index` returns first, then the others ``size_input`` names (in its order);
    empty where the graph has no tensor argument."""
    candidates = [
        i
        for i, value in enumerate(example_inputs)
        if isinstance(value, torch.Tensor) and i not in params and value.dim() > 0
    ]
    if not candidates:
        return ()
    names = {i: argument_name(placeholders[i]) for i in candidates}
    if size_input:
        by_name = {names[i]: i for i in reversed(candidates)}  # the first input of each name
        named = tuple(by_name[n] for n in size_input if n in by_name)
        if named:
            return named
    if size_input and warn:
        given = size_input[0] if len(size_input) == 1 else list(size_input)
        warn_at_caller(
            f"fxsplit: size_input={given!r} names no tensor argument of this graph "
            f"(tensor arguments: {', '.join(sorted(n for n in names.values() if n)) or 'none'}); "
            "using the first tensor argument"
        )
    if arg_names:
        order = {name: k for k, name in enumerate(arg_names)}
        ranked = sorted(candidates, key=lambda i: (order.get(names[i], len(order)), i))
        return (ranked[0],)
    return (candidates[0],)


def argument_name(node) -> str | None:
    """The frame argument a placeholder comes from: ``x`` for source ``L['x']``."""
    grapharg = node.meta.get("grapharg")
    name = getattr(getattr(grapharg, "source", None), "name", None)
    name = name() if callable(name) else name
    if isinstance(name, str) and name.startswith("L['") and name.endswith("']"):
        return name[3:-2]
    return None


def size_inputs(gm: GraphModule, example_inputs, frame: Frame | None, config: Config):
    """Indices of the graph inputs whose leading dim is the token count, the one the runtime
    reads ``capture_sizes`` from first."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return ()
    params = [i for i, n in enumerate(placeholders) if is_static_input(n)]
    names = frame.arg_names if frame is not None else None
    return size_input_indices(
        placeholders, example_inputs, params, names, config.size_input, warn=False
    )


def traced_size(result: Split, example_inputs, frame: Frame | None, config: Config):
    """(the token count as Dynamo traced it, a SymInt when dynamic; ``compile_sizes``) for
    the Inductor pass."""
    if not config.compile_sizes:
        return None, ()
    placeholders = list(result.stitched.graph.find_nodes(op="placeholder"))
    params = [i for i, n in enumerate(placeholders) if is_static_input(n)]
    names = frame.arg_names if frame is not None else None
    index = size_input_index(
        placeholders, example_inputs, params, names, config.size_input, warn=False
    )
    traced = placeholders[index].meta.get("example_value") if index is not None else None
    if not isinstance(traced, torch.Tensor):
        return None, ()
    return traced.shape[0], config.compile_sizes
