"""Structured trace and logging registration: fxsplit next to PyTorch's own graphs in tlparse.

:func:`emit_plan` writes one compiled graph's plan (JSON) and the code of each piece as
``torch._logging.trace_structured`` artifacts, so a run under ``TORCH_TRACE=<dir>`` leaves them in
the trace files and ``tlparse`` lists them with the compile id of the Dynamo frame they belong to:

- ``fxsplit_plan_<graph_id>`` (encoding ``json``): the plan, as written to ``plan.json`` by
  :func:`fxsplit.plan_json.plan_dict`;
- ``fxsplit_<graph_id>_<piece>`` (encoding ``string``): each piece's generated source with a
  header naming its kind, regions and reasons;
- ``fxsplit_<graph_id>_stitched`` (encoding ``string``): the stitched top-level code.
- ``fxsplit_<graph_id>_compiled`` (encoding ``json``, with Inductor pieces): the dump's
  ``compiled.json``; Inductor traces each piece it compiles under its own artifact names.

Without ``TORCH_TRACE`` the calls cost a handler check: payloads are built lazily.

Importing this module also registers the ``fxsplit`` logger with torch's logging settings
(:func:`register_log`), so ``TORCH_LOGS=fxsplit`` (INFO: one line per compiled graph) and
``TORCH_LOGS=+fxsplit`` (DEBUG) work and ``TORCH_LOGS=help`` lists it.
"""

from __future__ import annotations

import logging

import torch

from fxsplit.plan_json import compiled_dict, dumps_json, piece_source, plan_dict

__all__ = ["LOGGER_NAME", "emit_plan", "register_log"]

LOGGER_NAME = "fxsplit"

log = logging.getLogger(LOGGER_NAME)


def register_log() -> bool:
    """Register the ``fxsplit`` logger as a ``TORCH_LOGS`` setting named ``fxsplit``.

    Uses ``torch._logging._internal.register_log(setting_name, log_name)``, a private API present
    in torch 2.11 to 2.14. Torch 2.13 also accepts any importable module name in ``TORCH_LOGS``, so
    ``TORCH_LOGS=fxsplit`` works there even without this; registering makes it explicit and lists
    it under ``TORCH_LOGS=help``. Like torch's own loggers, once torch (re)applies its log settings
    (at import with ``TORCH_LOGS`` set, or on ``torch._logging.set_logs``) the ``fxsplit`` logger
    gets torch's stderr handler and stops propagating to the root logger.

    Returns:
        True if registered; False where this torch has no such API (nothing else changes).
    """
    try:
        internal = torch._logging._internal
        internal.register_log(LOGGER_NAME, LOGGER_NAME)
    except AttributeError:
        # Private API: absent or renamed in some torch release. TORCH_LOGS then still reaches the
        # logger through its module name where torch supports that; plain `logging` always works.
        return False
    return True


def emit_plan(split) -> None:
    """Emit ``split``'s plan and piece code as structured-trace artifacts (see module docstring).

    Args:
        split: a :class:`fxsplit.passes.Split` (what the backend produced for one graph).

    Never raises for a missing trace handler: without ``TORCH_TRACE`` nothing is built or written.
    """
    trace_structured = torch._logging.trace_structured
    graph_id = split.plan.graph_id
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"fxsplit_plan_{graph_id}", "encoding": "json"},
        payload_fn=lambda: dumps_json(plan_dict(split)),
    )
    for each in split.pieces:
        piece, module = each.plan, each.module
        trace_structured(
            "artifact",
            metadata_fn=lambda piece=piece: {
                "name": f"fxsplit_{graph_id}_{piece.name}",
                "encoding": "string",
            },
            payload_fn=lambda piece=piece, module=module: piece_source(piece, module.code),
        )
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"fxsplit_{graph_id}_stitched", "encoding": "string"},
        payload_fn=lambda: split.stitched.code,
    )
    if split.compiled_pieces is not None:  # Inductor traces each compile's own artifacts
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"fxsplit_{graph_id}_compiled", "encoding": "json"},
            payload_fn=lambda: dumps_json(compiled_dict(split.compiled_pieces)),
        )


register_log()
