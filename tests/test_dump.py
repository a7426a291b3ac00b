"""Dump folders, HTML report, structured trace and the ``fxsplit dump`` / ``fxsplit diff`` CLI.

Golden text (expecttest): regenerate with ``EXPECTTEST_ACCEPT=1 pytest tests/test_dump.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TestCase = pytest.importorskip("expecttest").TestCase
pytest.importorskip("rich")

import fxsplit  # noqa: E402
from fxsplit.tools import cli, dump, report  # noqa: E402
from fxsplit.tools.diff import diff_splits  # noqa: E402
from tests.columns import Recording, cut_words  # noqa: E402
from tests.timeouts import scaled  # noqa: E402
from tests.warned import warned_at  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class Tiny(torch.nn.Module):
    """A model written only for these tests: prep, captured compute, attention, captured."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x, positions):
        h = self.inp(x).relu()
        with fxsplit.region(fxsplit.ATTN_PREP):
            scale = positions.float().unsqueeze(-1) + 1
        h = h * scale
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return self.out(h).sigmoid()


def tiny_factory():
    """FACTORY for the CLI tests: ``tests.test_dump:tiny_factory``."""
    torch.manual_seed(0)
    return Tiny(), (torch.randn(4, 8), torch.arange(4))


def not_a_pair():
    """A bad FACTORY: returns a model only."""
    return Tiny()


def _compile(runner="v1", factory=tiny_factory):
    """(backend, [(split, dynamo code, example inputs)]) of one run of ``factory``'s model."""
    torch._dynamo.reset()
    model, inputs = factory()
    backend = fxsplit.Backend(runner=runner, capture="off")
    codes = []

    def recording(gm, example_inputs, **kwargs):
        codes.append((gm.print_readable(print_output=False), list(example_inputs)))
        return backend(gm, example_inputs, **kwargs)

    with torch.no_grad():
        torch.compile(model, backend=recording, dynamic=True)(*inputs)
    return backend, [(s, c, i) for s, (c, i) in zip(backend.compiled, codes, strict=True)]


def _tiny_dump(root, runner="v1") -> Path:
    _, [(split, code, inputs)] = _compile(runner)
    return dump.write_dump(root, split, code, example_inputs=inputs)


def _schema(values: list, indent: int = 0) -> list[str]:
    """Keys and value types of JSON data, merged over every occurrence of each key.

    ``values`` holds every value found at one path. A dict key missing from some of them is
    marked ``?``; a list shows the types of all its items (``list[int|str]``), and for dicts
    their merged keys below it.
    """
    pad = "  " * indent
    dicts = [v for v in values if isinstance(v, dict)]
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    lines = []
    for key in keys:
        found = [d[key] for d in dicts if key in d]
        optional = "?" if len(found) < len(dicts) else ""
        types = "|".join(sorted({type(v).__name__ for v in found}))
        items = [x for v in found if isinstance(v, list) for x in v]
        if items:
            types += f"[{'|'.join(sorted({type(x).__name__ for x in items}))}]"
        lines.append(f"{pad}{key}{optional}: {types}")
        nested = [x for x in items if isinstance(x, dict)] + [
            v for v in found if isinstance(v, dict)
        ]
        lines += _schema(nested, indent + 1)
    return lines


