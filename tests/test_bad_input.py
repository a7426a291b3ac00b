"""Bad input: every wrong option, name, device or model error gets a precise answer.

Options are checked where they are given (``fxsplit.Backend(...)``) and, for the string backend,
where torch hands them over, with the first graph: the compiled model's call raises fxsplit's
error itself, not torch's ``BackendCompilerFailed``. Inputs and model errors are checked at run
time with the capture emulator.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit import counters
from fxsplit.config import Config
from tests.replays import assert_replayed
from tests.timeouts import scaled
from tests.warned import warned_at

MID = "bad_mid"
VALID_KEYS = [
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
]


pytestmark = pytest.mark.usefixtures("fresh_capture_state")


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes (torch wraps a backend's error in BackendCompilerFailed)."""
    out = []
    while error is not None and len(out) < 10:
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


def _string_backend_error(options) -> BaseException:
    """The error the first call of a model compiled with ``options`` raises, checked to be
    fxsplit's own (no ``BackendCompilerFailed`` around it) and to raise again at the next
    call."""
    model = torch.compile(lambda x: x + 1, backend="fxsplit", options=options)
    with pytest.raises((TypeError, ValueError)) as info:
        model(torch.ones(2))
    with pytest.raises(type(info.value), match=re.escape(str(info.value))):
        model(torch.ones(2))
    return info.value


# ---------------------------------------------------------------------------------------------
# Unknown option keys


def test_unknown_option_key_lists_every_valid_key():
    with pytest.raises(ValueError) as info:
        fxsplit.Backend(runer="v2")
    message = str(info.value)
    assert message.startswith("unknown fxsplit option 'runer'; valid options: ")
    valid, _, hint = message.split("valid options: ")[1].partition("; ")
    assert valid.split(", ") == VALID_KEYS
    assert hint == "did you mean 'runner'?"


def test_several_unknown_keys_are_all_named():
    with pytest.raises(ValueError, match=r"unknown fxsplit option 'a', 'zz'; valid options"):
        fxsplit.Backend(zz=1, a=2, runner="v1")


def test_unknown_option_key_through_the_string_backend_is_the_error_itself():
    error = _string_backend_error({"capture_size": [4]})
    assert type(error) is ValueError
    assert str(error).startswith("unknown fxsplit option 'capture_size'; valid options: runner")
    assert str(error).endswith("; did you mean 'capture_sizes'?")


def test_a_user_of_the_string_backend_reads_the_bad_key_first_without_torchs_footer():
    """As a user's script runs it: the traceback's last line names the key, every valid key
    and the fix; no Dynamo wrapper, no request to report a bug to PyTorch."""
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: x.sin(), backend='fxsplit', options={'runer': 'v2'})\n"
        "f(torch.randn(3))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=scaled(120),
    )
    assert done.returncode == 1
    lines = done.stderr.rstrip("\n").splitlines()
    assert lines[0] == "Traceback (most recent call last):", done.stderr
    assert lines[-1] == (
        f"ValueError: unknown fxsplit option 'runer'; valid options: {', '.join(VALID_KEYS)}; "
        "did you mean 'runner'?"
    )
    assert "PyTorch" not in done.stderr and "BackendCompilerFailed" not in done.stderr
    assert len(lines) < 20, done.stderr


def test_torch_compile_mode_other_than_default_or_reduce_overhead_is_rejected():
    model = torch.compile(lambda x: x + 1, backend="fxsplit", mode="max-autotune")
    with pytest.raises(ValueError) as info:
        model(torch.ones(2))
    assert str(info.value).startswith("fxsplit does not take torch.compile(mode='max-autotune')")
    assert "it takes mode 'default' or 'reduce-overhead'" in str(info.value)


