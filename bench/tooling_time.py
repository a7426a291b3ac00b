"""Seconds the tools take where a user waits on them: a dump folder of a graph with many pieces
(``split.dot`` laid out by Graphviz, ``report.html``), and how long a tensor-parallel run whose
ranks hang takes to fail (``fxsplit.tools.tp_demo.spawn`` with a 5 s timeout; both ranks killed).

Usage: python bench/tooling_time.py [--layers 40] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import fxsplit
from fxsplit.tools import dump


class Deep(torch.nn.Module):
    """``layers`` eager attention regions, each followed by a captured piece reading the first
    piece's value (long edges in the picture): ``2 * layers + 1`` pieces."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        c = x.cos()
        h = x
        for _ in range(self.layers):
            with fxsplit.region(fxsplit.ATTENTION):
                h = h.softmax(-1)
            h = h * c + 1
        return h


def _split(layers: int):
    """The backend's split of :class:`Deep` and Dynamo's code of the graph."""
    backend = fxsplit.Backend(capture="off")
    codes = []

    def recording(gm, example_inputs, **kwargs):
        codes.append(gm.print_readable(print_output=False))
        return backend(gm, example_inputs, **kwargs)

    torch.compile(Deep(layers), backend=recording, fullgraph=True)(torch.randn(4, 8))
    return backend.compiled[0], codes[0]


def dump_seconds(layers: int, repeat: int) -> tuple[int, list[float]]:
    """(pieces, seconds per ``dump.write_dump`` call) for :class:`Deep`."""
    result, code = _split(layers)
    seconds = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(repeat):
            start = time.perf_counter()
            dump.write_dump(Path(root) / str(i), result, code)
            seconds.append(time.perf_counter() - start)
    return len(result.plan.pieces), seconds


def hang_seconds() -> float:
    """Seconds until two hanging ranks are killed and the spawn raises ``TimeoutError``."""
    from fxsplit.tools.tp_demo import spawn
    from tests import distributed_workers

    start = time.perf_counter()
    try:
        spawn(distributed_workers.hang, 2, timeout_s=5.0)
    except TimeoutError:
        return time.perf_counter() - start
    raise RuntimeError("the hanging ranks finished")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    pieces, seconds = dump_seconds(args.layers, args.repeat)
    dot = "with" if shutil.which("dot") else "without"
    print(
        f"dump of {pieces} pieces ({dot} Graphviz dot): median {statistics.median(seconds):.2f} s, "
        f"max {max(seconds):.2f} s over {len(seconds)}"
    )
    if torch.distributed.is_available():
        print(f"hanging ranks fail after {hang_seconds():.1f} s (timeout 5 s)")


if __name__ == "__main__":
    main()
