"""fxsplit's warnings: their classes, the line of user code they name, and the test suite's
filter that makes an unexpected one an error."""

from __future__ import annotations

import pytest
import torch

import fxsplit
from fxsplit import warn
from tests.warned import warned_at


def test_classes():
    assert issubclass(fxsplit.FxsplitWarning, UserWarning)
    assert issubclass(fxsplit.FxsplitRuntimeWarning, fxsplit.FxsplitWarning)
    assert issubclass(fxsplit.FxsplitRuntimeWarning, RuntimeWarning)


def test_an_unexpected_fxsplit_warning_fails_the_test_suite():
    with pytest.raises(fxsplit.FxsplitWarning, match="unexpected"):  # pyproject's filter
        warn.warn_at_caller("unexpected")


def test_outside_compiled_code_names_the_caller():
    with pytest.warns(fxsplit.FxsplitWarning) as seen:
        warn.warn_at_caller("here")
    assert warned_at(seen) == [("test_warn.py", 'warn.warn_at_caller("here")')]


@torch.compiler.disable
def _warns_from_model_code(x, how):
    how("from model code")  # runs eagerly, inside the compiled call
    return x


def _model(x, how):
    return _warns_from_model_code(x.sin(), how) * 2


def test_inside_compiled_code_names_the_call_of_the_compiled_model():
    compiled = torch.compile(_model, backend="eager")
    with pytest.warns(fxsplit.FxsplitWarning) as seen:
        compiled(torch.randn(3), warn.warn_at_caller)
    assert warned_at(seen) == [("test_warn.py", "compiled(torch.randn(3), warn.warn_at_caller)")]


def test_in_model_code_names_the_model_code():
    compiled = torch.compile(_model, backend="eager")
    with pytest.warns(fxsplit.FxsplitWarning) as seen:
        compiled(torch.randn(3), warn.warn_in_model_code)
    line = 'how("from model code")  # runs eagerly, inside the compiled call'
    assert warned_at(seen) == [("test_warn.py", line)]


def test_size_input_naming_no_argument_warns_at_the_compiling_call():
    def f(tokens):
        return tokens.sin() * 2

    backend = fxsplit.Backend(
        capture="emulate", capture_sizes=[4], size_input="nope", eager_regions=[]
    )
    compiled = torch.compile(f, backend=backend, dynamic=True)
    with pytest.warns(fxsplit.FxsplitWarning, match="size_input='nope' names no") as seen:
        compiled(torch.randn(4, 3))
    assert warned_at(seen) == [("test_warn.py", "compiled(torch.randn(4, 3))")]
