"""Region marking: ``fxsplit.region(name)`` tags every node traced inside it.

A region is a named stretch of model code that a runner may need to run eagerly (see
:mod:`fxsplit.runners`). The tag is a key in ``node.meta["custom"]`` written by
``torch.fx.traceback.annotate``. ``annotate`` merges nested dicts with ``dict.update``, so each
region name gets a key of its own and nested regions keep every enclosing name.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch
from torch.fx.traceback import annotate

from fxsplit.warn import FxsplitRuntimeWarning, warn_in_model_code

ATTN_PREP = "attn_prep"
SPARSE_INDEXER = "sparse_indexer"
ATTENTION = "attention"

REGION_KEY_PREFIX = "fxsplit.region:"

_warned_eager: set[tuple[str, bool]] = set()


_get_eval_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)


@torch.compiler.disable
def _warn_eager_region(name: str) -> None:
    limited = _recompile_limited_frame()
    key = (name, limited is not None)
    if key in _warned_eager:
        return
    _warned_eager.add(key)
    if limited is not None:
        code, entries, limit = limited
        cause = (
            f"Dynamo reached its recompile limit on {code.co_name!r} ({code.co_filename}:"
            f"{code.co_firstlineno}: {entries} compiled versions, "
            f"torch._dynamo.config.recompile_limit={limit}) and now runs it eagerly, so fxsplit "
            "never sees this call. Find what changes between calls with "
            'TORCH_LOGS="recompiles" (a Python int or a new shape on every call), mark it '
            "dynamic, or raise the limit."
        )
    else:
        cause = (
            "a graph break inside the region made Dynamo skip the whole frame (torch logs "
            '"WON\'T CONVERT"), so fxsplit never saw it. Move the graph break out of the region.'
        )
    warn_in_model_code(
        f"fxsplit.region({name!r}) ran eagerly inside torch.compile: {cause}",
        FxsplitRuntimeWarning,
    )


def _recompile_limited_frame() -> tuple[types.CodeType, int, int] | None:
    """The nearest calling frame whose code Dynamo compiled ``recompile_limit`` times or more
    (it then runs that code eagerly): (code, compiled versions, limit); None if there is none."""
    from torch._dynamo import config

    get_entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if get_entries is None:
        return None
    limit = config.recompile_limit
    frame = sys._getframe(1)
    while frame is not None:
        entries = len(get_entries(frame.f_code))
        if entries >= limit:
            return frame.f_code, entries, limit
        frame = frame.f_back
    return None


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
    skipped its frame warns once per region name and cause, naming the cause: a graph break
    inside the region, or the frame's recompile limit.

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
    # enclosing frame (a graph break inside this region, or the frame's recompile limit): the
    # backend never sees such a frame, so this is the only place it can be reported.
    if not torch.compiler.is_compiling():
        if _get_eval_frame_callback is not None and _get_eval_frame_callback() is not None:
            _warn_eager_region(name)
        # nothing to mark outside a trace; annotate's marks live in one global dict, which
        # regions entered eagerly from two threads at once would leave holding a region
        yield
        return
    with annotate({region_key(name): True}):
        yield


def node_regions(custom: dict | None) -> tuple[str, ...]:
    """Region names recorded in a node's ``meta["custom"]`` dict, in insertion order."""
    if not custom:
        return ()
    n = len(REGION_KEY_PREFIX)
    return tuple(k[n:] for k in custom if k.startswith(REGION_KEY_PREFIX))