def test_reduce_overhead_mode_is_accepted_and_changes_nothing():
    """transformers' CompileConfig passes mode="reduce-overhead" (CUDA graphs) by default; the
    capture option decides what fxsplit captures, here the emulator."""
    backend = fxsplit.Backend(capture="emulate", eager_regions=[])
    model = torch.compile(lambda x: x.sin() + 1, backend=backend, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4)
            assert torch.equal(model(x), x.sin() + 1)
    assert counters.snapshot()["replays"] == 1


# ---------------------------------------------------------------------------------------------
# Wrong option types and values


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("runner", 2, TypeError, "runner=2 has type int; expected a runner name"),
        ("runner", None, TypeError, "runner=None has type NoneType"),
        ("eager_regions", "attention", TypeError, "eager_regions='attention' has type str"),
        ("eager_regions", ["attention", ""], ValueError, "eager_regions holds ''"),
        ("splitting_ops", "aten::topk", TypeError, "splitting_ops='aten::topk' has type str"),
        ("splitting_ops", ["aten::topk", 3], ValueError, "splitting_ops holds 3"),
        ("module_regions", ["Block"], TypeError, "module_regions=\\['Block'\\] has type list"),
        ("module_regions", {"Block": 1}, ValueError, "module_regions\\['Block'\\]=1"),
        ("module_regions", {"": "attention"}, ValueError, "module_regions has key ''"),
        ("eager_modules", "Block", TypeError, "eager_modules='Block' has type str"),
        ("capture", "gpu", ValueError, "capture='gpu' is not allowed; choose one of 'auto'"),
        # every option with a fixed set of values offers the close one
        ("capture", "emulated", ValueError, "capture='emulated' is not allowed; choose one of "),
        ("capture", "emulated", ValueError, "'off'; did you mean 'emulate'\\?$"),
        ("capture", "Auto", ValueError, "did you mean 'auto'\\?$"),
        ("compile_pieces", "inductr", ValueError, "did you mean 'inductor'\\?$"),
        ("input_binding", "stict", ValueError, "did you mean 'strict'\\?$"),
        ("on_capture_error", "fallbak", ValueError, "did you mean 'fallback'\\?$"),
        ("runner", "v3", ValueError, "unknown runner 'v3'; registered runners: .*did you mean"),
        ("capture", True, TypeError, "capture=True has type bool; expected one of 'auto', "),
        ("capture", 1, TypeError, "capture=1 has type int; expected one of 'auto', 'cuda', "),
        ("input_binding", 2, TypeError, "input_binding=2 has type int; expected one of 'copy'"),
        ("compile_pieces", None, TypeError, "compile_pieces=None has type NoneType; expected"),
        ("on_capture_error", False, TypeError, "on_capture_error=False has type bool"),
        ("max_captured_keys", 1.5, TypeError, "max_captured_keys=1.5 has type float"),
        ("max_captured_keys", True, TypeError, "max_captured_keys=True has type bool"),
        ("max_captured_keys", 0, ValueError, "max_captured_keys=0 must be >= 1"),
        ("warmup_runs", -1, ValueError, "warmup_runs=-1 must be >= 0"),
        ("warmup_runs", "1", TypeError, "warmup_runs='1' has type str"),
        ("input_binding", "cpy", ValueError, "input_binding='cpy' is not allowed"),
        ("on_capture_error", "ignore", ValueError, "on_capture_error='ignore' is not allowed"),
        ("verify", "yes", TypeError, "verify='yes' has type str; expected a bool"),
        ("verify", 1, TypeError, "verify=1 has type int; expected a bool"),
        ("clone_outputs", None, TypeError, "clone_outputs=None has type NoneType"),
        ("dump_dir", 3, TypeError, "dump_dir=3 has type int; expected a folder path"),
        (
            "compile_sizes",
            [0],
            ValueError,
            "^fxsplit option compile_sizes holds 0; every entry "
            "must be a positive int \\(a token count\\)$",
        ),
        ("compile_sizes", [4, -1], ValueError, "compile_sizes holds -1; every entry must be a "),
        ("compile_sizes", [4, 4], ValueError, "compile_sizes holds 4 twice"),
        # falsy values other than None and an empty list were taken for "no sizes"
        ("compile_sizes", 0, TypeError, "compile_sizes=0 has type int; expected a list"),
        ("compile_sizes", "", TypeError, "compile_sizes='' has type str; expected a list"),
        ("compile_sizes", False, TypeError, "compile_sizes=False has type bool; expected a list"),
    ],
)
def test_wrong_option_type_or_value_names_key_and_value(key, value, error, match):
    with pytest.raises(error, match=match):
        fxsplit.Backend(**{key: value})
    with pytest.raises(error, match=match):  # the same validator for options={...}
        Config.from_options({key: value})


