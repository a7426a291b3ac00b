"""Tests of option validation (Config, Backend) and of backend-level behaviour on bad input."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import fxsplit
from fxsplit.config import Config
from tests.warned import warned_at

pytestmark = pytest.mark.usefixtures("fresh_capture_state")


def _fn(x):
    with fxsplit.region("attention"):
        a = x.sin()
    return a + 1


# --------------------------------------------------------------------------- Config


def test_defaults():
    config = Config.from_options()
    assert config == Config()
    assert config.runner == "v1"
    assert config.eager_regions is None
    assert config.capture == "auto"
    assert config.capture_sizes is None
    assert config.verify is False


def test_valid_options_are_normalised():
    config = Config.from_options(
        {
            "runner": "v2",
            "eager_regions": ["attention", "mine"],
            "splitting_ops": ["aten::topk", "mylib::attn.default"],
            "module_regions": {"Attn": "attention"},
            "eager_modules": ["layers.*.mlp"],
            "capture": "emulate",
            "capture_sizes": [1, 8, 16],
            "max_captured_keys": 3,
            "warmup_runs": 0,
            "input_binding": "trust",
            "on_capture_error": "raise",
            "verify": True,
            "clone_outputs": True,
        }
    )
    assert config.runner == "v2"
    assert config.eager_regions == frozenset({"attention", "mine"})
    assert config.splitting_ops == ("aten::topk", "mylib::attn.default")
    assert config.module_regions == {"Attn": "attention"}
    assert config.eager_modules == ("layers.*.mlp",)
    assert config.capture_sizes == (1, 8, 16)
    assert (config.capture, config.max_captured_keys, config.warmup_runs) == ("emulate", 3, 0)
    assert (config.input_binding, config.on_capture_error) == ("trust", "raise")
    assert config.verify is True and config.clone_outputs is True


def test_from_options_base_supplies_missing_keys():
    base = Config.from_options({"runner": "v2", "verify": True})
    config = Config.from_options({"capture": "off"}, base=base)
    assert (config.runner, config.verify, config.capture) == ("v2", True, "off")


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match="'bogus'") as info:
        Config.from_options({"bogus": 1, "runner": "v1"})
    message = str(info.value)
    for key in ("runner", "eager_regions", "splitting_ops", "capture_sizes", "verify", "dump_dir"):
        assert key in message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("capture_sizes", "8"),
        ("capture_sizes", 8),
        ("capture_sizes", [8, "16"]),
        ("capture_sizes", [True]),
        ("verify", 1),
        ("clone_outputs", "yes"),
        ("splitting_ops", "aten::topk"),
        ("eager_modules", "layers.0"),
        ("eager_regions", "attention"),
        ("module_regions", ["Attn"]),
        ("runner", 3),
        ("max_captured_keys", True),
        ("max_captured_keys", 2.0),
        ("warmup_runs", "1"),
        ("dump_dir", 3),
        ("check_ranks", "no"),
        ("presets", "yes"),
    ],
)
def test_wrong_type_raises_type_error_naming_key(key, value):
    with pytest.raises(TypeError, match=key) as info:
        Config.from_options({key: value})
    message = str(info.value)
    assert "has type" not in message or re.search(r"has type \w+; expected ", message), message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("capture", "gpu"),
        ("capture_sizes", [0]),
        ("capture_sizes", [8, 8]),
        ("max_captured_keys", 0),
        ("warmup_runs", -1),
        ("input_binding", "move"),
        ("on_capture_error", "ignore"),
        ("splitting_ops", [""]),
        ("eager_modules", ["ok", ""]),
        ("module_regions", {"Attn": ""}),
        ("module_regions", {"": "attention"}),
    ],
)
def test_bad_value_raises_value_error_naming_key(key, value):
    with pytest.raises(ValueError, match=key):
        Config.from_options({key: value})


def test_unknown_runner_lists_registered_runners():
    with pytest.raises(ValueError, match=r"unknown runner 'nope'; registered runners: .*v1, v2"):
        Config.from_options({"runner": "nope"})


@pytest.mark.parametrize("name", ["topk", "aten.topk", "aten::topk.a.b", "aten::"])
def test_malformed_splitting_op_raises(name):
    with pytest.raises(ValueError, match=r"malformed op name .*expected 'namespace::op'"):
        Config.from_options({"splitting_ops": ["aten::sort", name]})


def test_binding_defaults_from_runner():
    assert Config.from_options({"runner": "v1"}).binding == "copy"
    assert Config.from_options({"runner": "v2"}).binding == "strict"
    assert Config.from_options({"runner": "v2", "input_binding": "trust"}).binding == "trust"


def test_runner_policy_applies_eager_regions():
    config = Config.from_options({"runner": "v2", "eager_regions": ["mine"]})
    policy = config.runner_policy
    assert policy.name == "v2" and policy.persistent_inputs is True
    assert policy.eager_regions == frozenset({"mine"})
    assert fxsplit.runners.get("v2").eager_regions == frozenset({"sparse_indexer", "attention"})


def test_dump_folder_option_then_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FXSPLIT_DUMP_DIR", raising=False)
    assert Config().dump_folder is None
    monkeypatch.setenv("FXSPLIT_DUMP_DIR", "/from/env")
    assert Config().dump_folder == "/from/env"
    assert Config.from_options({"dump_dir": tmp_path}).dump_folder == str(tmp_path)


# --------------------------------------------------------------------------- Backend construction


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"bogus": 1}, ValueError),
        ({"capture_sizes": "8"}, TypeError),
        ({"verify": 1}, TypeError),
        ({"splitting_ops": "aten::topk"}, TypeError),
        ({"splitting_ops": ["topk"]}, ValueError),
        ({"runner": "nope"}, ValueError),
    ],
)
def test_backend_raises_at_construction(options, error):
    with pytest.raises(error):
        fxsplit.Backend(**options)


def test_backend_rejects_unexpected_keyword():
    backend = fxsplit.Backend()
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(TypeError, match="unexpected keyword"):
        backend(gm, [torch.randn(2)], dynamic=True)


def test_backend_options_override_construction_options():
    backend = fxsplit.Backend(runner="v1")
    compiled = torch.compile(_fn, backend=backend, options={"runner": "v2"})
    x = torch.randn(3)
    assert torch.equal(compiled(x), _fn(x))
    assert backend.config.runner == "v1"
    assert backend.plans[0].runner == "v2"


# --------------------------------------------------------------------------- string backend


def test_string_backend_bad_option_fails_on_first_call_with_fxsplits_error():
    compiled = torch.compile(_fn, backend="fxsplit", options={"bogus": 1})  # no error yet
    with pytest.raises(ValueError) as info:
        compiled(torch.randn(3))
    assert "'bogus'" in str(info.value) and "valid options" in str(info.value)


def test_string_backend_rejects_a_mode_it_does_not_take():
    compiled = torch.compile(_fn, backend="fxsplit", mode="max-autotune-no-cudagraphs")
    with pytest.raises(ValueError, match="mode='max-autotune-no-cudagraphs'"):
        compiled(torch.randn(3))


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_string_backend_accepts_default_and_reduce_overhead_modes(mode):
    x = torch.randn(3)
    assert torch.equal(torch.compile(_fn, backend="fxsplit", mode=mode)(x), _fn(x))
    assert len(fxsplit.plans()) == 1


def test_string_backend_with_options_and_plans():
    compiled = torch.compile(_fn, backend="fxsplit", options={"runner": "v2"})
    x = torch.randn(3)
    assert torch.equal(compiled(x), _fn(x))
    plans = fxsplit.plans()
    assert len(plans) == 1
    assert plans[0].runner == "v2"
    assert [p.kind for p in plans[0].pieces] == ["eager", "captured"]


def test_dynamo_reset_clears_plans():
    x = torch.randn(3)
    assert torch.equal(torch.compile(_fn, backend="fxsplit")(x), _fn(x))
    assert len(fxsplit.plans()) == 1
    torch._dynamo.reset()
    assert fxsplit.plans() == []


def test_dynamo_reset_clears_backend_object_plans():
    backend = fxsplit.Backend()
    x = torch.randn(3)
    assert torch.equal(torch.compile(_fn, backend=backend)(x), _fn(x))
    assert len(backend.plans) == 1
    torch._dynamo.reset()
    assert backend.plans == []


def test_reset_is_idempotent_and_restarts_graph_ids():
    backend = fxsplit.Backend()
    x = torch.randn(3)
    assert torch.equal(torch.compile(_fn, backend=backend)(x), _fn(x))
    assert backend.plans[0].graph_id == "graph_0"
    backend.reset()
    backend.reset()
    assert backend.plans == []
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_fn, backend=backend)(x), _fn(x))
    assert [p.graph_id for p in backend.plans] == ["graph_0"]


def test_recompile_appends_plan():
    backend = fxsplit.Backend()
    compiled = torch.compile(_fn, backend=backend, dynamic=False)
    for n in (3, 4):
        x = torch.randn(n)
        assert torch.equal(compiled(x), _fn(x))
    assert [p.graph_id for p in backend.plans] == ["graph_0", "graph_1"]


# --------------------------------------------------------------------------- unmatched patterns


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"splitting_ops": ["aten::topk"]}, "aten::topk"),
        ({"module_regions": {"NoSuchModule": "attention"}}, "NoSuchModule"),
        ({"eager_modules": ["layers.*.nothing"]}, "layers.*.nothing"),
    ],
)
def test_unmatched_pattern_warns_once(options, pattern):
    backend = fxsplit.Backend(**options)
    compiled = torch.compile(_fn, backend=backend, dynamic=False)
    x = torch.randn(3)
    with pytest.warns(fxsplit.FxsplitWarning, match=f"'{pattern}'") as record:
        assert torch.equal(compiled(x), _fn(x))
        assert torch.equal(compiled(x), _fn(x))  # judged when the graph runs again
    line = "assert torch.equal(compiled(x), _fn(x))  # judged when the graph runs again"
    assert warned_at(record) == [("test_config.py", line)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        y = torch.randn(4)  # a recompile: a second graph, no second warning
        assert torch.equal(compiled(y), _fn(y))
    assert not [w for w in record if "fxsplit" in str(w.message)]
    assert len(backend.plans) == 2


def test_every_overload_matched_by_torch_function_does_not_warn():
    def f(x):
        return torch.topk(x + 1, 2).values * 2

    backend = fxsplit.Backend(splitting_ops=["aten::topk.default", "aten::topk.values"])
    x = torch.randn(5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert torch.equal(torch.compile(f, backend=backend)(x), f(x))
    assert [p.reasons for p in backend.plans[0].eager] == [("op:aten::topk.default",)]
    assert not [w for w in record if "fxsplit" in str(w.message)]


def test_matched_patterns_do_not_warn():
    class Mod(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return torch.topk(self.lin(x), 2).values

    model = Mod()
    backend = fxsplit.Backend(
        splitting_ops=["aten::topk"], module_regions={"Linear": "r"}, eager_modules=["lin"]
    )
    x = torch.randn(2, 3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = torch.compile(model, backend=backend)(x)
    assert torch.equal(got, model(x))
    assert not [w for w in record if "fxsplit" in str(w.message)]
    (eager,) = backend.plans[0].eager
    assert eager.reasons == ("module:lin", "op:aten::topk")
    assert eager.regions == frozenset({"r"})


@pytest.mark.parametrize(
    ("value", "held"),
    [
        ("tokens", ("tokens",)),
        (["input_ids", "positions"], ("input_ids", "positions")),
        (None, None),
    ],
)
def test_size_input_takes_a_name_or_a_list_of_names(value, held):
    assert Config.from_options({"size_input": value}).size_input == held


@pytest.mark.parametrize(
    ("value", "error", "needle"),
    [
        ([], ValueError, "names no argument"),
        (["ids", "ids"], ValueError, "'ids' twice"),
        (["ids", "not a name"], ValueError, "'not a name', not a Python argument name"),
        (["ids", 3], TypeError, "holds 3"),
        (3, TypeError, "an argument name"),
    ],
)
def test_bad_size_input_names_the_value(value, error, needle):
    with pytest.raises(error, match=re.escape(needle)):
        Config.from_options({"size_input": value})
