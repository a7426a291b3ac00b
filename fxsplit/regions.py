"""Region marking: ``fxsplit.region(name)`` tags every node traced inside it.

A region is a named stretch of model code that a runner may need to run eagerly (see
:mod:`fxsplit.runners`). The tag is a key in ``node.meta["custom"]`` written by
``torch.fx.traceback.annotate``. ``annotate`` merges nested dicts with ``dict.update``, so each
region name gets a key of its own and nested regions keep every enclosing name.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch.fx.traceback import annotate

ATTN_PREP = "attn_prep"
SPARSE_INDEXER = "sparse_indexer"
ATTENTION = "attention"

REGION_KEY_PREFIX = "fxsplit.region:"

_warned_graph_break: set[str] = set()


_get_eval_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)


@torch.compiler.disable
def _warn_graph_break(name: str) -> None:
    if name in _warned_graph_break:
        return
    _warned_graph_break.add(name)
    warnings.warn(
        f"fxsplit.region({name!r}) ran eagerly inside torch.compile: a graph break inside the "
        'region made Dynamo skip the whole frame (torch logs "WON\'T CONVERT"), so fxsplit never '
        "saw it. Move the graph break out of the region.",
        RuntimeWarning,
        stacklevel=4,
    )


def region_key(name: str) -> str:
    """The ``node.meta["custom"]`` key that marks membership of region ``name``."""
    return REGION_KEY_PREFIX + name


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """Mark the code inside as region ``name``; usable as ``with`` block and as decorator.

    Under torch.compile, every FX node traced inside carries ``node.meta["custom"][
    "fxsplit.region:<name>"] = True``; nesting keeps all enclosing names. The runner policy
    (:class:`fxsplit.runners.Runner`) decides whether the region runs eagerly or is captured.
    Outside torch.compile it changes nothing, except that a region run eagerly because Dynamo
    skipped its frame (a graph break inside it) warns once per region name.

    Args:
        name: region name, a non-empty string, e.g. :data:`ATTN_PREP`, :data:`SPARSE_INDEXER`,
            :data:`ATTENTION`.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty.
    """
    if not isinstance(name, str):
        raise TypeError(f"fxsplit.region name must be a str, got {type(name).__name__}: {name!r}")
    if not name:
        raise ValueError("fxsplit.region name must be a non-empty string")
    # Running eagerly with Dynamo's frame callback installed means torch.compile skipped the
    # enclosing frame, almost always for a graph break inside this region: the backend never
    # sees such a frame, so this is the only place it can be reported.
    if (
        not torch.compiler.is_compiling()
        and _get_eval_frame_callback is not None
        and _get_eval_frame_callback() is not None
    ):
        _warn_graph_break(name)
    with annotate({region_key(name): True}):
        yield


def node_regions(custom: dict | None) -> tuple[str, ...]:
    """Region names recorded in a node's ``meta["custom"]`` dict, in insertion order."""
    if not custom:
        return ()
    n = len(REGION_KEY_PREFIX)
    return tuple(k[n:] for k in custom if k.startswith(REGION_KEY_PREFIX))