def test_wrong_option_type_through_the_string_backend_is_the_error_itself():
    error = _string_backend_error({"verify": "yes"})
    assert type(error) is TypeError
    assert "verify='yes' has type str; expected a bool" in str(error)


# ---------------------------------------------------------------------------------------------
# Unknown runner


def test_unknown_runner_lists_registered_runners_and_the_close_ones():
    with pytest.raises(ValueError) as info:
        fxsplit.Backend(runner="v3")
    names = ", ".join(fxsplit.runners.names())
    assert str(info.value) == (
        f"unknown runner 'v3'; registered runners: {names}; did you mean 'v1' or 'v2'?"
    )


def test_unknown_runner_far_from_every_registered_one_suggests_none():
    with pytest.raises(ValueError) as info:
        fxsplit.Backend(runner="vllm")
    names = ", ".join(fxsplit.runners.names())
    assert str(info.value) == f"unknown runner 'vllm'; registered runners: {names}"


@pytest.mark.parametrize("name", ["V2", " v1", "v2 "])
def test_unknown_runner_close_to_a_registered_one_suggests_it(name):
    with pytest.raises(ValueError, match=rf"; did you mean '{name.strip().lower()}'\?$"):
        fxsplit.Backend(runner=name)


def test_unknown_runner_through_the_string_backend_is_the_error_itself():
    error = _string_backend_error({"runner": "V2"})
    assert type(error) is ValueError and str(error).startswith("unknown runner 'V2'")


# ---------------------------------------------------------------------------------------------
# Malformed op names


@pytest.mark.parametrize(
    "name",
    [
        "topk",
        "aten:topk",
        "aten::",
        "::topk",
        "aten::topk.",
        "aten::top k",
        " aten::topk",
        "aten::topk.default.out",
        "aten.topk",
        "torch.ops.aten.topk",
        "aten::topk::default",
        "1lib::op",
    ],
)
def test_malformed_op_name_is_rejected_with_the_expected_form(name):
    expected = re.escape(f"malformed op name {name!r}; expected 'namespace::op' or ")
    with pytest.raises(ValueError, match=expected):
        fxsplit.Backend(splitting_ops=[name])


@pytest.mark.parametrize("name", ["aten::topk", "aten::topk.default", "my_lib::attn.out"])
def test_well_formed_op_names_are_accepted(name):
    assert fxsplit.Backend(splitting_ops=[name]).config.splitting_ops == (name,)


