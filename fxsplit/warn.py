"""fxsplit's warnings, attributed to the user's line.

fxsplit warns from deep inside Dynamo (at compile time) or from inside a compiled model's call,
where ``warnings.warn``'s fixed ``stacklevel`` lands on a frame of torch's or fxsplit's own. Here
the level is computed from the stack at the time of the warning:

* :func:`warn_at_caller` points at the line that called ``torch.compile``'d code (the caller of the
  outermost ``torch/_dynamo/eval_frame.py`` frame), and outside compiled code at the nearest line
  outside fxsplit, torch and the standard library (the call of ``fxsplit.explain``);
* :func:`warn_in_model_code` points at the nearest line outside fxsplit, torch and the standard
  library even inside compiled code: the model code that called fxsplit (``fxsplit.region``).

Where fxsplit itself calls the model (the ``fxsplit dump`` / ``diff`` commands), the line that
called compiled code is fxsplit's, and the nearest one outside is the ``fxsplit`` script:
:func:`attributed_to` names the user's own location (the factory in the model's file) for the
warnings :func:`warn_at_caller` gives inside its block.

``skip_file_prefixes`` (Python 3.12+) would do the second, not the first; fxsplit supports 3.10.
This module imports nothing heavy: pytest's ``filterwarnings`` imports it to resolve
:class:`FxsplitWarning`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import sysconfig
import types
import warnings
from collections.abc import Iterator

__all__ = [
    "FxsplitRuntimeWarning",
    "FxsplitWarning",
    "attributed_to",
    "warn_at_caller",
    "warn_in_model_code",
]


class FxsplitWarning(UserWarning):
    """Base class of every warning fxsplit issues (an option that matches nothing, a size that
    never captures, ...); ``warnings.filterwarnings("error", category=fxsplit.FxsplitWarning)``
    turns them all into errors."""


class FxsplitRuntimeWarning(FxsplitWarning, RuntimeWarning):
    """A warning about what happened at run time (a region that ran eagerly inside
    ``torch.compile``, a cached piece that could not be loaded)."""


_FXSPLIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    file = getattr(torch, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) + os.sep if file else None


# Code compiled at run time: fxsplit's pieces, torch.fx's graph modules, importlib's bootstrap.
_GENERATED = ("<fxsplit ", "<eval_with_key>", "<frozen ")


def _is_library(filename: str, torch_dir: str | None) -> bool:
    """A frame of fxsplit, torch or the standard library (never the user's)."""
    if filename.startswith("<"):
        return filename.startswith(_GENERATED)
    path = os.path.abspath(filename)
    if path.startswith(_FXSPLIT_DIR) or (torch_dir is not None and path.startswith(torch_dir)):
        return True
    # A stdlib frame (contextlib, functools); site-packages may sit under the stdlib folder.
    return path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path


def _outside(frame: types.FrameType | None, torch_dir: str | None) -> types.FrameType | None:
    while frame is not None and _is_library(frame.f_code.co_filename, torch_dir):
        frame = frame.f_back
    return frame


def _compile_entry(frame: types.FrameType | None, torch_dir: str | None):
    """The outermost frame of torch.compile's wrapper (``torch/_dynamo/eval_frame.py``)."""
    if torch_dir is None:
        return None
    entry_file = os.path.join(torch_dir, "_dynamo", "eval_frame.py")
    entry = None
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == entry_file:
            entry = frame
        frame = frame.f_back
    return entry


def _is_internal(frame: types.FrameType) -> bool:
    # warnings.warn skips importlib's bootstrap frames when it counts stacklevel.
    filename = frame.f_code.co_filename
    return "importlib" in filename and "_bootstrap" in filename


def _stacklevel(start: types.FrameType, target: types.FrameType | None) -> int:
    """The ``stacklevel`` that makes ``warnings.warn`` called from ``start`` name ``target``
    (1 where ``target`` is not above ``start``)."""
    level, frame = 1, start
    while target is not None and frame is not None and frame is not target:
        frame = frame.f_back
        if frame is not None and not _is_internal(frame):
            level += 1
    return level if frame is target and target is not None else 1


_LOCATION: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "fxsplit_warning_location", default=None
)


@contextlib.contextmanager
def attributed_to(filename: str, lineno: int) -> Iterator[None]:
    """Within the block, :func:`warn_at_caller` names ``filename:lineno`` (the user's code that
    fxsplit runs on the user's behalf)."""
    token = _LOCATION.set((filename, lineno))
    try:
        yield
    finally:
        _LOCATION.reset(token)


def warn_at_caller(message: str, category: type[Warning] = FxsplitWarning) -> None:
    """Warn with ``message`` at the line that called ``torch.compile``'d code, or outside compiled
    code at the nearest line outside fxsplit, torch and the standard library (where there is
    none: at the caller of this function); inside :func:`attributed_to`, at its location."""
    location = _LOCATION.get()
    if location is not None:
        filename, lineno = location
        module = os.path.splitext(os.path.basename(filename))[0]
        warnings.warn_explicit(message, category, filename, lineno, module=module)
        return
    here = sys._getframe(0)
    entry = target = None
    try:
        torch_dir = _torch_dir()
        entry = _compile_entry(here, torch_dir)
        target = _outside(entry if entry is not None else here, torch_dir)
        if target is None:
            target = here.f_back
        level = _stacklevel(here, target)
    finally:
        # A frame held in its own locals is a reference cycle that would keep every caller's
        # frame, and the values their locals hold (a compiled model's outputs), alive until
        # the next garbage collection.
        del here, entry, target
    warnings.warn(message, category, stacklevel=level)


def warn_in_model_code(message: str, category: type[Warning] = FxsplitWarning) -> None:
    """Warn with ``message`` at the nearest line outside fxsplit, torch and the standard library,
    inside compiled code too: the model code that called fxsplit."""
    here = sys._getframe(0)
    target = None
    try:
        target = _outside(here, _torch_dir()) or here.f_back
        level = _stacklevel(here, target)
    finally:
        del here, target  # see warn_at_caller
    warnings.warn(message, category, stacklevel=level)