class Golden(TestCase):
    def test_plan_txt(self):
        folder = _tiny_dump(self._tmp())
        self.assertExpectedInline(
            (folder / "plan.txt").read_text(),
            """\
graph_0 runner=v1 eager_regions=attention,attn_prep,sparse_indexer: 5 pieces, 3 captured, 2 eager
piece    kind      ops  regions    reasons
piece_0  captured    2  -          -
piece_1  eager       3  attn_prep  region:attn_prep
piece_2  captured    1  -          -
piece_3  eager       1  attention  region:attention
piece_4  captured    2  -          -
""",
        )

    def test_plan_json_schema(self):
        folder = _tiny_dump(self._tmp())
        data = json.loads((folder / "plan.json").read_text())
        self.assertEqual(data["schema_version"], dump.SCHEMA_VERSION)
        self.assertExpectedInline(
            "\n".join(_schema([data])),
            """\
schema_version: int
graph_id: str
runner: str
eager_regions: list[str]
num_nodes: int
num_pieces: int
num_captured: int
num_eager: int
split_ms: float
torch_version: str
graph_inputs: list[dict]
  name: str
  type: str
  shape?: list[int|str]
  dtype?: str
  device?: str
  value?: str
example_inputs: list[dict]
  name: str
  type: str
  shape?: list[int]
  dtype?: str
  device?: str
  value?: str
pieces: list[dict]
  name: str
  kind: str
  regions: list[str]
  reasons: list[str]
  num_ops: int
  nodes: list[str]
  inputs: list[dict]
    name: str
    type: str
    shape: list[int|str]
    dtype: str
    device: str
  outputs: list[dict]
    name: str
    type: str
    shape: list[int|str]
    dtype: str
    device: str
  file: str
  same_code_as: NoneType""",
        )

    def test_diff_tiny(self):
        _, [(a, _, _)] = _compile("v1")
        _, [(b, _, _)] = _compile("v2")
        diff = diff_splits(a, b)
        self.assertExpectedInline(
            "\n".join(
                f"{m.node} {','.join(m.regions)} {m.kind_a}/{m.kind_b} {','.join(m.why_a)}"
                for m in diff.moved
            ),
            """\
float_1 attn_prep eager/captured region:attn_prep
unsqueeze attn_prep eager/captured region:attn_prep
scale attn_prep eager/captured region:attn_prep""",
        )

    def _tmp(self) -> Path:
        import tempfile

        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        return Path(tmp.name)


def test_dump_folder_has_every_item(tmp_path):
    folder = _tiny_dump(tmp_path)
    assert folder.parent == tmp_path
    assert re.fullmatch(r"\d{3,}_v1_graph_0", folder.name)
    names = {p.name for p in folder.iterdir()}
    expected = {"dynamo_graph.py", "plan.txt", "plan.json", "stitched.py", "split.dot"}
    expected |= {f"piece_{i}.py" for i in range(5)} | {"report.html"}
    assert expected <= names
    assert ("split.svg" in names) != ("split_svg_missing.txt" in names)
    assert "runtime.json" not in names
    assert "class GraphModule" in (folder / "dynamo_graph.py").read_text()
    piece = (folder / "piece_1.py").read_text()
    assert piece.startswith("# piece_1: eager, 3 ops\n# regions: attn_prep\n")
    assert "# reasons: region:attn_prep\n" in piece and "def piece_1(" in piece
    assert "def forward" in (folder / "stitched.py").read_text()
    data = json.loads((folder / "plan.json").read_text())
    kinds = [p["kind"] for p in data["pieces"]]
    assert kinds == ["captured", "eager", "captured", "eager", "captured"]
    out = data["pieces"][0]["outputs"][0]
    assert out["type"] == "Tensor" and out["dtype"] == "torch.float32"


def _dump_names(root: Path, fn, *args) -> list[str]:
    """Dump folder names, without their counter, of one call of ``fn`` compiled with a dump."""
    torch._dynamo.reset()
    backend = fxsplit.Backend(dump_dir=str(root), capture="off")
    with torch.no_grad():
        torch.compile(fn, backend=backend)(*args)
    return sorted(p.name.partition("_")[2] for p in root.iterdir())


@pytest.mark.parametrize("compiled", ["module", "bound method"])
def test_dump_folder_of_a_module_or_its_method_is_named_after_the_module(tmp_path, compiled):
    model, inputs = tiny_factory()
    fn = model if compiled == "module" else model.forward
    assert _dump_names(tmp_path, fn, *inputs) == ["Tiny_v1_graph_0"]


def test_dump_folder_of_a_function_is_named_after_the_function(tmp_path):
    model, inputs = tiny_factory()

    def step(model, x, positions):  # a module as first argument does not make it a method
        return model(x, positions) * 2

    assert _dump_names(tmp_path, step, model, *inputs) == ["step_v1_graph_0"]