# ---------------------------------------------------------------------------------------------
# Patterns that match nothing


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    "options",
    [
        {"eager_modules": ["NoSuchBlock"]},
        {"eager_modules": ["layers.*.attn"]},
        {"module_regions": {"model.**.indexer": fxsplit.SPARSE_INDEXER}},
        {"splitting_ops": ["mylib::not_in_this_graph"]},
    ],
)
def test_pattern_matching_nothing_warns_naming_it_once(options):
    (pattern,) = next(iter(options.values()))
    backend = fxsplit.Backend(**options, eager_regions=[])  # Model has no region
    model = torch.compile(Model(), backend=backend, dynamic=False)
    with pytest.warns(fxsplit.FxsplitWarning, match="matched no node") as caught, torch.no_grad():
        model(torch.ones(2, 4))
        assert not warned_at(caught)  # not judged yet
        model(torch.ones(3, 4))  # a recompile
        model(torch.ones(2, 4))  # graph_0 runs again: every graph of the first call is known
        model(torch.ones(3, 4))
    line = "model(torch.ones(2, 4))  # graph_0 runs again: every graph of the first call is known"
    assert warned_at(caught) == [("test_bad_input.py", line)]
    assert repr(pattern) in str(caught[0].message)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"module_regions": {"Blok": "attention"}}, "module_regions pattern 'Blok' matched"),
        ({"eager_modules": ["layers.*.ln"]}, "eager_modules pattern 'layers.*.ln' matched"),
        ({"splitting_ops": ["aten::rellu"]}, "splitting_ops pattern 'aten::rellu' matched"),
    ],
)
def test_pattern_matching_nothing_names_its_option_and_the_closest_name(options, message):
    closest = {"Blok": "Block", "layers.*.ln": "layers.*.lin", "aten::rellu": "aten::relu"}
    model = torch.compile(Model(), backend=fxsplit.Backend(**options, eager_regions=[]))
    with pytest.warns(fxsplit.FxsplitWarning, match="matched no node") as caught, torch.no_grad():
        model(torch.ones(2, 4))
        model(torch.ones(2, 4))
    (text,) = [str(w.message) for w in caught]
    (pattern,) = [p for p in closest if repr(p) in text]
    assert text == (
        f"fxsplit: {message} no node of the graphs compiled so far; "
        f"did you mean {closest[pattern]!r}?"
    )


def test_pattern_matching_nothing_in_two_options_names_both_and_offers_no_far_name():
    options = {"module_regions": {"Zzz": "attention"}, "eager_modules": ["Zzz"]}
    model = torch.compile(Model(), backend=fxsplit.Backend(**options, eager_regions=[]))
    with pytest.warns(fxsplit.FxsplitWarning, match="matched no node") as caught, torch.no_grad():
        model(torch.ones(2, 4))
        model(torch.ones(2, 4))
    assert [str(w.message) for w in caught] == [
        "fxsplit: module_regions / eager_modules pattern 'Zzz' matched no node of the graphs "
        "compiled so far"
    ]


def test_pattern_that_matches_does_not_warn():
    backend = fxsplit.Backend(eager_modules=["Block", "layers.1"])
    model = torch.compile(Model(), backend=backend)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(torch.ones(2, 4))
    assert not [w for w in caught if "matched no node" in str(w.message)]
    assert backend.plans[0].pieces[0].reasons == ("module:Block", "module:layers.1")


@pytest.mark.parametrize("capture", ["off", "emulate"])
def test_pattern_matching_only_after_a_graph_break_does_not_warn(capture):
    def f(x):
        x = x.sin() + 1
        torch._dynamo.graph_break()
        return torch.topk(x, 2).values * 2

    backend = fxsplit.Backend(splitting_ops=["aten::topk"], capture=capture)
    model = torch.compile(f, backend=backend)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(4):
            model(torch.randn(6))
    assert len(backend.plans) == 2
    assert not [str(w.message) for w in caught if "fxsplit" in str(w.message)]


def test_explain_judges_patterns_after_its_one_call():
    options = {"splitting_ops": ["mylib::not_in_this_graph"], "eager_regions": []}
    with pytest.warns(fxsplit.FxsplitWarning, match="matched no node") as caught:
        fxsplit.explain(Model(), torch.ones(2, 4), **options)
    # at the call of explain
    line = "fxsplit.explain(Model(), torch.ones(2, 4), **options)"
    assert warned_at(caught) == [("test_bad_input.py", line)]


