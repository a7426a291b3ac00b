"""The ``fxsplit`` command answers a bad ``MODULE:FACTORY``, ``--options`` or ``--runner`` before
torch is imported (:mod:`fxsplit.tools.cli_checks`), in the words ``Config`` uses, with the facts
it keeps itself equal to ``fxsplit.config`` and ``fxsplit.runners``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxsplit import config
from fxsplit.tools import cli_checks
from fxsplit.tools.cli_checks import UsageError
from tests.timeouts import scaled

ROOT = Path(__file__).resolve().parent.parent


def test_option_names_and_choices_are_configs():
    assert tuple(f.name for f in dataclasses.fields(config.Config)) == cli_checks.OPTION_NAMES
    assert cli_checks.CHOICES == {
        "capture": config.CAPTURE_MODES,
        "compile_pieces": config.COMPILE_MODES,
        "input_binding": config.INPUT_BINDINGS,
        "on_capture_error": config.ON_CAPTURE_ERROR,
    }


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("capture", "emulated"),
        ("capture", "gpu"),
        ("capture", True),
        ("compile_pieces", "Inductor"),
        ("input_binding", "cpy"),
        ("input_binding", 2),
        ("on_capture_error", "ignore"),
        ("capture_sizes", []),
        ("capture_sizes", [0]),
        ("capture_sizes", [4, -1]),
        ("capture_sizes", [4, 4]),
        ("capture_sizes", [2.5]),
        ("capture_sizes", 4),
        ("compile_sizes", [0]),
        ("compile_sizes", "8"),
    ],
)
def test_a_bad_value_is_named_as_config_names_it(key, value):
    with pytest.raises((TypeError, ValueError)) as info:
        config.Config.from_options({key: value})
    with pytest.raises(UsageError) as early:
        cli_checks.check_options(json.dumps({key: value}))
    assert str(early.value) == f"bad fxsplit options: {info.value}"


@pytest.mark.parametrize(
    "options", ['{"capture": "emulate", "capture_sizes": [1, 8]}', '{"input_binding": null}', None]
)
def test_good_options_pass(options):
    assert cli_checks.check_options(options) == json.loads(options or "{}")


def test_an_unknown_key_is_named_as_config_names_it():
    with pytest.raises(ValueError) as info:
        config.Config.from_options({"runer": "v2"})
    with pytest.raises(UsageError) as early:
        cli_checks.check_options('{"runer": "v2"}')
    assert str(early.value) == f"bad fxsplit options: {info.value}"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mymodel.example", "got 'mymodel.example'; did you mean mymodel:example?"),
        # a module named without its factory (the hint was "did you mean fxsplit.models:...")
        (
            "fxsplit.models.deepseek_v4",
            "fxsplit.models.deepseek_v4 is a module: name a function in it that returns the model",
        ),
        ("mymodel", "got 'mymodel'"),
        ("mymodel:", "got 'mymodel:'"),
        (":example", "got ':example'"),
    ],
)
def test_a_factory_without_module_and_attribute_is_refused(spec, message):
    with pytest.raises(UsageError, match="expected MODULE:FACTORY") as info:
        cli_checks.check_factory(spec)
    assert str(info.value).endswith(message)


def test_a_runner_is_built_in_or_named_by_the_factorys_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel.py").write_text('runners.register(Runner("mine", set()))\n')
    cli_checks.check_runner("v2", "mymodel")
    cli_checks.check_runner("mine", "mymodel")  # its registry decides, after the import
    with pytest.raises(UsageError) as info:
        cli_checks.check_runner("v3", "mymodel")
    assert str(info.value) == (
        "unknown runner 'v3' (not built in, and module mymodel, which could register it, never "
        "names it); built-in runners: v1, v2; did you mean 'v2'?"
    )


def test_bad_arguments_exit_2_before_torch_is_imported():
    """In a fresh process, as a user runs the command: every case answered, torch never
    imported; then the built-in runners the checks know are the registry's."""
    cases = [
        ["dump", "mymodel.example"],
        ["dump", "fxsplit.models.deepseek_v4:example", "--runner", "v3"],
        ["diff", "fxsplit.models.deepseek_v4:example", "--runner", "v1", "--runner", "v3"],
        ["dump", "x:y", "--options", '{"capture": "emulated"}'],
        ["dump", "x:y", "--options", '{"capture_sizes": [0]}'],
        ["diff", "x:y", "--options", '{"runner": "v9"}'],
        ["dump", "x:y", "--options", "[1]"],
    ]
    code = (
        "import json, sys\n"
        "from fxsplit.tools import cli\n"
        f"codes = [cli.main(argv) for argv in {cases!r}]\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "from fxsplit import runners\n"
        "print(json.dumps([codes, heavy, runners.names()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=scaled(120)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    codes, heavy, builtin = json.loads(done.stdout.splitlines()[-1])
    assert codes == [2] * len(cases), done.stderr
    assert heavy == []
    assert builtin == list(cli_checks.BUILTIN_RUNNERS)
    errors = done.stderr.splitlines()
    assert len(errors) == len(cases) and all(": error: " in line for line in errors), errors
    assert "did you mean 'emulate'?" in errors[3]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    """``fxsplit ARGV`` in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "fxsplit.tools.cli", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=scaled(120),
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["dump", "fxsplit.models.deepseek_v4:example", "--runer", "v1"],
            "fxsplit dump: error: unrecognized arguments: --runer v1; did you mean --runner?",
        ),
        (
            ["diff", "x:y", "--sumary", "--runer=v1"],
            "fxsplit diff: error: unrecognized arguments: --sumary --runer=v1; did you mean "
            "--summary for --sumary, --runner for --runer?",
        ),
        (
            ["cache", "info", "--cache-dirr", "d"],
            "fxsplit cache: error: unrecognized arguments: --cache-dirr d; did you mean "
            "--cache-dir?",
        ),
        (
            ["demo", "--modle", "Llama"],
            "fxsplit demo: error: unrecognized arguments: --modle Llama; did you mean --model?",
        ),
        (
            ["demo", "--devcie", "cpu"],
            "fxsplit demo: error: unrecognized arguments: --devcie cpu; did you mean --device?",
        ),
        (["demo", "--zzz"], "fxsplit demo: error: unrecognized arguments: --zzz"),
        (
            ["dmeo", "--device", "cpu"],
            "fxsplit: error: argument command: invalid choice: 'dmeo' (choose from 'demo', "
            "'dump', 'diff', 'cache', 'help'); did you mean 'demo'?",
        ),
    ],
)
def test_a_misspelt_flag_or_command_is_answered_with_the_one_meant(argv, said):
    done = _cli(*argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == said
    assert done.stdout == ""


def test_help_as_a_command_prints_the_help_of_fxsplit_or_of_a_command():
    """``fxsplit help`` (a first stumble: it was an invalid choice) prints ``fxsplit --help``;
    ``fxsplit help demo`` prints ``fxsplit demo --help``."""
    for argv, same_as in ((["help"], ["--help"]), (["help", "demo"], ["demo", "--help"])):
        done, want = _cli(*argv), _cli(*same_as)
        assert done.returncode == 0, done.stderr
        assert done.stdout == want.stdout


def test_unknown_arguments_suggests_nothing_far_from_every_flag():
    assert cli_checks.unknown_arguments(["x", "--qqq"], ["-h", "--help", "--runner"]) == (
        "unrecognized arguments: x --qqq"
    )


MISSPELT = [
    (
        "fxsplit.models.deepseek_v4:exampel",
        "module 'fxsplit.models.deepseek_v4' has no attribute 'exampel'; did you mean "
        "fxsplit.models.deepseek_v4:example?",
    ),
    (
        "fxsplit.models.deepseek_v4:DecodeRunner.stepp",
        "module 'fxsplit.models.deepseek_v4' has no attribute 'DecodeRunner.stepp'; did you "
        "mean fxsplit.models.deepseek_v4:DecodeRunner.step?",
    ),
    (
        "fxsplit.modls.deepseek_v4:example",
        "cannot import module 'fxsplit.modls.deepseek_v4': No module named 'fxsplit.modls'; "
        "did you mean fxsplit.models.deepseek_v4:example?",
    ),
    (
        "fxsplit.models.deepsek_v4:example",
        "cannot import module 'fxsplit.models.deepsek_v4': No module named "
        "'fxsplit.models.deepsek_v4'; did you mean fxsplit.models.deepseek_v4:example?",
    ),
    (
        "fxsplit.models.deepseek_v4:qqqqqq",
        "module 'fxsplit.models.deepseek_v4' has no attribute 'qqqqqq'",
    ),
]


def test_a_misspelt_module_or_factory_is_answered_with_the_one_meant(tmp_path):
    """In a fresh process (one, for all cases: each imports the model's module and torch)."""
    code = (
        "import json, sys\n"
        "from fxsplit.tools import cli\n"
        f"specs = {[spec for spec, _ in MISSPELT]!r}\n"
        f"print(json.dumps([cli.main(['dump', s, '--out', {str(tmp_path)!r}]) for s in specs]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=scaled(120)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [2] * len(MISSPELT)
    assert done.stderr.splitlines() == [f"fxsplit dump: error: {said}" for _, said in MISSPELT]
