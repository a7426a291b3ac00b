"""Module patterns: match nodes to ``module_regions`` / ``eager_modules`` via ``nn_module_stack``.

A pattern is a module class name (``"DeepseekV4Indexer"``) or a glob over the qualified module
path with Dynamo's ``L['self'].`` prefix (``G['model'].`` for a global model) stripped, such as
``"model.layers.*.self_attn"``: ``*`` matches one path component (and globs within one, as in
``"layer*"``), ``**`` any number of them. A pattern of one component with a glob character also
globs class names: ``"*RotaryEmbedding"`` matches ``LlamaRotaryEmbedding`` wherever it sits.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from torch.fx import Node

_LOCAL_PREFIX = re.compile(r"^[LG]\[['\"][^'\"]+['\"]\]\.?")
_INDEX = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")
_MODULES = re.compile(r"(^|\.)_modules\.")


def module_path(dynamo_path: str) -> str:
    """``"L['self'].model.layers[0]._modules['attn']"`` -> ``"model.layers.0.attn"``."""
    path = _LOCAL_PREFIX.sub("", dynamo_path)
    path = _INDEX.sub(r".\1", path)
    return _MODULES.sub(r"\1", path).strip(".")


def _class_match(pattern: str, names: set) -> bool:
    """Whether ``pattern`` names one of the class ``names`` or, holding no dot, globs one."""
    if pattern in names:
        return True
    if "." in pattern or not any(c in pattern for c in "*?["):
        return False
    return any(isinstance(n, str) and fnmatch.fnmatchcase(n, pattern) for n in names)


def _glob(pattern: tuple[str, ...], path: tuple[str, ...]) -> bool:
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_glob(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], head) and _glob(rest, path[1:])


class ModuleMatcher:
    """Maps a node's enclosing modules to the patterns (and their values) they match.

    Args:
        patterns: pattern -> value (a region name for ``module_regions``, anything for
            ``eager_modules``). Matching is cached per (path, class) pair.
    """

    def __init__(self, patterns: dict[str, str] | Iterable[str]):
        items = patterns.items() if isinstance(patterns, dict) else ((p, p) for p in patterns)
        self._patterns = [(p, tuple(p.split(".")), v) for p, v in items]
        self._cache: dict[tuple[str, type], tuple[tuple[str, str], ...]] = {}
        self.used: set[str] = set()
        self.root_hits: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self._patterns)

    @property
    def patterns(self) -> list[str]:
        """Every configured pattern, in order."""
        return [p for p, _, _ in self._patterns]

    def set_root(self, cls: type | None) -> None:
        """The compiled module's own class: Dynamo's ``nn_module_stack`` leaves the root out, so
        a class pattern naming it matches every node of the graph."""
        if cls is None:
            self.root_hits = ()
            return
        names = {cls.__name__, cls.__qualname__}
        self.root_hits = tuple((p, v) for p, _, v in self._patterns if _class_match(p, names))
        self.used.update(p for p, _ in self.root_hits)

    def match(self, node: Node) -> list[tuple[str, str]]:
        """``(pattern, value)`` for every pattern an enclosing module of ``node`` (the compiled
        root module included, see :meth:`set_root`) matches."""
        stack = node.meta.get("nn_module_stack")
        found: list[tuple[str, str]] = list(self.root_hits)
        if not stack:
            return found
        for entry in stack.values():
            try:
                hits = self._cache[entry]
            except KeyError:
                hits = self._cache[entry] = self._match_entry(*entry)
            except TypeError:  # unhashable entry
                hits = self._match_entry(*entry)
            for hit in hits:
                if hit not in found:
                    found.append(hit)
        return found

    def _match_entry(self, dynamo_path: str, cls: object) -> tuple[tuple[str, str], ...]:
        path = tuple(module_path(dynamo_path).split("."))
        names = {getattr(cls, "__name__", None), getattr(cls, "__qualname__", None)}
        if isinstance(cls, str):
            names.add(cls.rpartition(".")[2])
        hits = []
        for pattern, parts, value in self._patterns:
            if _class_match(pattern, names) or _glob(parts, path):
                hits.append((pattern, value))
                self.used.add(pattern)
        return tuple(hits)
