"""The installed package imports from any folder, even one holding a clone named ``fxsplit``
(which Python would otherwise import as an empty namespace package)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.timeouts import scaled

REPO = Path(__file__).resolve().parents[1]


def test_import_from_a_folder_holding_a_folder_named_fxsplit(tmp_path):
    (tmp_path / "fxsplit").mkdir()  # what `git clone ... fxsplit` leaves in the parent folder
    done = subprocess.run(
        [sys.executable, "-c", "import fxsplit; print(fxsplit.__file__); fxsplit.counters"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent.parent == REPO


README = (REPO / "README.md").read_text(encoding="utf-8")
# The README and the manual pages it links to: where a user looks up a flag.
DOCS = "\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")))
FLAG = r"(?<![\w-])--[a-z][a-z-]*"


def _cli_flags() -> set[str]:
    """Every long flag of ``fxsplit`` and of its commands, from their ``--help``."""
    import contextlib
    import io

    from fxsplit.tools import cli

    flags = set()
    for argv in ([], ["demo"], ["dump"], ["diff"], ["cache"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli.main([*argv, "--help"])
        flags |= set(re.findall(FLAG, out.getvalue()))
    return flags - {"--help"}


def test_readme_or_docs_document_every_command_line_flag():
    flags = _cli_flags()
    assert {"--nodes", "--tp", "--cache-dir"} <= flags  # the help was read
    documented = set(re.findall(FLAG, README + DOCS))
    assert sorted(flags - documented) == []


def test_readme_states_the_torch_range_pyproject_requires():
    """What a user may install, in the README's words: the range of ``pyproject.toml``'s
    requirement (``torch>=2.11,<2.15``: 2.11 to a 2.14 release)."""
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    low, major, below = re.search(r'"torch>=(\d+\.\d+),<(\d+)\.(\d+)"', pyproject).groups()
    stated = re.search(r"supported range is torch (\d+\.\d+) to (\d+)\.(\d+)\.\d+", README)
    assert stated, "the README names no supported torch range"
    assert stated.groups() == (low, major, str(int(below) - 1))


def test_readme_gives_each_command_one_time_and_the_load_it_was_measured_at():
    """One row per command: how long it took and at what load average, and no dated history
    or pass count beside them that a newcomer could not check (those live in docs/testing.md;
    the count comes from the suite itself, see the .ci/run test below)."""
    section = README.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]+) \|$", section, re.MULTILINE)
    commands = ["fxsplit demo", "python3 -m pytest -q", 'python3 -m pytest -q -m "not slow"']
    assert [command for command, _, _ in rows] == commands
    for command, took, load in rows:
        assert re.fullmatch(r"(about )?\d+ (s|minutes)", took.strip()), command
        assert re.fullmatch(r"[\d.]+( to [\d.]+)?", load.strip()), command
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", section)  # no dated history
    assert not re.search(r"\d+ passed", section)  # no count from an earlier day


def test_readme_offers_the_quick_subset_with_a_registered_marker():
    """The quick subset beside the full command selects by a marker pyproject registers (an
    unregistered marker would only warn and select everything)."""
    assert 'python3 -m pytest -q -m "not slow"' in README
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^    "slow: ', pyproject, re.MULTILINE)


def test_ci_runs_the_readmes_test_command():
    """CI runs what the README tells a newcomer to run, on a clean clone."""
    (command,) = [
        line.split("#")[0].strip()
        for line in README.splitlines()
        if line.startswith("bash scripts/setup.sh && python3 -m pytest")
    ]
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert f'{command} | tee "$log"' in ci, (command, ci)


def test_ci_ends_with_the_suites_count_and_the_count_expected():
    """pytest's summary line, printed again after the vLLM check, beside the number of tests
    collected and of the modules skipped whole at collection (tests/vllm/ without vLLM, one
    skip each in the summary): every one passes or skips."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "collection=$(python3 -m pytest -q --collect-only -rs)" in ci
    assert "whole=$(grep -c '^SKIPPED' <<<\"$collection\" || true)" in ci
    assert ci[-3:] == [
        'echo "== the suite: $(tail -n 1 "$log")"',
        'echo "== expected: ${collected%% in *} and $whole modules skipped whole, '
        '$((${collected%% *} + whole))" \\',
        '    "in all, each passed or skipped (no failure, no error)"',
    ]