# ---------------------------------------------------------------------------------------------
# capture="cuda" without CUDA, and inputs on another device


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_capture_cuda_without_cuda_is_a_clear_error():
    model = torch.compile(lambda x: x * 2, backend=fxsplit.Backend(capture="cuda"))
    with pytest.raises(Exception) as info:
        model(torch.ones(2))
    errors = [e for e in _chain(info.value) if isinstance(e, RuntimeError)]
    assert any(
        "capture='cuda' needs a CUDA or ROCm device, and torch sees none" in str(e)
        and "capture='emulate'" in str(e)
        for e in errors
    ), [str(e) for e in _chain(info.value)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a machine with CUDA")
def test_capture_cuda_with_cpu_tensors_is_a_clear_error():
    model = torch.compile(lambda x: x * 2, backend=fxsplit.Backend(capture="cuda"))
    with pytest.raises(Exception) as info:
        model(torch.ones(2))
    assert any("not on a CUDA device" in str(e) for e in _chain(info.value))


def test_inputs_on_another_device_recompile_instead_of_replaying():
    """Dynamo guards on every input's device, so a tensor on another device than at capture gets
    its own graph (and capture), never a replay of the captured one. A CPU-only machine has no
    second real device; the meta device stands in for it (no values, so shapes are compared)."""

    def f(x):
        h = x.sin() * 2
        with fxsplit.region(MID):
            h = h.cos()
        return h + 1

    backend = fxsplit.Backend(capture="emulate", eager_regions=[MID])
    model = torch.compile(f, backend=backend)
    with torch.no_grad():
        for step in range(3):
            x = torch.full((3,), float(step))
            assert torch.equal(model(x), f(x))
        replays = counters.snapshot()["replays"]
        out = model(torch.ones(3, device="meta"))
        assert out.device.type == "meta" and out.shape == (3,)
        assert len(backend.plans) == 2 and counters.snapshot()["replays"] == replays
        x = torch.full((3,), 7.0)  # back on the CPU: the CPU graph replays, still right
        assert torch.equal(model(x), f(x))
    assert counters.snapshot()["replays"] == replays + 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a machine with CUDA")
def test_cpu_inputs_after_cuda_capture_recompile_and_stay_correct():
    def f(x):
        h = x.sin() * 2
        with fxsplit.region(MID):
            h = h.cos()
        return h + 1

    backend = fxsplit.Backend(eager_regions=[MID])  # capture="auto": CUDA graphs on CUDA
    model = torch.compile(f, backend=backend)
    with torch.no_grad():
        for step in range(3):
            x = torch.full((3,), float(step), device="cuda")
            assert torch.equal(model(x), f(x))
        x = torch.full((3,), 5.0)
        assert torch.equal(model(x), f(x)) and len(backend.plans) == 2


# ---------------------------------------------------------------------------------------------
# Graph outputs that are SymInts or None


@pytest.mark.parametrize("capture", ["off", "emulate"])
def test_symint_and_none_outputs_are_returned(capture):
    def f(x, n: int):
        h = x.sin()
        with fxsplit.region(MID):
            k = h.shape[0] * 2
            h = h.cos()
        return None, x.shape[0], h * k, k + n, None, n

    backend = fxsplit.Backend(capture=capture, eager_regions=[MID])
    model = torch.compile(f, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for step, (b, n) in enumerate([(2, 1), (2, 1), (2, 1), (3, 4), (3, 4), (3, 4), (2, 5)]):
            x = torch.full((b, 3), float(step))
            got, expected = model(x, n), f(x, n)
            assert got[0] is None and got[4] is None, step
            assert [type(v) for v in got] == [type(v) for v in expected], step
            assert got[1] == b and got[3] == 2 * b + n and got[5] == n, step
            assert torch.equal(got[2], expected[2]), step
    assert len(backend.plans) == 1
    if capture == "emulate":
        assert counters.snapshot()["replays"] > 0


# ---------------------------------------------------------------------------------------------
# A model raising inside a piece


@torch.library.custom_op("fxsplit_bad::check_positive", mutates_args=())
def check_positive(x: torch.Tensor) -> torch.Tensor:
    if bool((x < 0).any()):
        raise ValueError("check_positive: negative sequence length")
    return x * 2


@check_positive.register_fake
def _(x):
    return torch.empty_like(x)


def _raising_model():
    def f(x, idx):
        h = x.sin() * 2
        with fxsplit.region(MID):
            g = torch.gather(h, 0, idx)  # eager; RuntimeError for an index out of range
        k = g.cos() + 1
        return torch.ops.fxsplit_bad.check_positive(k.abs() + x) + h.sum()

    backend = fxsplit.Backend(
        capture="emulate", eager_regions=[MID], splitting_ops=["fxsplit_bad::check_positive"]
    )
    return f, torch.compile(f, backend=backend, fullgraph=True), backend


def _good(step):
    return torch.arange(4.0) * 0.3 + step, torch.tensor([3, 1, 2, 0])


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ((torch.arange(4.0), torch.tensor([0, 9, 2, 3])), RuntimeError),  # eager region
        ((torch.arange(4.0) - 5, torch.tensor([0, 1, 2, 3])), ValueError),  # eager split op
    ],
)
@pytest.mark.parametrize("good_before", [0, 1, 3])  # bad call: warm-up / capture step / replay
def test_error_in_an_eager_piece_surfaces_unchanged_and_leaves_no_half_capture(
    bad, error, good_before
):
    f, model, backend = _raising_model()
    with pytest.raises(error) as eager_info:
        f(*bad)
    with torch.no_grad():
        for step in range(good_before):
            assert torch.equal(model(*_good(step)), f(*_good(step)))
        with pytest.raises(error) as info:
            model(*bad)
        assert type(info.value) is type(eager_info.value)
        assert str(info.value) == str(eager_info.value)
        for step in range(4):
            assert torch.equal(model(*_good(10 + step)), f(*_good(10 + step))), step
    assert [p.kind for p in backend.plans[0].pieces] == [
        "captured",
        "eager",
        "captured",
        "eager",
        "captured",
    ]
    # every captured piece ends up captured and replaying; nothing runs uncaptured for good
    for piece in backend.runtimes[0].pieces:
        assert piece.failed is None, piece.name
        assert any(e.graph.captured for e in piece.entries.values()), piece.name
    assert counters.snapshot()["replays"] > 0


