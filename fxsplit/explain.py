"""``fxsplit.explain``: run a model once through the backend and return its plans."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fxsplit.backend import Backend
from fxsplit.plan import SplitPlan


def explain(model, *args, kwargs: dict | None = None, **options) -> list[SplitPlan]:
    """Compile ``model`` with a fresh :class:`~fxsplit.Backend` (capture off), call it once as
    ``model(*args, **kwargs)``, and return the plan of every graph compiled, including graphs
    after graph breaks.

    Dynamo's compiled code for every frame that had none before is dropped afterwards, so
    explaining a model any number of times never uses up its recompile limit: a later
    ``torch.compile`` of it compiles as if ``explain`` had never run. (A frame some earlier
    ``torch.compile`` already compiled keeps one more cache entry, as Dynamo offers no way to
    drop a single one.)

    Args:
        model: an ``nn.Module`` or function.
        args / kwargs: the model's positional and keyword arguments.
        options: fxsplit options (``capture`` is forced to ``"off"``).

    Raises:
        ValueError / TypeError: bad options, before anything is compiled.
    """
    backend = Backend(**{**options, "capture": "off"})
    with _dropping_new_cache_entries():
        torch.compile(model, backend=backend)(*args, **(kwargs or {}))
    backend.checks.warn()  # the call compiled every graph it needs
    return list(backend.plans)


@contextlib.contextmanager
def _dropping_new_cache_entries() -> Iterator[None]:
    """Reset Dynamo's cache of every code object that had no cache entry on entry."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    from torch._dynamo.convert_frame import input_codes

    compiled_before = {
        id(code)
        for ref in input_codes.seen
        if (code := ref()) and _debug_get_cache_entry_list(code)
    }
    try:
        yield
    finally:
        for ref in list(input_codes.seen):
            code = ref()
            if code is not None and id(code) not in compiled_before:
                reset_code(code)
