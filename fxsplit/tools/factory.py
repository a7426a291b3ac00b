"""``MODULE:FACTORY`` of ``fxsplit dump`` and ``fxsplit diff``: import the factory, call it, and
answer a misspelt module or factory with the close name that exists.

Imports the user's module (and so torch): :mod:`fxsplit.tools.cli_checks` has judged the form of
the spec before.
"""

from __future__ import annotations

import difflib
import importlib
import os
import pkgutil
import sys
from collections.abc import Mapping

from fxsplit.tools.cli_checks import UsageError, check_factory


def load(spec: str):
    """The callable ``MODULE:FACTORY`` names (the current directory is importable, as with
    ``python -m``).

    Raises:
        UsageError: the module cannot be imported, has no such attribute, or it is not
            callable; a module or factory name close to one that exists is suggested.
    """
    module_name, attr = check_factory(spec)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        hint = _module_hint(module_name, attr, error)
        raise UsageError(f"cannot import module {module_name!r}: {error}{hint}") from None
    factory = module
    for depth, atom in enumerate(attr.split(".")):
        try:
            factory = getattr(factory, atom)
        except AttributeError:
            hint = _attribute_hint(factory, module_name, attr.split("."), depth)
            raise UsageError(f"module {module_name!r} has no attribute {attr!r}{hint}") from None
    if not callable(factory):
        raise UsageError(f"{spec} is not callable (got {type(factory).__name__})")
    return factory


def call(spec: str, factory) -> tuple[object, tuple, dict]:
    """``(model, args, kwargs)`` from ``factory()``, which returns ``(model, example_inputs)``:
    inputs as a tuple or list of arguments, a mapping of keyword arguments, or one argument.

    Raises:
        UsageError: it returned something else.
    """
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise UsageError(f"{spec}() must return (model, example_inputs), got {type(made).__name__}")
    model, inputs = made
    if isinstance(inputs, Mapping):
        return model, (), dict(inputs)
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return model, tuple(inputs), {}


def _did_you_mean(module: str, attr: str) -> str:
    return f"; did you mean {module}:{attr}?"


def _attribute_hint(owner, module: str, atoms: list[str], depth: int) -> str:
    """The spec with ``atoms[depth]`` replaced by the closest callable ``owner`` has, or ""."""
    names = [n for n in dir(owner) if not n.startswith("__") and callable(getattr(owner, n, None))]
    close = difflib.get_close_matches(atoms[depth], names, n=1)
    if not close:
        return ""
    return _did_you_mean(module, ".".join([*atoms[:depth], close[0], *atoms[depth + 1 :]]))


def _module_hint(module: str, attr: str, error: ImportError) -> str:
    """Where the missing module is ``module`` or a package on its way (not a module it
    imports), the spec with that name replaced by the closest one found beside it, or ""."""
    missing = getattr(error, "name", None)
    if not missing or not (module == missing or module.startswith(missing + ".")):
        return ""
    parent, _, leaf = missing.rpartition(".")
    if parent:
        path = getattr(sys.modules.get(parent), "__path__", None)
        if path is None:
            return ""
        names = [m.name for m in pkgutil.iter_modules(path)]
    else:
        names = [m.name for m in pkgutil.iter_modules()]
    close = difflib.get_close_matches(leaf, names, n=1)
    if not close:
        return ""
    return _did_you_mean(f"{parent}.{close[0]}".lstrip(".") + module[len(missing) :], attr)
