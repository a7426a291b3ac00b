"""``fxsplit.explain``: run a model once through the backend and return its plans."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fxsplit import capture_off
from fxsplit.backend import Backend
from fxsplit.config import Config
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
        options: fxsplit options (``capture`` is forced to ``"off"``; where the options'
            own capture would capture nothing here, one line on the ``fxsplit`` logger says
            so, as the backend's first graph would: :mod:`fxsplit.capture_off`).

    Raises:
        ValueError / TypeError: bad options, before anything is compiled.
    """
    requested = Config.from_options(options).capture  # checked before explain turns it off
    backend = Backend(**{**options, "capture": "off"})
    capture_off.tell_once(requested, _cuda_device(model, args, kwargs))
    with _dropping_new_cache_entries():
        torch.compile(model, backend=backend)(*args, **(kwargs or {}))
    backend.checks.warn()  # the call compiled every graph it needs
    return list(backend.plans)


def _cuda_device(model, args, kwargs) -> torch.device | None:
    """The CUDA device of the model's first tensor on one (parameters, buffers, arguments)."""
    tensors = [*args, *(kwargs or {}).values()]
    if isinstance(model, torch.nn.Module):
        tensors += [*model.parameters(), *model.buffers()]
    return next(
        (t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"),
        None,
    )


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
