"""The README and the pages under docs/: every relative link resolves (the file exists and, for
``page.md#anchor``, the page has that heading), and the README stays an entry page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens (code spans keep their text)."""
    anchors = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (heading := re.match(r"#+ (.*)", line)):
            text = heading.group(1).strip().lower().replace("`", "")
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def _links(page: Path) -> list[str]:
    """The link targets of a page's prose (not of its code blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return LINK.findall(text)


def test_anchors_follow_githubs_rule():
    page = REPO / "docs" / "capture.md"
    assert {"whose-memory-fxsplit-writes", "one-memory-pool-in-capture-order"} <= _anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert broken == [], f"{page.name}: " + "; ".join(broken)


def test_the_readme_is_an_entry_page():
    """About 250 lines: the manual lives under docs/, where the README links to every page."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 300
    linked = {target.partition("#")[0] for target in _links(REPO / "README.md")}
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= linked


def test_every_counter_has_one_definition_the_docs_repeat():
    """docs/capture.md's counter table is ``fxsplit.counters.DEFINITIONS``, row for row, and
    the demo's legend says the counters it shows in the same words."""
    from fxsplit import counters
    from fxsplit.tools import demo

    page = (REPO / "docs" / "capture.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", page.split("## Counters", 1)[1], re.MULTILINE)
    assert dict(rows) == counters.DEFINITIONS and len(rows) == len(counters.NAMES)
    legend = dict(demo.LEGEND)
    for word, name in [("captures", "captures"), ("uncaptured", "uncaptured_runs")]:
        assert legend[word] == counters.DEFINITIONS[name]


def _cells(row: str) -> int:
    """A table row's cell count as GitHub reads it: every unescaped ``|`` delimits, in code
    spans too."""
    return len(re.findall(r"(?<!\\)\|", row.strip().strip("|"))) + 1


@pytest.mark.parametrize(
    "page", [*PAGES, REPO / "bench" / "README.md"], ids=lambda p: str(p.relative_to(REPO))
)
def test_every_table_row_has_its_headers_cells(page):
    """A row with more or fewer cells than its header (two rows run together, a row cut in
    two by a later insertion) renders shifted or not at all."""
    bad, header, in_code = [], None, False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("|"):
            header = None
            continue
        if header is None:
            header = _cells(line)
        elif _cells(line) != header:
            bad.append(f"line {number}: {_cells(line)} cells, its header {header}")
    assert bad == [], f"{page.name}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_a_page_names_exists(page):
    """``test_x.py::test_name`` in a page (the fault table's third column) names a test
    function of that module under tests/ (a renamed test leaves the guarantee unreferenced);
    ``test_x.py::test_name_...`` names every test starting so, at least one."""
    missing = []
    for module, name in re.findall(r"(test_\w+\.py)::(\w+)", page.read_text(encoding="utf-8")):
        found = list((REPO / "tests").rglob(module))
        pattern = rf"^\s*(async )?def {name}" + (r"\w*" if name.endswith("_") else r"\(")
        if not any(re.search(pattern, f.read_text(), re.M) for f in found):
            missing.append(f"{module}::{name}")
    assert missing == [], f"{page.name}: " + ", ".join(missing)
