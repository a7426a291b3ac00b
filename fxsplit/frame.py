"""The Python frame a graph was compiled from (a :class:`Frame`), read from Dynamo's tracer at
compile time: its argument names, whether Dynamo resumed it after a graph break or eager model
code called it, its module, and the outputs Dynamo stores as the module's state.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

__all__ = ["Frame", "read_frame"]

log = logging.getLogger("fxsplit")


@dataclass(frozen=True)
class Frame:
    """The Python frame a graph was compiled from.

    Attributes:
        arg_names: its argument names in signature order (where the size input is looked up).
        resumed: a frame Dynamo resumes after a graph break: its arguments are the live values
            of the model at the break, not tensors the caller handed in.
        root: the class of the ``nn.Module`` whose method the frame runs, if any.
        model: the root's class name, else the function's name (for dump folder names).
        nested: a frame called by model code that runs eagerly (Dynamo gave up on an enclosing
            frame: a graph break, a recompile limit): its arguments were computed by the model,
            not handed in by the caller.
        state_outputs: positions of the graph's outputs that Dynamo stores into a module's
            parameters or buffers after the call (``self.t = <output>``): the model's state,
            read back at its next call.
    """

    arg_names: tuple[str, ...]
    resumed: bool = False
    root: type | None = None
    model: str | None = None
    nested: bool = False
    state_outputs: frozenset[int] = frozenset()

    @property
    def model_values(self) -> bool:
        """Its tensor arguments are the model's own values (resumed or nested), fxsplit's to
        copy under every binding."""
        return self.resumed or self.nested

    @property
    def entered(self) -> bool:
        """Compiled from the frame the caller entered: its call starts a step of the model."""
        return not self.model_values


def read_frame(gm: GraphModule) -> Frame | None:
    """The frame Dynamo is compiling into ``gm`` (the backend runs inside Dynamo's translation
    of it, or right after it under ``aot_compile``); None outside Dynamo or where its internals
    differ."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code = tx.f_code
        receiver = tx.f_locals.get("self")
    except Exception:  # not under Dynamo's tracer: aot_compile, a direct call, another torch
        return _precompiled_frame()
    count = code.co_argcount + code.co_kwonlyargcount
    # Dynamo names the functions that resume a frame after a graph break this way.
    resumed = code.co_name.startswith("torch_dynamo_resume_in_")
    if not isinstance(receiver, torch.nn.Module):
        receiver = _method_owner(code, tx.f_locals)
    root = type(receiver) if isinstance(receiver, torch.nn.Module) else None
    name = root.__name__ if root is not None else code.co_name
    if resumed:  # torch_dynamo_resume_in_<function>_at_<line>
        name = root.__name__ if root is not None else name.split("_in_", 1)[1].rsplit("_at_")[0]
    return Frame(
        tuple(code.co_varnames[:count]),
        resumed,
        root,
        name,
        _called_by_eager_code(),
        _state_outputs(tx, gm),
    )


def _state_outputs(tx, gm: GraphModule) -> frozenset[int]:
    """Positions of ``gm``'s outputs that Dynamo's side effects store after the graph runs: into
    a module's parameters or buffers (``self.t = <output>`` mutates the module's ``_buffers``),
    or as an attribute of any object (a cache made inside the call: ``layer.keys =
    torch.zeros(...)``); empty where Dynamo's internals differ."""
    try:
        outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
        position = {node: i for i, node in enumerate(outputs) if isinstance(node, torch.fx.Node)}
        side_effects = tx.output.side_effects
        stored = [
            v for values in side_effects.store_attr_mutations.values() for v in values.values()
        ]
        for var in side_effects._get_modified_vars():
            if getattr(var.source, "member", None) in ("_buffers", "_parameters"):
                stored.extend(var.items.values())
        found = set()
        for value in stored:
            node = getattr(getattr(value, "proxy", None), "node", None)
            if node in position:
                found.add(position[node])
    except Exception as error:  # another torch's internals: learnt at run time instead
        log.debug("fxsplit: Dynamo's side effects not read (%s): %s", type(error).__name__, error)
        return frozenset()
    return frozenset(found)


def _method_owner(code, f_locals) -> torch.nn.Module | None:
    """The module whose method the frame runs where its receiver is not called ``self``: the
    frame's first argument, or the first of its ``*args`` (transformers wraps ``forward`` in
    decorators taking ``*args``), when that module's class defines a function with this code."""
    if code.co_argcount:
        first = f_locals.get(code.co_varnames[0])
    elif code.co_flags & inspect.CO_VARARGS:
        packed = f_locals.get(code.co_varnames[code.co_kwonlyargcount])
        first = packed[0] if isinstance(packed, tuple) and packed else None
    else:
        return None
    if not isinstance(first, torch.nn.Module):
        return None
    for cls in type(first).__mro__:
        if any(getattr(f, "__code__", None) is code for f in vars(cls).values()):
            return first
    return None


def _precompiled_frame() -> Frame | None:
    """The frame ``torch._dynamo.aot_compile.aot_compile_fullgraph`` (on the stack) compiles:
    its ``model`` argument, a function or a bound method."""
    try:
        from torch._dynamo.aot_compile import aot_compile_fullgraph
    except ImportError:
        return None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not aot_compile_fullgraph.__code__:
        frame = frame.f_back
    fn = frame.f_locals.get("model") if frame is not None else None
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return None
    receiver = getattr(fn, "__self__", None)
    root = type(receiver) if isinstance(receiver, torch.nn.Module) else None
    count = code.co_argcount + code.co_kwonlyargcount
    name = root.__name__ if root is not None else code.co_name
    return Frame(tuple(code.co_varnames[:count]), False, root, name, False)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


_DYNAMO_DIR = os.path.join(_TORCH_DIR, "_dynamo") + os.sep


_ENTRY = os.path.join(_DYNAMO_DIR, "eval_frame.py")


def _called_by_eager_code() -> bool:
    """Whether the frame Dynamo is compiling was called by code outside torch running eagerly.

    The Python stack at compile time holds the callers of that frame: from the outside in, the
    ``torch.compile`` wrapper (``torch/_dynamo/eval_frame.py``), the callers of the compiled
    frame, then Dynamo's own frames. For the frame the caller entered through, the callers in
    between are torch's (``nn.Module.__call__``); for a frame Dynamo compiles inside a frame it
    gave up on (a graph break, a recompile limit), model code runs eagerly in between.
    """
    stack = []
    frame = sys._getframe(1)
    while frame is not None:
        stack.append(frame.f_code.co_filename)
        frame = frame.f_back
    stack.reverse()  # outermost first
    entry = None
    for i, filename in enumerate(stack):
        if filename == _ENTRY:
            entry = i
        elif filename.startswith(_DYNAMO_DIR):
            break
    else:
        return False
    callers = stack[entry + 1 : i] if entry is not None else []
    return any(not f.startswith(_TORCH_DIR) for f in callers)
