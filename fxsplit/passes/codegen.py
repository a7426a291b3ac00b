"""Piece code generation: Python source for a piece, emitted straight from the original nodes.

Building a fresh ``torch.fx.Graph`` per piece and generating its code through fx costs several
times fx's own code generation for the whole graph (node copies, name allocation, per-graph code
objects). This emitter writes one function per piece from the original nodes, reuses their
(unique) names, frees each value after its last use inside the piece, and compiles all pieces
of a graph with one ``compile()`` call. Targets that are not reachable as ``torch.*`` or
``operator.*`` and constants without a literal form are passed in as globals of the generated
module.
"""

from __future__ import annotations

import linecache
import math
import operator
from collections.abc import Callable, Iterable

import torch
from torch.fx import Node

_RESERVED = frozenset({"torch", "operator", "slice", "None", "True", "False"})
# Constants whose repr identifies their value (NaN included, unlike ==).
_VALUE_KEYED = frozenset({float, complex, torch.Size, torch.dtype, torch.device, torch.layout})


class Codegen:
    """Emits and compiles the functions of one graph's pieces.

    Args:
        taken: every node name of the graph (generated global names avoid them).
        root: the module ``call_module`` targets are looked up in.
    """

    def __init__(self, taken: Iterable[str], root: torch.nn.Module | None = None):
        self._taken = set(taken)
        self._root = root
        self.globals: dict[str, object] = {"torch": torch, "operator": operator}
        self._exprs: dict[int, str] = {}
        self._keep: list[object] = []  # keeps ids in _exprs valid
        self._clash = not _RESERVED.isdisjoint(self._taken)
        self._local: dict[Node, str] | None = None

    def name(self, node: Node) -> str:
        """The local name of ``node`` in the function being emitted."""
        return node.name if self._local is None else self._local[node]

    def _global(self, value: object, hint: str) -> str:
        base = "".join(c if c.isalnum() else "_" for c in hint).strip("_") or "c"
        name = f"_{base}"
        i = 0
        while name in self.globals or name in self._taken:
            i += 1
            name = f"_{base}_{i}"
        self.globals[name] = value
        return name

    def target(self, target: object) -> str:
        """Name of the global a call_function target is bound to: ``_<its __name__>``.

        A global name instead of ``torch._C._nn.linear``-style attribute chains: fewer tokens to
        compile, one dict lookup per call instead of several attribute lookups.
        """
        key = id(target)
        expr = self._exprs.get(key)
        if expr is None:
            expr = self._exprs[key] = self._global(target, getattr(target, "__name__", "fn"))
            self._keep.append(target)
        return expr

    def arg(self, a: object) -> str:
        """Python expression for a node argument."""
        if isinstance(a, Node):
            return self.name(a)
        if a is None or a is True or a is False or type(a) in (int, str):
            return repr(a)
        if type(a) is float:
            return repr(a) if math.isfinite(a) else self._constant(a)
        if isinstance(a, torch.dtype) and not self._clash:
            return str(a)
        if isinstance(a, torch.Size):
            return self._constant(a)
        if isinstance(a, tuple):
            inner = ", ".join(self.arg(x) for x in a)
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        if isinstance(a, list):
            return "[" + ", ".join(self.arg(x) for x in a) + "]"
        if isinstance(a, dict) and all(type(k) is str for k in a):
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.arg(a.start)}, {self.arg(a.stop)}, {self.arg(a.step)})"
        return self._constant(a)

    def _module(self, module: torch.nn.Module, path: str) -> str:
        key = id(module)
        if key not in self._exprs:
            self._exprs[key] = self._global(module, path)
            self._keep.append(module)
        return self._exprs[key]

    def _constant(self, value: object) -> str:
        # Equal immutable constants share one global, so pieces that differ only in which
        # copy of ``-inf`` they hold get the same source (and share one function).
        key: object = id(value)
        if type(value) in _VALUE_KEYED:
            key = (type(value), repr(value))
        expr = self._exprs.get(key)
        if expr is None:
            self._keep.append(value)
            expr = self._exprs[key] = self._global(value, type(value).__name__)
        return expr

    def call(self, node: Node) -> str:
        """Expression computing ``node``."""
        arg = self.arg
        args = [arg(a) for a in node.args]
        if node.kwargs:
            args += [f"{k}={arg(v)}" for k, v in node.kwargs.items()]
        op = node.op
        if op == "call_function":
            return f"{self.target(node.target)}({', '.join(args)})"
        if op == "call_method":
            return f"{args[0]}.{node.target}({', '.join(args[1:])})"
        if op == "call_module":
            module = self._root.get_submodule(node.target)
            return f"{self._module(module, node.target)}({', '.join(args)})"
        raise AssertionError(f"cannot emit a {op} node inside a piece")

    def function(
        self,
        name: str,
        nodes: list[Node],
        inputs: list[Node],
        outputs: list[Node],
        around: Callable[[Codegen], tuple[list[str], list[str]]] | None = None,
        local: Iterable[Node] = (),
        canonical: bool = False,
    ) -> str:
        """Source of ``def name(inputs): ...; return outputs``.

        Args:
            around: called once names are assigned; returns the prologue and epilogue lines.
            local: nodes of other pieces the prologue re-creates (block enters).
            canonical: name inputs ``a0, a1, ...`` and values ``v0, v1, ...`` instead of by
                node, so structurally identical pieces get identical source.
        """
        if canonical:
            self._local = {n: f"a{i}" for i, n in enumerate(inputs)}
            self._local.update((n, f"v{i}") for i, n in enumerate((*local, *nodes)))
        try:
            return self._function(name, nodes, inputs, outputs, around)
        finally:
            self._local = None

    def _function(self, name, nodes, inputs, outputs, around) -> str:
        local = self.name
        prologue, epilogue = around(self) if around is not None else ((), ())
        keep = set(outputs)
        frees: dict[Node, list[str]] = {}
        seen: set[Node] = set(keep)
        for node in reversed(nodes):
            for a in node._input_nodes:
                if a not in seen:
                    seen.add(a)
                    frees.setdefault(node, []).append(local(a))
        lines = [f"def {name}({', '.join(map(local, inputs))}):"]
        lines += [f"    {line}" for line in prologue]
        for node in nodes:
            expr = self.call(node)
            line = f"{local(node)} = {expr}" if node.users else expr
            dead = frees.get(node)
            if dead:
                line += f";  {' = '.join(dead)} = None"
            lines.append(f"    {line}")
        lines += [f"    {line}" for line in epilogue]
        if not outputs:
            lines.append("    return None")
        elif len(outputs) == 1:
            lines.append(f"    return {local(outputs[0])}")
        else:
            lines.append(f"    return ({', '.join(map(local, outputs))})")
        return "\n".join(lines)

    def compile(self, sources: list[str], filename: str) -> tuple[list[Callable], str]:
        """Compile the functions in one module; returns them in order, and the module source."""
        source = "\n\n\n".join(sources) + "\n"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = dict(self.globals)
        exec(compile(source, filename, "exec"), namespace)
        names = [s[4 : s.index("(")] for s in sources]
        return [namespace[n] for n in names], source
