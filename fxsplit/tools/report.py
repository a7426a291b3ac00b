"""The self-contained HTML report of a dump folder (``report.html``).

One file, no network and no external assets: inline CSS, the ``split.svg`` picture inlined when
present, no script. It shows the plan table (piece, kind, ops, regions, reasons; rows coloured by
kind), each eager piece's reasons, the picture, each piece's code in a collapsible ``<details>``
with its inputs and outputs (shapes, dtypes), the stitched and Dynamo code, and, in a "Run time"
section only when :func:`fxsplit.tools.dump.write_runtime_stats` wrote ``runtime.json``, its
figures (a counter missing for a capture key shows as 0).
Everything taken from the dump is escaped with :func:`html.escape`.
"""

from __future__ import annotations

import json
import os
import re
from html import escape
from pathlib import Path

from fxsplit.runtime.piece.replay_watch import summary
from fxsplit.tools.dump import KIND_COLOURS, RUNTIME_COUNTERS

__all__ = ["render", "write_report"]

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       margin: 1.5em; color: #1d1d1f; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #c8c8c8; padding: 0.25em 0.6em; text-align: left;
         vertical-align: top; font-size: 0.9em; }
th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.captured td.kind, .kind-captured { background: CAPTURED; }
tr.eager td.kind, .kind-eager { background: EAGER; }
tr.captured { background: CAPTURED_LIGHT; } tr.eager { background: EAGER_LIGHT; }
.legend span { padding: 0.1em 0.6em; border: 1px solid #c8c8c8; margin-right: 0.5em; }
pre { background: #f7f7f7; border: 1px solid #e0e0e0; padding: 0.6em; overflow-x: auto;
      font-size: 0.8em; line-height: 1.35; }
details { margin: 0.3em 0; } summary { cursor: pointer; padding: 0.2em 0; }
summary .kind-captured, summary .kind-eager { padding: 0 0.4em; border-radius: 3px; }
.picture { overflow: auto; border: 1px solid #e0e0e0; padding: 0.5em; max-height: 60em; }
.note { color: #7a4a00; } .muted { color: #666; }
ul.reasons { margin: 0.2em 0 0.6em 1.2em; padding: 0; }
"""


def _css() -> str:
    return (
        _CSS.replace("CAPTURED_LIGHT", "#eef5ff")
        .replace("EAGER_LIGHT", "#fff3e6")
        .replace("CAPTURED", KIND_COLOURS["captured"])
        .replace("EAGER", KIND_COLOURS["eager"])
    )


def _read(folder: Path, name: str) -> str | None:
    path = folder / name
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _kind(kind: str) -> str:
    return f'<span class="kind-{escape(kind)}">{escape(kind)}</span>'


def _values(values: list[dict]) -> str:
    if not values:
        return '<span class="muted">-</span>'
    items = []
    for v in values:
        text = escape(v["name"])
        if v.get("type") == "Tensor":
            dims = ", ".join(str(d) for d in v.get("shape", []))
            text += f" <span class=muted>{escape(v.get('dtype', ''))}[{escape(dims)}]</span>"
        elif "value" in v:
            text += f" <span class=muted>{escape(v['type'])} = {escape(v['value'])}</span>"
        elif v.get("type"):
            text += f" <span class=muted>{escape(v['type'])}</span>"
        items.append(text)
    return ", ".join(items)


def _plan_table(plan: dict) -> str:
    rows = [
        "<table id=plan><thead><tr><th>piece</th><th>kind</th><th>ops</th><th>regions</th>"
        "<th>reasons</th><th>inputs</th><th>outputs</th></tr></thead><tbody>"
    ]
    for p in plan["pieces"]:
        rows.append(
            f'<tr class="piece {escape(p["kind"])}" id="row-{escape(p["name"])}">'
            f'<td><a href="#code-{escape(p["name"])}">{escape(p["name"])}</a></td>'
            f'<td class="kind">{escape(p["kind"])}</td>'
            f'<td class="num">{int(p["num_ops"])}</td>'
            f"<td>{escape(', '.join(p['regions']) or '-')}</td>"
            f"<td>{escape(', '.join(p['reasons']) or '-')}</td>"
            f'<td class="num">{len(p["inputs"])}</td>'
            f'<td class="num">{len(p["outputs"])}</td></tr>'
        )
    rows.append("</tbody></table>")
    return "\n".join(rows)


def _eager_reasons(plan: dict) -> str:
    eager = [p for p in plan["pieces"] if p["kind"] == "eager"]
    if not eager:
        return "<p>No eager piece: the whole graph is captured.</p>"
    out = []
    for p in eager:
        reasons = "".join(f"<li><code>{escape(r)}</code></li>" for r in p["reasons"]) or (
            "<li class=muted>no reason recorded</li>"
        )
        out.append(
            f"<p><b>{escape(p['name'])}</b> ({int(p['num_ops'])} ops, regions "
            f"{escape(', '.join(p['regions']) or '-')}) runs eagerly because:</p>"
            f"<ul class=reasons>{reasons}</ul>"
        )
    return "\n".join(out)


_PROLOGUE = re.compile(r"^\s*(<\?xml[^>]*\?>\s*)?(<!DOCTYPE[^>]*>\s*)?", re.IGNORECASE)


def _picture(folder: Path) -> str:
    svg = _read(folder, "split.svg")
    if svg is not None:
        # dot's own output (labels escaped by Graphviz); inlined without its XML prologue.
        return f'<div class="picture">{_PROLOGUE.sub("", svg)}</div>'
    note = _read(folder, "split_svg_missing.txt") or "split.svg is missing."
    return f'<p class="note">No picture.</p><pre class="note">{escape(note)}</pre>'


def _pieces(folder: Path, plan: dict) -> str:
    out = []
    for p in plan["pieces"]:
        code = _read(folder, p.get("file", f"{p['name']}.py")) or "(code file missing)"
        out.append(
            f'<details class="piece-code" id="code-{escape(p["name"])}"><summary>'
            f"<b>{escape(p['name'])}</b> {_kind(p['kind'])} {int(p['num_ops'])} ops"
            f"{' · ' + escape(', '.join(p['reasons'])) if p['reasons'] else ''}</summary>"
            f"<p>inputs: {_values(p['inputs'])}</p><p>outputs: {_values(p['outputs'])}</p>"
            f"<pre><code>{escape(code)}</code></pre></details>"
        )
    return "\n".join(out)


def _runtime(folder: Path, plan: dict) -> list[str]:
    """The "Run time" section, or none where ``runtime.json`` is missing: a graph dumped by
    ``fxsplit dump`` or with capture off never runs captured, and an empty section only said
    so."""
    text = _read(folder, "runtime.json")
    if text is None:
        return []
    stats = json.loads(text).get("pieces", {})
    extra = sorted({c for keys in stats.values() for cs in keys.values() for c in cs})
    counters = [c for c in RUNTIME_COUNTERS if c in extra] + [
        c for c in extra if c not in RUNTIME_COUNTERS
    ]
    kinds = {p["name"]: p["kind"] for p in plan["pieces"]}
    head = "".join(f"<th>{escape(c)}</th>" for c in counters)
    line = summary(plan["graph_id"], stats)
    rows = [
        f'<p id="replays">{escape(line or "No captured piece ran.")}</p>',
        f"<table id=runtime><thead><tr><th>piece</th><th>kind</th><th>capture key</th>{head}"
        "</tr></thead><tbody>",
    ]
    for piece in sorted(stats, key=_piece_order):
        kind = kinds.get(piece, "?")
        for key, values in stats[piece].items():
            cells = "".join(
                f'<td class="num">{escape(str(values.get(c, 0)))}</td>' for c in counters
            )
            rows.append(
                f'<tr class="{escape(kind)}"><td>{escape(piece)}</td><td class="kind">'
                f"{escape(kind)}</td><td><code>{escape(key)}</code></td>{cells}</tr>"
            )
    rows.append("</tbody></table>")
    return ["<h2>Run time</h2>", "\n".join(rows)]


def _compiled(folder: Path) -> str:
    text = _read(folder, "compiled.json")
    if text is None:
        return '<p class="muted">Pieces run as generated Python (compile_pieces="eager").</p>'
    rows = [
        "<table id=compiled><thead><tr><th>pieces</th><th>outcome</th><th>seconds</th>"
        "<th>reason</th></tr></thead><tbody>"
    ]
    codes = []
    for record in json.loads(text):
        rows.append(
            f"<tr><td>{escape(' = '.join(record['pieces']))}</td>"
            f"<td>{escape(record['outcome'])}</td>"
            f'<td class="num">{record["seconds"]:.2f}</td>'
            f"<td>{escape(record['reason'] or '-')}</td></tr>"
        )
        if record.get("code_file"):
            code = _read(folder, record["code_file"]) or ""
            codes.append(
                f"<details><summary>Inductor code of {escape(record['pieces'][0])}</summary>"
                f"<pre><code>{escape(code)}</code></pre></details>"
            )
    rows.append("</tbody></table>")
    return "\n".join(rows + codes)


def _piece_order(name: str) -> tuple[int, str]:
    tail = name.rsplit("_", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


def render(folder: str | os.PathLike) -> str:
    """The HTML report of dump ``folder`` as a string.

    Raises:
        FileNotFoundError: ``folder`` holds no ``plan.json``.
    """
    folder = Path(folder)
    plan_path = folder / "plan.json"
    if not plan_path.is_file():
        raise FileNotFoundError(f"{folder} is not an fxsplit dump folder (no plan.json)")
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    title = f"fxsplit {plan['graph_id']} (runner {plan['runner']})"
    summary = (
        f"{plan['num_nodes']} nodes, {plan['num_pieces']} pieces: {plan['num_captured']} "
        f"captured, {plan['num_eager']} eager; eager regions: "
        f"{', '.join(plan['eager_regions']) or '-'}; split in {plan['split_ms']:.1f} ms "
        f"(torch {plan.get('torch_version', '?')})"
    )
    stitched = _read(folder, "stitched.py") or ""
    dynamo = _read(folder, "dynamo_graph.py") or ""
    plan_txt = _read(folder, "plan.txt") or ""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_css()}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>{escape(summary)}</p>",
        '<p class="legend">'
        + "".join(f'<span class="kind-{k}">{k}</span>' for k in KIND_COLOURS)
        + "</p>",
        "<h2>Plan</h2>",
        _plan_table(plan),
        "<details><summary>plan.txt</summary>",
        f"<pre>{escape(plan_txt)}</pre></details>",
        "<h2>Why pieces run eagerly</h2>",
        _eager_reasons(plan),
        "<h2>Picture</h2>",
        _picture(folder),
        *_runtime(folder, plan),
        "<h2>Compiled pieces</h2>",
        _compiled(folder),
        "<h2>Pieces</h2>",
        _pieces(folder, plan),
        "<h2>Stitched module</h2>",
        f"<details><summary>stitched.py</summary><pre><code>{escape(stitched)}</code></pre>"
        "</details>",
        "<h2>Dynamo graph before the split</h2>",
        f"<details><summary>dynamo_graph.py</summary><pre><code>{escape(dynamo)}</code></pre>"
        "</details>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def write_report(folder: str | os.PathLike) -> Path:
    """Render the report of dump ``folder`` into ``folder/report.html`` and return its path.

    Raises:
        FileNotFoundError: ``folder`` holds no ``plan.json``.
        OSError: the file cannot be written.
    """
    path = Path(folder) / "report.html"
    path.write_text(render(folder), encoding="utf-8")
    return path
