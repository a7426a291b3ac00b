"""The split as data and text: ``plan.json``'s content, a piece's source with its header, and
the JSON layout both the dump (:mod:`fxsplit.tools.dump`) and the structured trace
(:mod:`fxsplit.trace`) write.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import torch

from fxsplit.plan import Piece, SplitPlan

__all__ = [
    "SCHEMA_VERSION",
    "compiled_dict",
    "dumps_json",
    "piece_source",
    "plan_dict",
    "value_info",
]

SCHEMA_VERSION = 1
"""Version of ``plan.json``'s layout; bumped on any change of keys or their meaning."""


def _dims(shape: Iterable[object]) -> list[int | str]:
    return [d if isinstance(d, int) else str(d) for d in shape]


def value_info(name: str, value: object) -> dict:
    """Describe one value a piece reads or returns.

    Returns:
        ``{"name", "type"}``, plus ``"shape"`` (ints, or strings for symbolic sizes such as
        ``"s72"``), ``"dtype"`` and ``"device"`` for a tensor, ``"value"`` (as a string) for a
        SymInt / SymFloat / SymBool / int / float / bool, ``"length"`` for a tuple or list.
        ``"type"`` is ``"unknown"`` where the graph recorded no example value.
    """
    info: dict = {"name": name}
    if value is None:
        info["type"] = "unknown"
    elif isinstance(value, torch.Tensor):
        info["type"] = "Tensor"
        info["shape"] = _dims(value.shape)
        info["dtype"] = str(value.dtype)
        info["device"] = str(value.device)
    elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        info["type"] = type(value).__name__
        info["value"] = str(value)
    elif isinstance(value, (tuple, list)):
        info["type"] = type(value).__name__
        info["length"] = len(value)
    else:
        info["type"] = type(value).__name__
    return info


def _values_by_name(split) -> dict[str, object]:
    """Example value of every named value in the split graph (placeholders, get_attr, nodes)."""
    stitched = split.stitched
    values: dict[str, object] = {}
    for node in stitched.graph.nodes:
        if node.op == "placeholder":
            values[node.name] = node.meta.get("example_value")
        elif node.op == "get_attr":
            value = node.meta.get("example_value")
            if value is None:
                value = stitched
                for atom in str(node.target).split("."):
                    value = getattr(value, atom, None)
            values[node.name] = value
    for node in (*split.marks.host, *split.marks.nodes):
        values[node.name] = node.meta.get("example_value")
    return values


def _example_inputs(example_inputs) -> list[dict] | None:
    if example_inputs is None:
        return None
    return [value_info(str(i), v) for i, v in enumerate(example_inputs)]


def plan_dict(split, *, example_inputs=None) -> dict:
    """The plan of ``split`` as JSON-ready data (the content of ``plan.json``).

    Args:
        split: a :class:`fxsplit.passes.Split`.
        example_inputs: the graph's example inputs as Dynamo passed them to the backend; described
            (:func:`value_info`) under ``"example_inputs"`` when given, else that key is None.

    Returns:
        ``schema_version``, ``graph_id``, ``runner``, ``eager_regions`` (sorted), ``num_nodes``,
        ``num_pieces``, ``num_captured``, ``num_eager``, ``split_ms`` (wall time of the split,
        milliseconds), ``torch_version``, ``graph_inputs`` (the placeholders), ``example_inputs``
        and ``pieces``: per piece ``name``, ``kind``, ``regions`` (sorted), ``reasons``,
        ``num_ops``, ``nodes``, ``inputs`` / ``outputs`` (:func:`value_info` each), ``file``
        and ``same_code_as`` (the first piece whose code it shares, or None).
    """
    plan: SplitPlan = split.plan
    values = _values_by_name(split)
    placeholders = [n.name for n in split.stitched.graph.nodes if n.op == "placeholder"]
    return {
        "schema_version": SCHEMA_VERSION,
        "graph_id": plan.graph_id,
        "runner": plan.runner,
        "eager_regions": sorted(plan.eager_regions),
        "num_nodes": plan.num_nodes,
        "num_pieces": len(plan.pieces),
        "num_captured": len(plan.captured),
        "num_eager": len(plan.eager),
        "split_ms": round(plan.split_seconds * 1e3, 3),
        "torch_version": str(torch.__version__),
        "graph_inputs": [value_info(n, values.get(n)) for n in placeholders],
        "example_inputs": _example_inputs(example_inputs),
        "pieces": [
            {
                "name": p.name,
                "kind": p.kind,
                "regions": sorted(p.regions),
                "reasons": list(p.reasons),
                "num_ops": p.num_ops,
                "nodes": list(p.nodes),
                "inputs": [value_info(n, values.get(n)) for n in p.inputs],
                "outputs": [value_info(n, values.get(n)) for n in p.outputs],
                "file": f"{p.name}.py",
                "same_code_as": p.same_as,
            }
            for p in plan.pieces
        ],
    }


def compiled_dict(records) -> list[dict]:
    """The Inductor pass's records (:class:`fxsplit.passes.inductor.CompiledPiece`) as JSON-ready
    data (the content of ``compiled.json``): per distinct captured piece, the ``pieces`` sharing
    it, ``outcome`` (compiled / disk / memory / bundle / pending / eager), ``seconds``, ``reason``,
    ``key`` and ``code_file`` (Inductor's output code, where this process generated it)."""
    return [
        {
            "pieces": list(r.pieces),
            "outcome": r.outcome,
            "seconds": round(r.seconds, 3),
            "reason": r.reason,
            "key": r.key,
            "code_file": f"inductor_{r.pieces[0]}.py" if r.output_code else None,
        }
        for r in records
    ]


def piece_source(piece: Piece, code: str) -> str:
    """``code`` of ``piece`` with a comment header: kind, ops, regions, reasons, inputs, outputs."""
    header = [
        f"# {piece.name}: {piece.kind}, {piece.num_ops} ops",
        f"# regions: {', '.join(sorted(piece.regions)) or '-'}",
        f"# reasons: {', '.join(piece.reasons) or '-'}",
        f"# inputs: {', '.join(piece.inputs) or '-'}",
        f"# outputs: {', '.join(piece.outputs) or '-'}",
    ]
    if piece.same_as:
        header.append(f"# runs the code of {piece.same_as} (same structure, other inputs)")
    return "\n".join(header) + "\n\n" + code.strip("\n") + "\n"


_SCALAR_LIST = re.compile(r"\[\n\s*([^\[\]{}]*?)\n\s*\]")


def dumps_json(data: object) -> str:
    """``data`` as indented JSON text with each list of scalars (shapes, names) on one line."""
    text = json.dumps(data, indent=1)
    return _SCALAR_LIST.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text) + "\n"
