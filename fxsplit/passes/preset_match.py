"""Match FX nodes against region presets (:mod:`fxsplit.presets`)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch.fx import Graph, Node

from fxsplit import presets as builtin
from fxsplit.facts.ops import OpMatcher
from fxsplit.passes import attention_pattern
from fxsplit.passes.modules import ModuleMatcher

# A frame of the stack Dynamo records per node: ``File "m.py", line 12, in _prepare_and_attn``.
_FRAME = re.compile(r'File "[^"]*", line \d+, in (\w+)')


class PresetMatcher:
    """Which presets a node matches, by op, by enclosing module and by enclosing method.

    Args:
        presets: in matching order; where two presets list the same op name or module pattern,
            the first one wins.
    """

    def __init__(self, presets: Iterable[builtin.Preset]):
        self._by_op: dict[str, builtin.Preset] = {}
        self._by_pattern: dict[str, builtin.Preset] = {}
        self._by_method: dict[tuple[str, str], builtin.Preset] = {}
        presets = tuple(presets)
        attention = builtin.EAGER_ATTENTION
        self._attention = attention if attention in presets else None
        self._found: set[Node] = set()
        for preset in presets:
            for name in preset.ops:
                self._by_op.setdefault(name, preset)
            for pattern in preset.modules:
                self._by_pattern.setdefault(pattern, preset)
            for name in preset.methods:
                owner, _, method = name.rpartition(".")
                self._by_method.setdefault((owner, method), preset)
        self._ops = OpMatcher(self._by_op)
        self._modules = ModuleMatcher({p: p for p in self._by_pattern})
        self._owners = ModuleMatcher({owner: owner for owner, _ in self._by_method})
        self._frames: dict[str, frozenset[str]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_op or self._by_pattern or self._by_method or self._attention)

    def prepare(self, graph: Graph) -> None:
        """Find what the graph-shaped presets match in ``graph`` (attention written as ops:
        :mod:`fxsplit.passes.attention_pattern`), before :meth:`match` is asked per node."""
        self._found = attention_pattern.find(graph) if self._attention is not None else set()

    def set_root(self, cls: type | None) -> None:
        """The compiled module's own class (see :meth:`ModuleMatcher.set_root`)."""
        self._modules.set_root(cls)
        self._owners.set_root(cls)

    def match(self, node: Node, *, ops: bool = True, modules: bool = True) -> list[builtin.Preset]:
        """The presets ``node`` matches: by its op (when ``ops``) and by its enclosing modules
        (when ``modules``), each preset once, op matches first."""
        found: list[builtin.Preset] = []
        if ops and node in self._found:
            found.append(self._attention)
        if ops and self._by_op:
            name = self._ops.match(node)
            if name is not None:
                found.append(self._by_op[name])
        if modules and self._by_pattern:
            for pattern, _ in self._modules.match(node):
                preset = self._by_pattern[pattern]
                if preset not in found:
                    found.append(preset)
        if modules and self._by_method:
            for preset in self._methods(node):
                if preset not in found:
                    found.append(preset)
        return found

    def _methods(self, node: Node) -> list[builtin.Preset]:
        """Method presets whose class encloses ``node`` and whose method is on its stack."""
        owners = [owner for owner, _ in self._owners.match(node)]
        if not owners:
            return []
        trace = node.meta.get("stack_trace") or ""
        frames = self._frames.get(trace)
        if frames is None:
            frames = self._frames[trace] = frozenset(_FRAME.findall(trace))
        return [
            preset
            for (owner, method), preset in self._by_method.items()
            if owner in owners and method in frames
        ]
