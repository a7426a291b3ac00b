"""``fxsplit.explain``: run a model once through the backend and return its plans."""

from __future__ import annotations

import torch

from fxsplit.backend import Backend
from fxsplit.plan import SplitPlan


def explain(model, *args, kwargs: dict | None = None, **options) -> list[SplitPlan]:
    """Compile ``model`` with a fresh :class:`~fxsplit.Backend` (capture off), call it once as
    ``model(*args, **kwargs)``, and return the plan of every graph compiled, including graphs
    after graph breaks.

    Args:
        model: an ``nn.Module`` or function.
        args / kwargs: the model's positional and keyword arguments.
        options: fxsplit options (``capture`` is forced to ``"off"``).

    Raises:
        ValueError / TypeError: bad options, before anything is compiled.
    """
    backend = Backend(**{**options, "capture": "off"})
    compiled = torch.compile(model, backend=backend)
    compiled(*args, **(kwargs or {}))
    return list(backend.plans)