def test_error_in_a_captured_piece_on_its_capture_step_does_not_disable_capture():
    def f(x, idx):
        h = x.sin() * 2
        with fxsplit.region(MID):
            h = h.cos()
        return torch.gather(h, 0, idx) * 2  # captured piece; fails for an index out of range

    backend = fxsplit.Backend(capture="emulate", eager_regions=[MID])
    model = torch.compile(f, backend=backend, fullgraph=True)
    bad = (torch.arange(4.0), torch.tensor([0, 9, 2, 3]))
    with pytest.raises(RuntimeError) as eager_info:
        f(*bad)
    with torch.no_grad():
        assert torch.equal(model(*_good(0)), f(*_good(0)))  # warm-up
        with pytest.raises(RuntimeError) as info:
            model(*bad)  # the capture step
        assert str(info.value) == str(eager_info.value)  # this part holds
        for step in range(3):
            assert torch.equal(model(*_good(step)), f(*_good(step)))  # so does this
    piece = backend.runtimes[0].pieces[-1]
    assert piece.failed is None
    assert any(e.graph.captured for e in piece.entries.values())
    assert_replayed(backend)


def test_splitting_op_with_an_overload_that_does_not_exist_lists_the_real_ones():
    with pytest.raises(ValueError) as info:
        fxsplit.Backend(splitting_ops=["aten::topk.nosuchoverload"])
    message = str(info.value)
    assert "'aten::topk.nosuchoverload'" in message and "aten::topk.default" in message
    fxsplit.Backend(splitting_ops=["aten::topk.values", "notyet::registered.default"])