def test_dump_folder_of_a_transformers_forward_is_named_after_the_model(tmp_path):
    from fxsplit.models import hf_architectures

    if not hf_architectures.available():
        pytest.skip("needs transformers >= 5.8.1")
    model = hf_architectures.build("LlamaForCausalLM")  # forward behind *args decorators
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    assert _dump_names(tmp_path, model.forward, ids) == ["LlamaForCausalLM_v1_graph_0"]


def test_folders_never_overwrite(tmp_path):
    _, [(split, code, _)] = _compile()
    first = dump.write_dump(tmp_path, split, code)
    second = dump.write_dump(tmp_path, split, code)
    assert first != second and first.is_dir() and second.is_dir()
    # a folder made by someone else with the next number is skipped, not reused
    index = int(second.name.split("_")[0]) + 1
    taken = tmp_path / f"{index:03d}_v1_graph_0"
    taken.mkdir()
    third = dump.write_dump(tmp_path, split, code)
    assert third not in (first, second, taken) and not list(taken.iterdir())


def test_without_dot_writes_source_and_note(tmp_path, monkeypatch):
    monkeypatch.setattr(dump.shutil, "which", lambda name: None)
    folder = _tiny_dump(tmp_path)
    assert not (folder / "split.svg").exists()
    assert "digraph" in (folder / "split.dot").read_text()
    note = (folder / "split_svg_missing.txt").read_text()
    assert "apt-get install -y graphviz" in note
    assert "apt-get install -y graphviz" in (folder / "report.html").read_text()


