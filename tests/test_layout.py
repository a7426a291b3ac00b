"""The package's layering: the runtime reads facts (``fxsplit/facts/``), never the compile half
(``fxsplit/passes/``) or the tools; the compile half and the package's other core modules reach
the tools only through :mod:`fxsplit.hooks`."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "fxsplit"
RUNTIME = sorted((ROOT / "runtime").rglob("*.py"))
# every module but the tools, their command line and the reference models (which the tools run)
CORE = sorted(
    p
    for p in ROOT.rglob("*.py")
    if p.relative_to(ROOT).parts[0] not in ("tools", "models") and p.name != "__main__.py"
)


def _runtime_imports(path: pathlib.Path, typing: bool = False) -> list[str]:
    """Modules ``path`` imports when it runs, and those its ``if TYPE_CHECKING:`` blocks import
    where ``typing``."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    if not typing:
        typing_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for stmt in block.body
            for node in ast.walk(stmt)
        }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runtime_imports_nothing_from_the_passes_or_the_tools(path):
    """Not even for type annotations: the records it reads live in leaf modules."""
    bad = [
        name
        for name in _runtime_imports(path, typing=True)
        if name.startswith(("fxsplit.passes", "fxsplit.tools"))
    ]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(ROOT)))
def test_core_modules_reach_the_tools_only_through_hooks(path):
    bad = [name for name in _runtime_imports(path) if name.startswith("fxsplit.tools")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_a_runtime_module_that_imported_a_pass_would_be_caught(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fxsplit.passes import Split\n"
        "def f():\n    from fxsplit.passes import op_facts\n"
    )
    assert _runtime_imports(module, typing=True) == [
        "typing",
        "typing.TYPE_CHECKING",
        "fxsplit.passes",
        "fxsplit.passes.Split",
        "fxsplit.passes",
        "fxsplit.passes.op_facts",
    ]
    assert _runtime_imports(module) == [
        "typing",
        "typing.TYPE_CHECKING",
        "fxsplit.passes",
        "fxsplit.passes.op_facts",
    ]


@pytest.mark.parametrize("name", ["piece/captured.py", "step/graph_runtime.py"])
def test_the_runtimes_central_modules_stay_under_500_lines(name):
    lines = len((ROOT / "runtime" / name).read_text().splitlines())
    assert lines < 500, f"fxsplit/runtime/{name} has {lines} lines"


def test_the_runtime_is_rooms_a_replay_walks_through():
    """Every module of the run time lives in a room named after the path of a replay."""
    rooms = {
        p.relative_to(ROOT / "runtime").parts[0] for p in RUNTIME if p.parent != ROOT / "runtime"
    }
    assert rooms == {"step", "piece", "inputs", "memory", "emulation", "cuda"}
    assert [p.name for p in RUNTIME if p.parent == ROOT / "runtime"] == ["__init__.py"]
