"""Graph hooks: how a tool sees every graph the backend builds, without the backend importing it.

A hook is called once per compiled graph, after the split and before the graph first runs, with a
:class:`BuiltGraph`. It may return a *finisher*: a callable taking nothing, which the backend
calls at :meth:`fxsplit.Backend.write_runtime_stats`, at its reset and at process exit (the dump
writes each graph's run-time figures there).

The dump (:mod:`fxsplit.tools.dump`) registers its hook when imported; the modules named in
:data:`TOOLS` are imported at the first graph, so the compile and run-time modules import no tool.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fxsplit.config import Config
    from fxsplit.runtime.step.graph_runtime import GraphRuntime
    from fxsplit.split_result import Split

__all__ = ["TOOLS", "BuiltGraph", "built", "register"]

TOOLS = ("fxsplit.tools.dump",)
"""Modules that register hooks when imported; imported at the first graph built."""


@dataclass(frozen=True)
class BuiltGraph:
    """One graph the backend built.

    Attributes:
        split: the :class:`fxsplit.passes.Split`.
        config: the options it was built under.
        graph_code: the Dynamo graph's code before the split edited it; empty unless
            ``config.dump_folder`` is set (taking it costs a code generation).
        example_inputs: what Dynamo passed the backend.
        model: what was compiled (the root module's class or the function's name), or None.
        runtime: its :class:`~fxsplit.runtime.step.graph_runtime.GraphRuntime`, or None where
            nothing is captured or checked.
    """

    split: Split
    config: Config
    graph_code: str
    example_inputs: Sequence[object]
    model: str | None
    runtime: GraphRuntime | None


Hook = Callable[[BuiltGraph], "Callable[[], None] | None"]

_HOOKS: list[Hook] = []
_loaded = False


def register(hook: Hook) -> None:
    """Call ``hook`` for every graph built from now on (once, however often registered)."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)


def built(graph: BuiltGraph) -> list[Callable[[], None]]:
    """Run every hook on ``graph``; the finishers they returned, in registration order."""
    global _loaded
    if not _loaded:
        _loaded = True
        for name in TOOLS:
            importlib.import_module(name)
    finishers = (hook(graph) for hook in _HOOKS)
    return [finish for finish in finishers if finish is not None]
