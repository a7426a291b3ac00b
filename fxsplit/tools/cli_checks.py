"""The ``fxsplit`` command's arguments checked before anything imports torch.

Importing torch (and the user's model module, which imports it) takes seconds, tens of them on a
busy machine: a typo in a flag, ``MODULE:FACTORY``, ``--options`` or ``--runner`` is answered
before that, in the words :class:`fxsplit.config.Config` would use. This module imports nothing
heavy, so it holds the few facts it needs itself (the option names, the values of the options
with a fixed set of them, the built-in runners); ``tests/test_cli_checks.py`` keeps them equal to
``fxsplit.config`` and ``fxsplit.runners``, whose full validation still runs after the import.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any


class UsageError(Exception):
    """A bad command line (MODULE:FACTORY, --options, --runner); reported in one line, exit
    status 2."""


OPTION_NAMES = (
    "runner",
    "eager_regions",
    "splitting_ops",
    "module_regions",
    "eager_modules",
    "presets",
    "capture",
    "capture_sizes",
    "size_input",
    "max_captured_keys",
    "warmup_runs",
    "input_binding",
    "on_capture_error",
    "verify",
    "clone_outputs",
    "dump_dir",
    "compile_pieces",
    "compile_sizes",
    "cache_dir",
    "check_ranks",
)
CHOICES = {
    "capture": ("auto", "cuda", "emulate", "off"),
    "compile_pieces": ("auto", "inductor", "eager"),
    "input_binding": ("copy", "strict", "trust"),
    "on_capture_error": ("fallback", "raise"),
}
BUILTIN_RUNNERS = ("v1", "v2")


def _is_module(name: str) -> bool:
    """Whether ``name`` is an importable module (found without importing it; its parent
    packages are imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_factory(spec: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``MODULE:FACTORY``.

    Raises:
        UsageError: no colon, or nothing on one side of it.
    """
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        hint = ""
        if not sep and _is_module(spec):  # the factory left out
            hint = f"; {spec} is a module: name a function in it that returns the model"
        elif not sep and "." in spec:  # mymodel.example: the last dot meant as the colon
            head, _, tail = spec.rpartition(".")
            hint = f"; did you mean {head}:{tail}?"
        raise UsageError(
            f"expected MODULE:FACTORY (e.g. fxsplit.models.deepseek_v4:example), got {spec!r}{hint}"
        )
    return module, attr


def check_options(text: str | None) -> dict:
    """The ``--options`` JSON object, its keys and the values that need no torch to judge
    checked (every value is checked again, fully, by ``Config`` after the import).

    Raises:
        UsageError: not JSON, not an object, an unknown key, a value not allowed.
    """
    try:
        options = json.loads(text) if text else {}
    except json.JSONDecodeError as error:
        raise UsageError(f"--options is not valid JSON: {error}") from None
    if not isinstance(options, dict):
        raise UsageError(f"--options must be a JSON object, got {text!r}")
    unknown = sorted(k for k in options if k not in OPTION_NAMES)
    if unknown:
        close = [m for k in unknown for m in difflib.get_close_matches(k, OPTION_NAMES, n=1)]
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise UsageError(
            f"bad fxsplit options: unknown fxsplit option {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(OPTION_NAMES)}{hint}"
        )
    for key, value in options.items():
        problem = _problem(key, value)
        if problem:
            raise UsageError(f"bad fxsplit options: fxsplit option {problem}")
    return options


def check_runner(name: str, module: str) -> None:
    """A ``--runner`` name: a built-in one, or one the factory's ``module`` may register (its
    source names it; the registry, after the import, has the last word).

    Raises:
        UsageError: neither; the message names the built-in runners and a close one.
    """
    if name in BUILTIN_RUNNERS or _source_names(module, name):
        return
    close = difflib.get_close_matches(name.strip().lower(), BUILTIN_RUNNERS, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UsageError(
        f"unknown runner {name!r} (not built in, and module {module}, which could register "
        f"it, never names it); built-in runners: {', '.join(BUILTIN_RUNNERS)}{hint}"
    )


def unknown_command(name: str, commands: list[str]) -> str:
    """argparse's message for a command that is not one of ``commands``, with the command meant
    where one is close (argparse before Python 3.14 suggests none)."""
    close = difflib.get_close_matches(name, commands, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listed = ", ".join(map(repr, commands))
    return f"argument command: invalid choice: {name!r} (choose from {listed}){hint}"


def unknown_arguments(unknown: list[str], flags: list[str]) -> str:
    """argparse's message for the arguments no option of the command takes, with the flag
    meant for each unknown one close to one of ``flags`` (argparse suggests close values of
    choices, never close flags).

    Args:
        unknown: the arguments argparse left over, in command-line order.
        flags: every option string of the command (``--runner``, ``-h``, ...).
    """
    meant: dict[str, str] = {}
    for arg in unknown:
        name = arg.partition("=")[0]
        if name.startswith("-"):
            close = difflib.get_close_matches(name, flags, n=1)
            if close:
                meant[name] = close[0]
    message = f"unrecognized arguments: {' '.join(unknown)}"
    if len(meant) == 1:
        return f"{message}; did you mean {next(iter(meant.values()))}?"
    if meant:
        each = ", ".join(f"{flag} for {name}" for name, flag in meant.items())
        return f"{message}; did you mean {each}?"
    return message


def _problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` for ``key``, as ``Config`` says it, where that needs no
    torch; None otherwise."""
    optional = key == "input_binding" and value is None  # the runner's default
    if key in CHOICES and not optional:
        choices = CHOICES[key]
        listed = ", ".join(map(repr, choices))
        if not isinstance(value, str):
            return f"{key}={value!r} has type {type(value).__name__}; expected one of {listed}"
        if value not in choices:
            close = difflib.get_close_matches(value.strip().lower(), choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            return f"{key}={value!r} is not allowed; choose one of {listed}{hint}"
    if key == "capture_sizes" and value == []:
        return (
            f"{key}=[] would capture nothing; list at least one size, pass None to capture "
            "every size seen, or capture='off'"
        )
    if key in ("capture_sizes", "compile_sizes") and value not in (None, []):
        return _sizes_problem(key, value)
    return None


def _sizes_problem(key: str, value: Any) -> str | None:
    if not isinstance(value, list):
        expected = "a list of positive ints"
        return f"{key}={value!r} has type {type(value).__name__}; expected {expected}"
    seen: set[int] = set()
    for size in value:
        if isinstance(size, bool) or not isinstance(size, int):
            return f"{key} holds {size!r}; every entry must be an int"
        if size <= 0:
            return f"{key} holds {size!r}; every entry must be a positive int (a token count)"
        if size in seen:
            return f"{key} holds {size!r} twice; sizes must be unique"
        seen.add(size)
    return None


def _source_names(module: str, name: str) -> bool:
    """Whether the source file of ``module`` (found on ``sys.path`` and the current folder,
    without importing it or its packages) holds ``name`` quoted."""
    parts = module.split(".")
    for root in [os.getcwd(), *sys.path]:
        base = Path(root or os.getcwd(), *parts)
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            return f'"{name}"' in text or f"'{name}'" in text
    return False
