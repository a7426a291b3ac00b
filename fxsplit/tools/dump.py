"""Per-graph dump folders: how one compiled graph was split, why, and what each piece is.

:func:`write_dump` creates a new folder per compiled graph under a root folder and writes:

============================  ====================================================================
``dynamo_graph.py``           the Dynamo graph's code before the split
``plan.txt``                  :meth:`fxsplit.plan.SplitPlan.format`
``plan.json``                 the plan as data (:func:`fxsplit.plan_json.plan_dict`)
``piece_<i>.py``              each piece's generated code, with a header: kind, regions, reasons
``stitched.py``               the stitched top-level module's code
``split.dot``                 Graphviz source of the picture (always)
``split.svg``                 the picture, where Graphviz's ``dot`` program is installed (drawn
                              by ``dot``, up to :data:`DOT_TIMEOUT_S`)
``split_svg_missing.txt``     instead of ``split.svg`` where it is not: why and how to install it
``report.html``               self-contained report (:mod:`fxsplit.tools.report`)
``runtime.json``              run-time figures, once :func:`write_runtime_stats` is called
``compiled.json``             with Inductor pieces: per distinct piece, who shares it, compile
                              time, cache hit or miss (:func:`~fxsplit.plan_json.compiled_dict`)
``inductor_<piece>.py``       Inductor's output code of each piece compiled in this process
============================  ====================================================================

Folder names are ``<counter>_<model>_<runner>_<graph_id>`` (``000_DeepseekV4Model_v1_graph_0``,
``001_DeepseekV4Model_v2_graph_0``, ``002_DeepseekV4ForCausalLM_v2_graph_1``; the model is the
root module's class or the compiled function's name, left out where unknown): the counter is
process-wide and a folder that already exists (an earlier run, or another process writing to the
same root) is skipped, never overwritten.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from fxsplit import hooks
from fxsplit.plan import SplitPlan
from fxsplit.plan_json import (
    SCHEMA_VERSION,
    compiled_dict,
    dumps_json,
    piece_source,
    plan_dict,
)

__all__ = [
    "DOT_TIMEOUT_S",
    "KIND_COLOURS",
    "RUNTIME_COUNTERS",
    "plan_table",
    "split_graph",
    "titled",
    "write_dump",
    "write_runtime_stats",
]

KIND_COLOURS = {"captured": "#cfe3ff", "eager": "#ffd9b3"}
"""Fill colour per piece kind, shared by the picture and the HTML report."""

_INSTALL_NOTE = """\
split.svg was not drawn: {why}

The dump still holds split.dot, the Graphviz source of the picture. To get the SVG, install
Graphviz (the `dot` program) where it is missing and rerun, or render the source by hand:

    apt-get install -y graphviz      # Debian / Ubuntu
    dnf install -y graphviz          # Fedora / RHEL
    brew install graphviz            # macOS
    conda install -c conda-forge graphviz

    dot -Tsvg split.dot -o split.svg
"""

_PACKAGE_NOTE = """\
split.svg and split.dot were not written: {why}