def test_without_the_graphviz_package_the_compile_dumps_the_rest(tmp_path, monkeypatch):
    """A dump aid never stops a model: without the graphviz Python package the compile goes
    on, the dump holds everything but the picture and says why."""
    import builtins

    real_import = builtins.__import__

    def no_graphviz(name, *args, **kwargs):
        if name == "graphviz":
            raise ImportError("No module named 'graphviz'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_graphviz)
    monkeypatch.setenv("FXSPLIT_DUMP_DIR", str(tmp_path))
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        out = torch.compile(model, backend=fxsplit.Backend(eager_regions=[]))(torch.ones(2, 4))
    assert torch.equal(out, model(torch.ones(2, 4)))
    (folder,) = tmp_path.iterdir()
    assert (folder / "plan.json").is_file() and not (folder / "split.dot").exists()
    assert "pip install graphviz" in (folder / "split_svg_missing.txt").read_text()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
def test_svg_inlined_in_report(tmp_path):
    folder = _tiny_dump(tmp_path)
    svg = (folder / "split.svg").read_text()
    assert "<svg" in svg and "piece_1" in svg
    html = (folder / "report.html").read_text()
    assert "<svg" in html and "<?xml" not in html


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
def test_dot_timeout_leaves_source_and_note(tmp_path, monkeypatch):
    monkeypatch.setattr(dump, "DOT_TIMEOUT_S", 1e-9)
    folder = _tiny_dump(tmp_path)
    assert not (folder / "split.svg").exists() and (folder / "split.dot").is_file()
    assert "took longer than" in (folder / "split_svg_missing.txt").read_text()


class Deep(torch.nn.Module):
    """Many pieces, and a value of the first piece read by every captured piece (long edges)."""

    def forward(self, x):
        c = x.cos()
        h = x
        for _ in range(40):
            with fxsplit.region(fxsplit.ATTENTION):
                h = h.softmax(-1)
            h = h * c + 1
        return h


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
def test_picture_of_many_pieces_is_drawn(tmp_path):
    """How long it takes: ``bench/tooling_time.py``."""
    _, [(split, code, _)] = _compile(factory=lambda: (Deep(), (torch.randn(4, 8),)))
    assert len(split.plan.pieces) == 81
    folder = dump.write_dump(tmp_path, split, code)
    assert (folder / "split.svg").is_file()
    assert "piece_80" in (folder / "report.html").read_text()


def test_runtime_stats(tmp_path):
    folder = _tiny_dump(tmp_path)
    assert "Run time" not in (folder / "report.html").read_text()  # no empty section
    stats = {
        "piece_0": {"T=4": {"captures": 1, "replays": 9, "uncaptured_runs": 1}},
        "piece_2": {
            "T=4": {"captures": 1, "replays": 9, "input_copies": 3, "input_copy_bytes": 1024},
            "T=8": {"captures": 1, "replays": 2, "uncaptured_runs": 1},
        },
    }
    dump.write_runtime_stats(folder, stats)
    saved = json.loads((folder / "runtime.json").read_text())
    assert saved["pieces"] == stats
    html = (folder / "report.html").read_text()
    assert "<h2>Run time</h2>" in html and "id=runtime" in html
    assert "input_copy_bytes" in html and "1024" in html
    summary = "2 captured pieces, 25 calls: 20 replays (80 %), 3 captures, 2 uncaptured runs"
    assert f'<p id="replays">fxsplit graph_0: {summary}</p>' in html
    with pytest.raises(TypeError, match="piece_0"):
        dump.write_runtime_stats(folder, {"piece_0": {"T=4": {"captures": "one"}}})
    with pytest.raises(FileNotFoundError):
        dump.write_runtime_stats(tmp_path, stats)


def test_report_escapes_and_is_self_contained(tmp_path):
    folder = _tiny_dump(tmp_path)
    plan = json.loads((folder / "plan.json").read_text())
    plan["pieces"][1]["reasons"] = ["region:<script>alert(1)</script>"]
    (folder / "plan.json").write_text(json.dumps(plan))
    html = report.render(folder)
    assert "<script" not in html
    assert "region:&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert not re.search(r"<link|src=|url\(|@import", html)
    assert html.count('<tr class="piece ') == 5


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium (apt-get install chromium)")
def test_report_renders_in_headless_chromium(tmp_path):
    folder = _tiny_dump(tmp_path / "dump")
    dump.write_runtime_stats(folder, {"piece_0": {"T=4": {"captures": 1, "replays": 2}}})
    result = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            (folder / "report.html").resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    dom = result.stdout
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r'<tr class="piece (captured|eager)" id="row-(piece_\d+)">', dom)
    assert rows == [
        ("captured", "piece_0"),
        ("eager", "piece_1"),
        ("captured", "piece_2"),
        ("eager", "piece_3"),
        ("captured", "piece_4"),
    ]
    assert '<table id="runtime">' in dom and "<details" in dom
    if (folder / "split.svg").exists():
        assert "<svg" in dom


def test_cli_dump_tiny(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["dump", "tests.test_dump:tiny_factory", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"piece_1\s*│\s*eager\s*│\s*3\s*│\s*attn_prep\s*│\s*region:attn_prep", out)
    [folder] = tmp_path.iterdir()
    assert f"wrote {folder}" in out
    assert json.loads((folder / "plan.json").read_text())["runner"] == "v1"


def test_cli_dump_options_and_runner(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("FXSPLIT_DUMP_DIR", str(tmp_path / "env"))
    options = json.dumps({"eager_regions": ["attention"], "dump_dir": str(tmp_path / "opt")})
    argv = ["dump", "tests.test_dump:tiny_factory", "--options", options, "--out", str(tmp_path)]
    assert cli.main([*argv, "--runner", "v2"]) == 0
    [folder] = [p for p in tmp_path.iterdir() if p.name not in ("env", "opt")]
    data = json.loads((folder / "plan.json").read_text())
    assert data["runner"] == "v2" and data["eager_regions"] == ["attention"]
    # the CLI writes its own dumps only, and restores the environment
    assert not (tmp_path / "env").exists() and not (tmp_path / "opt").exists()
    assert os.environ["FXSPLIT_DUMP_DIR"] == str(tmp_path / "env")


@pytest.mark.parametrize("command", ["dump", "diff"])
def test_cli_warns_of_an_option_that_matched_nothing(command, tmp_path, monkeypatch):
    """dump and diff call the model once: what matched nothing is judged after that call (the
    backend judges at a second call, which the CLI never makes)."""
    monkeypatch.setenv("COLUMNS", "200")
    options = json.dumps({"splitting_ops": ["aten::topkk"]})
    argv = [command, "tests.test_dump:tiny_factory", "--options", options]
    argv += ["--out", str(tmp_path)] if command == "dump" else []
    with pytest.warns(fxsplit.FxsplitWarning, match="'aten::topkk'.*matched no node") as caught:
        assert cli.main(argv) == 0
    # named at the user's factory, not at the fxsplit script or fxsplit's own code
    assert set(warned_at(caught)) == {("test_dump.py", "def tiny_factory():")}


def test_cli_dump_deepseek_v4(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["dump", "fxsplit.models.deepseek_v4:example", "--runner", "v1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "region:attn_prep" in out
    [folder] = tmp_path.iterdir()
    data = json.loads((folder / "plan.json").read_text())
    assert data["num_eager"] == 2 and all(
        "region:attn_prep" in p["reasons"] for p in data["pieces"] if p["kind"] == "eager"
    )
    # planned without running captured: the report has no run-time section to leave empty
    assert "<h2>Plan</h2>" in (folder / "report.html").read_text()
    assert "Run time" not in (folder / "report.html").read_text()


def test_cli_dump_llama_splitting_op(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    options = json.dumps({"splitting_ops": ["fxsplit::llama_attention"]})
    argv = ["dump", "fxsplit.models.llama:example", "--options", options, "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "op:fxsplit::llama_attention" in capsys.readouterr().out
    [folder] = tmp_path.iterdir()
    data = json.loads((folder / "plan.json").read_text())
    eager = [p for p in data["pieces"] if p["kind"] == "eager"]
    assert eager and all(p["reasons"] == ["op:fxsplit::llama_attention"] for p in eager)


def test_cli_diff_deepseek_v4_moves_attn_prep(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["diff", "fxsplit.models.deepseek_v4:example", "--runner", "v1", "--runner", "v2"]
    assert cli.main([*argv, "--nodes"]) == 0
    out = capsys.readouterr().out
    # the grouped table: attention input preparation moved from eager (v1) to captured (v2)
    assert re.search(r"│ attn_prep\s*│ eager\s*│ captured\s*│\s*\d+\s*│ region:attn_prep", out)
    # and node by node
    assert re.search(r"│ \w+\s*│ attn_prep\s*│ eager \(piece_1\)\s*│ captured \(piece_0\)", out)


def test_cli_diff_without_runners_compares_v1_and_v2(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["diff", "tests.test_dump:tiny_factory", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "A (runner v1)" in out and "B (runner v2)" in out


@pytest.mark.parametrize("flags", [[], ["--summary"]])  # --summary: the default, still taken
def test_cli_diff_prints_the_summary_and_offers_the_node_table(flags):
    """As a user runs it: pieces side by side and moves by region, then one line saying how
    to see each moved node (before, every moved node was a row: 146 for DeepSeek-V4)."""
    argv = ["diff", "tests.test_dump:tiny_factory", "--runner", "v1", "--runner", "v2", *flags]
    env = {**os.environ, "COLUMNS": "200"}
    done = _cli(argv, env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "3 nodes moved" in out and "moved nodes by region" in out
    assert "graph_0: moved nodes\n" not in out and "unsqueeze" not in out  # no node table
    assert out.endswith("Each of the 3 moved nodes, with its reasons: add --nodes\n")
    done = _cli([*argv, "--nodes"], env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "graph_0: moved nodes\n" in done.stdout and "unsqueeze" in done.stdout
    assert "add --nodes" not in done.stdout


def _cli(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fxsplit.tools.cli", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=scaled(300),
    )


@pytest.mark.parametrize("command", ["dump", "diff"])
def test_cli_piped_fits_100_columns_and_cuts_no_word(command, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.chdir(tmp_path)  # a short --out path
    consoles = []
    chosen = cli._console

    def recording():
        console = Recording(chosen().width)  # the width the CLI chose (stdout is a pipe here)
        consoles.append(console)
        return console

    monkeypatch.setattr(cli, "_console", recording)
    argv = [command, "fxsplit.models.deepseek_v4:example", "--runner", "v1"]
    argv += ["--out", "d"] if command == "dump" else ["--runner", "v2", "--nodes"]
    assert cli.main(argv) == 0
    (console,) = consoles
    assert console.width == 100
    assert max(len(line) for line in console.text.splitlines()) <= 100
    assert not cut_words(console) and "…" not in console.text
    if command == "diff":  # one line per moved node: its first cell is never empty
        moved = re.split(r": moved nodes *\n", console.text, maxsplit=1)[1]
        assert not re.search(r"^│\s+│", moved, re.MULTILINE), moved


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["dump", "no_colon"], "expected MODULE:FACTORY"),
        (["dump", "fxsplit_no_such_module:f"], "cannot import module 'fxsplit_no_such_module'"),
        (["dump", "fxsplit.models.deepseek_v4:nope"], "has no attribute 'nope'"),
        (["dump", "fxsplit.models.deepseek_v4:ATTN_PREP"], "is not callable"),
        (["dump", "tests.test_dump:not_a_pair"], "must return (model, example_inputs)"),
        (["dump", "tests.test_dump:tiny_factory", "--options", "{"], "not valid JSON"),
        (["dump", "tests.test_dump:tiny_factory", "--options", "[1]"], "must be a JSON object"),
        (["dump", "tests.test_dump:tiny_factory", "--options", '{"bogus": 1}'], "bogus"),
        (
            ["dump", "tests.test_dump:tiny_factory", "--options", '{"capture": "gpu"}'],
            "capture='gpu' is not allowed",
        ),
        (["dump", "tests.test_dump:tiny_factory", "--options", '{"dump_dir": 3}'], "dump_dir=3"),
        (["diff", "tests.test_dump:tiny_factory", "--runner", "v1"], "exactly twice"),
    ],
)
def test_cli_bad_arguments_exit_2(argv, message, capsys, tmp_path):
    assert cli.main([*argv, *(["--out", str(tmp_path)] if argv[0] == "dump" else [])]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith(f"fxsplit {argv[0]}: error: ")


def test_logger_registered_with_torch_logs():
    import fxsplit.trace

    assert fxsplit.trace.register_log()
    assert torch._logging._internal.log_registry.is_log("fxsplit")


_TRACE_SCRIPT = textwrap.dedent(
    """
    import torch, fxsplit
    from tests.test_dump import tiny_factory

    model, inputs = tiny_factory()
    backend = fxsplit.Backend(runner="v1", capture="off")
    torch.compile(model, backend=backend, dynamic=True)(*inputs)
    """
)


def test_torch_trace_holds_fxsplit_artifacts(tmp_path):
    env = {**os.environ, "TORCH_TRACE": str(tmp_path), "TORCH_LOGS": "fxsplit"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _TRACE_SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # TORCH_LOGS=fxsplit: the backend's INFO line per compiled graph
    assert re.search(r"graph_0: \d+ nodes -> 5 pieces \(3 captured, 2 eager\)", result.stderr)
    text = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert text.count('"name": "fxsplit_plan_graph_0"') == 1
    for i in range(5):
        assert f'"name": "fxsplit_graph_0_piece_{i}"' in text
    assert '"name": "fxsplit_graph_0_stitched"' in text
    # the plan payload follows its header line, tab-indented
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "fxsplit_plan_graph_0" in line)
    payload = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        payload.append(line[1:])
    plan = json.loads("\n".join(payload))
    assert plan["schema_version"] == dump.SCHEMA_VERSION and plan["num_pieces"] == 5
