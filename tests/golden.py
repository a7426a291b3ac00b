"""Helpers for golden tests: run a model through fxsplit and render what must stay stable."""

from __future__ import annotations

import re

import torch

import fxsplit


def compile_and_run(model, args, dynamic=True, **options):
    """Compile ``model`` with a fresh Backend, call it once; return (backend, output)."""
    torch._dynamo.reset()
    backend = fxsplit.Backend(**options)
    out = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)(*args)
    return backend, out


def stitched_code(backend: fxsplit.Backend, index: int = 0) -> str:
    """The stitched module's code with placeholder and symbol names numbered in order.

    Dynamo's names (``l_x_``, ``L_x_``, ``s77``) change between torch versions; piece and value
    names do not.
    """
    gm = backend.compiled[index].stitched
    code = gm.code.strip()
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        code = re.sub(rf"\b{re.escape(str(node.target))}\b", f"IN{i}", code)
        code = re.sub(rf"\b{re.escape(node.name)}\b", f"in{i}", code)
    code = re.sub(r" : torch\.[A-Za-z.]+", "", code)
    return "\n".join(line.rstrip() for line in code.splitlines())