Everything else in this folder was. Install the package and rerun to get the picture.
"""

log = logging.getLogger("fxsplit")

_counter = itertools.count()
_counter_lock = threading.Lock()


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", part)


def _new_folder(root: Path, label: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    while True:
        with _counter_lock:
            index = next(_counter)
        folder = root / f"{index:03d}_{label}"
        try:
            folder.mkdir()  # atomic: never reuses a folder another writer created
        except FileExistsError:
            continue
        return folder


def sharing_lines(plan: SplitPlan) -> list[str]:
    """``"same code: piece_1 = piece_3 = piece_5"`` per group of pieces sharing code."""
    return [f"same code: {' = '.join(names)}" for names in plan.sharing().values()]


def _label_list(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit})" if len(names) > limit else "")


def split_graph(split):
    """The picture of ``split`` as a ``graphviz.Digraph`` (needs no ``dot`` program to build).

    One box per piece, top to bottom in execution order, filled by kind (:data:`KIND_COLOURS`) and
    labelled with its name, kind, op count, regions, (eager) reasons and how many graph inputs it
    reads; an ``output`` node; one edge per pair of pieces that pass values (and per piece the
    graph output reads), labelled with the number of values, their names in the tooltip.

    The Python binding builds the source only; :func:`write_dump` runs ``dot`` itself, with a
    timeout (:data:`DOT_TIMEOUT_S`). Only edges between consecutive pieces constrain the layout
    (plus invisible ones that keep the execution order): edges that skip pieces and one edge per
    graph input would make ``dot``'s layout take minutes on graphs of a hundred pieces.
    """
    import graphviz

    plan: SplitPlan = split.plan
    stitched = split.stitched
    pieces = {p.name: p for p in plan.pieces}
    order = {p.name: i for i, p in enumerate(plan.pieces)}
    order["output"] = len(plan.pieces)

    def source(node) -> tuple[str | None, str]:
        if node.op == "call_module" and node.target in pieces:
            return str(node.target), pieces[str(node.target)].outputs[0]
        if (
            node.op == "call_function"
            and node.args
            and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].op == "call_module"
            and node.args[0].target in pieces
        ):
            return str(node.args[0].target), node.name
        return None, node.name  # a placeholder, get_attr or host value: a graph input

    edges: dict[tuple[str, str], list[str]] = {}
    graph_inputs: dict[str, list[str]] = {}
    for node in stitched.graph.nodes:
        if node.op == "call_module" and node.target in pieces:
            target = str(node.target)
        elif node.op == "output":
            target = "output"
        else:
            continue
        for arg in node.all_input_nodes:
            src, name = source(arg)
            names = (
                graph_inputs.setdefault(target, [])
                if src is None
                else edges.setdefault((src, target), [])
            )
            if name not in names:
                names.append(name)

    dot = graphviz.Digraph(name=plan.graph_id, comment=f"fxsplit {plan.graph_id}")
    dot.attr(rankdir="TB", fontname="Helvetica", label=graph_title(plan), labelloc="t")
    dot.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10")
    dot.attr("edge", fontname="Helvetica", fontsize="9")
    for piece in plan.pieces:
        lines = [f"{piece.name}", f"{piece.kind}, {piece.num_ops} ops"]
        if piece.regions:
            lines.append("regions: " + ", ".join(sorted(piece.regions)))
        if piece.reasons:
            lines.append("reasons: " + ", ".join(piece.reasons))
        if inputs := graph_inputs.get(piece.name):
            lines.append(f"+ {len(inputs)} graph input{'s' if len(inputs) != 1 else ''}")
        dot.node(
            piece.name,
            "\n".join(lines),
            fillcolor=KIND_COLOURS.get(piece.kind, "#ffffff"),
            tooltip=f"{piece.name} ({piece.kind}); graph inputs: "
            + (_label_list(graph_inputs.get(piece.name, []), 20) or "-"),
        )
    dot.node("output", "output", shape="oval", fillcolor="#eeeeee")
    chain = [p.name for p in plan.pieces] + ["output"]
    for a, b in itertools.pairwise(chain):
        if (a, b) not in edges:
            dot.edge(a, b, style="invis")
    for (src, dst), names in edges.items():
        attrs = {
            "label": f"{len(names)} value{'s' if len(names) != 1 else ''}",
            "tooltip": _label_list(names, 20),
        }
        if order[dst] != order[src] + 1:
            attrs.update(constraint="false", color="#777777")
        dot.edge(src, dst, **attrs)
    return dot


def graph_title(plan: SplitPlan) -> str:
    """``"graph_0, runner v1: 5 pieces (3 captured, 2 eager)"``."""
    return (
        f"{plan.graph_id}, runner {plan.runner}: {len(plan.pieces)} "
        f"piece{'s' if len(plan.pieces) != 1 else ''} "
        f"({len(plan.captured)} captured, {len(plan.eager)} eager)"
    )


DOT_TIMEOUT_S = 60.0
"""Longest wait for Graphviz's ``dot`` to draw ``split.svg``, in seconds; past it the dump keeps
``split.dot`` and a note instead."""


def _write_picture(folder: Path, split) -> None:
    try:
        source = split_graph(split).source
    except ImportError as error:  # a dump aid never stops a model
        why = f"the graphviz Python package is not installed ({error}): pip install graphviz"
        (folder / "split_svg_missing.txt").write_text(
            _PACKAGE_NOTE.format(why=why), encoding="utf-8"
        )
        return
    (folder / "split.dot").write_text(source, encoding="utf-8")
    dot = shutil.which("dot")
    if dot is None:
        why = "Graphviz's `dot` program is not installed (not found on PATH)."
    else:
        try:
            done = subprocess.run(
                [dot, "-Tsvg"],
                input=source.encode("utf-8"),
                capture_output=True,
                timeout=DOT_TIMEOUT_S,
                check=True,
            )
        except subprocess.TimeoutExpired:
            why = f"Graphviz's `dot` took longer than {DOT_TIMEOUT_S:g} s and was stopped."
        except subprocess.CalledProcessError as error:
            stderr = error.stderr.decode("utf-8", "replace").strip()
            why = f"Graphviz's `dot` failed (exit status {error.returncode}): {stderr}"
        except OSError as error:
            why = f"Graphviz's `dot` could not run: {error}"
        else:
            (folder / "split.svg").write_text(done.stdout.decode("utf-8"), encoding="utf-8")
            return
    (folder / "split_svg_missing.txt").write_text(_INSTALL_NOTE.format(why=why), encoding="utf-8")


def write_dump(
    root: str | os.PathLike,
    split,
    graph_code: str,
    *,
    example_inputs=None,
    model: str | None = None,
) -> Path:
    """Write the dump folder of one compiled graph under ``root`` (created if missing).

    Args:
        root: the dump root, e.g. the ``dump_dir`` option or ``$FXSPLIT_DUMP_DIR``.
        split: the :class:`fxsplit.passes.Split` the backend produced for the graph.
        graph_code: the Dynamo graph's code before the split (``gm.print_readable(False)`` or
            ``gm.code``; the split pass modifies the graph in place, so take it before).
        example_inputs: the example inputs Dynamo gave the backend (optional; described in
            ``plan.json``).
        model: what was compiled (the root module's class or the function's name), part of
            the folder name with the runner so dumps of models and runners tell apart.

    Returns:
        the new folder (see the module docstring for its name and files).

    Raises:
        OSError: the folder or a file cannot be written.
    """
    from fxsplit.tools import report

    plan = split.plan
    label = "_".join(_safe(part) for part in (model, plan.runner, plan.graph_id) if part)
    folder = _new_folder(Path(root), label)
    write = _writer(folder)
    write("dynamo_graph.py", graph_code if graph_code.endswith("\n") else graph_code + "\n")
    write("plan.txt", "\n".join([split.plan.format(), *sharing_lines(split.plan)]) + "\n")
    data = plan_dict(split, example_inputs=example_inputs)
    write("plan.json", dumps_json(data))
    for each in split.pieces:
        piece, module = each.plan, each.module
        write(f"{piece.name}.py", piece_source(piece, module.code))
    write("stitched.py", split.stitched.code.strip("\n") + "\n")
    if split.compiled_pieces is not None:
        write("compiled.json", dumps_json(compiled_dict(split.compiled_pieces)))
        for record in split.compiled_pieces:
            if record.output_code:
                write(f"inductor_{record.pieces[0]}.py", record.output_code)
    _write_picture(folder, split)
    report.write_report(folder)
    return folder


def _writer(folder: Path):
    def write(name: str, text: str) -> None:
        (folder / name).write_text(text, encoding="utf-8")

    return write


RUNTIME_COUNTERS = ("captures", "replays", "uncaptured_runs", "input_copies", "input_copy_bytes")
"""Run-time counters in their display order; others follow, sorted by name."""


def write_runtime_stats(folder: str | os.PathLike, stats: Mapping) -> None:
    """Write run-time figures into a dump folder and re-render its ``report.html``.

    Each call replaces the folder's ``runtime.json`` (pass totals, not increments).

    Args:
        folder: a folder :func:`write_dump` returned.
        stats: piece name -> capture key -> counters, e.g. ``{"piece_0": {"T=4": {"captures": 1,
            "replays": 9, "uncaptured_runs": 1, "input_copies": 3, "input_copy_bytes": 1024}}}``
            (counts; ``input_copy_bytes`` in bytes). Keys are written as strings.

    Raises:
        TypeError: ``stats`` is not shaped as above, or a counter is not a number.
        FileNotFoundError: ``folder`` holds no ``plan.json``.
    """
    from fxsplit.tools import report

    folder = Path(folder)
    if not (folder / "plan.json").is_file():
        raise FileNotFoundError(f"{folder} is not an fxsplit dump folder (no plan.json)")
    if not isinstance(stats, Mapping):
        raise TypeError(f"stats must map piece name -> capture key -> counters, got {stats!r}")
    clean: dict[str, dict[str, dict[str, int | float]]] = {}
    for piece, keys in stats.items():
        if not isinstance(keys, Mapping):
            raise TypeError(f"stats[{piece!r}] must map capture key -> counters, got {keys!r}")
        clean[str(piece)] = {}
        for key, counters in keys.items():
            if not isinstance(counters, Mapping) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in counters.values()
            ):
                raise TypeError(
                    f"stats[{piece!r}][{key!r}] must map counter name -> number, got {counters!r}"
                )
            clean[str(piece)][str(key)] = {str(k): v for k, v in counters.items()}
    (folder / "runtime.json").write_text(
        dumps_json({"schema_version": SCHEMA_VERSION, "pieces": clean}),
        encoding="utf-8",
    )
    report.write_report(folder)


def titled(title: str, table):
    """``table`` (a ``rich.table.Table``) under ``title``, a line of its own: rich pads a
    table's own title to the table's width, which leaves trailing spaces in piped output."""
    from rich.console import Group
    from rich.text import Text

    return Group(Text(title), table)


def plan_table(plan: SplitPlan, title: str | None = None):
    """The plan as a ``rich`` renderable: a title line (``title``, else :func:`graph_title`),
    then a table of piece, kind, ops, regions, reasons (rows by kind).

    Regions and reasons go one per line, so the table is as wide as its longest name; a name
    longer than the terminal leaves room for (``dynamic:cache.layers[0].values.size(2)`` at 80
    columns) folds onto the next line rather than being cut. A region a captured piece holds
    (``attn_prep`` under v2) reads ``attn_prep (captured)``, never like an eager region."""
    from rich.table import Table

    table = Table(pad_edge=False)
    table.add_column("piece")
    table.add_column("kind")
    table.add_column("ops", justify="right")
    table.add_column("regions")
    table.add_column("reasons", overflow="fold")
    for piece, kind, ops, regions, reasons in plan.rows(sep="\n"):
        if kind == "captured" and regions != "-":
            regions = "\n".join(f"{r} (captured)" for r in regions.split("\n"))
        style = "dark_orange" if kind == "eager" else None
        table.add_row(piece, kind, ops, regions, reasons, style=style)
    return titled(title or graph_title(plan), table)


def _graph_hook(graph: hooks.BuiltGraph):
    """The dump folder of ``graph`` where its config names a dump root; the finisher writes its
    run-time figures there (:mod:`fxsplit.hooks`)."""
    if not graph.config.dump_folder:
        return None
    folder = write_dump(
        graph.config.dump_folder,
        graph.split,
        graph.graph_code,
        example_inputs=graph.example_inputs,
        model=graph.model,
    )
    log.info("fxsplit %s: dump in %s", graph.split.plan.graph_id, folder)
    runtime = graph.runtime
    if runtime is None:
        return None
    return lambda: write_runtime_stats(folder, runtime.stats())


hooks.register(_graph_hook)
