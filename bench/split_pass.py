"""Time fxsplit's split pass against torch.fx's split_module on a large Dynamo graph.

The graph: 60 layers, each 80 iterations of three elementwise ops, one parameter add and one
custom op (the splitting op), then one last op; batch dimension dynamic: about 14,600 nodes,
121 pieces.

Prints, in one run: (a) the split decision (mark + partition) and (b) the whole backend call
until the compiled callable is ready (normalise, mark, partition, code generation and
compilation of every piece and of the stitched module, pieces as generated Python), each
against ``torch.fx.passes.split_module.split_module(keep_original_order=True)`` on the same
graph, and (b) against the default ``split_module`` (topological order); then the targets:
(b) >= 10x faster than the first, >= 5x faster than the second.

Usage: python bench/split_pass.py [--layers 60] [--iters 80] [--repeat 3] [--profile 25]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time

import torch
from torch.fx.passes.split_module import split_module

import fxsplit
from fxsplit import passes
from fxsplit.passes import mark as mark_pass
from fxsplit.passes import normalise, partition


@torch.library.custom_op("fxsplit_bench::mix", mutates_args=())
def mix(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@mix.register_fake
def _(x):
    return torch.empty_like(x)


class Stack(torch.nn.Module):
    def __init__(self, layers: int, iters: int):
        super().__init__()
        self.iters = iters
        self.bias = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(16)) for _ in range(layers)
        )

    def forward(self, x):
        for bias in self.bias:
            for _ in range(self.iters):
                x = torch.relu(x * 1.01 + 0.1)
            x = mix(x + bias)
        return x * 2


def dynamo_graph(layers: int, iters: int) -> torch.fx.GraphModule:
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Stack(layers, iters), backend=grab, dynamic=True)(torch.randn(4, 16))
    return graphs[0]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _profile(fn, top: int) -> None:
    """Print the ``top`` functions of one ``fn()`` call by own time, and by cumulative time."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    for order in ("tottime", "cumulative"):
        print(f"profile of (b), by {order}:")
        stats = pstats.Stats(profiler, stream=sys.stdout).strip_dirs().sort_stats(order)
        stats.print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--iters", type=int, default=80)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile one more backend call (b): its N most expensive functions",
    )
    args = parser.parse_args()

    start = time.perf_counter()
    gm = dynamo_graph(args.layers, args.iters)
    print(f"Dynamo trace: {time.perf_counter() - start:.1f} s, {len(gm.graph.nodes)} nodes")
    op = torch.ops.fxsplit_bench.mix.default
    policy = mark_pass.Policy.build(fxsplit.runners.get("v1"), ["fxsplit_bench::mix"])

    ids: dict[torch.fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target is op:
            current += 1
            ids[node] = current
            current += 1
        else:
            ids[node] = current
    baseline = best(
        lambda: split_module(gm, None, ids.__getitem__, keep_original_order=True), args.repeat
    )
    default = best(lambda: split_module(gm, None, ids.__getitem__), args.repeat)

    normalised = copy.deepcopy(gm)
    normalise.normalise(normalised.graph)
    decide = best(
        lambda: partition.partition(mark_pass.mark(normalised.graph, policy)), args.repeat
    )
    parts = partition.partition(mark_pass.mark(normalised.graph, policy))
    backend = fxsplit.Backend(
        splitting_ops=["fxsplit_bench::mix"], capture="off", compile_pieces="eager"
    )
    example = [torch.randn(4, 16)]
    copies = [copy.deepcopy(gm) for _ in range(args.repeat)]
    whole = best(lambda: backend(copies.pop(), example), args.repeat)
    codegen = best(lambda: gm.graph.python_code("self"), args.repeat)
    plain = [copy.deepcopy(gm) for _ in range(args.repeat)]
    analysed = [copy.deepcopy(gm) for _ in range(args.repeat)]
    without = best(lambda: passes.split(plain.pop(), policy), args.repeat)
    with_aliasing = best(lambda: passes.split(analysed.pop(), policy, analyse=True), args.repeat)

    print(f"pieces: {len(parts)} ({sum(p.kind == 'eager' for p in parts)} eager)")
    print(f"split_module (keep_original_order=True): {baseline * 1e3:8.1f} ms")
    print(f"split_module (default order):            {default * 1e3:8.1f} ms")
    print(f"fx code generation of the unsplit graph: {codegen * 1e3:8.1f} ms (floor reference)")
    print(
        f"(a) split decision (mark + partition):   {decide * 1e3:8.1f} ms"
        f"  {baseline / decide:6.1f}x faster"
    )
    print(
        f"(b) whole backend split, code included:  {whole * 1e3:8.1f} ms"
        f"  {baseline / whole:6.1f}x faster"
    )
    for name, reference, target in (
        ("split_module(keep_original_order=True)", baseline, 10),
        ("split_module (default order)", default, 5),
    ):
        ratio = reference / whole
        verdict = "met" if ratio >= target else "NOT met"
        print(f"target: (b) >= {target}x faster than {name}: {ratio:.1f}x, {verdict}")
    print(
        f"(c) aliasing analysis of the {len(parts) - sum(p.kind == 'eager' for p in parts)} "
        f"captured pieces (capture on): +{(with_aliasing - without) * 1e3:.1f} ms "
        f"({without * 1e3:.1f} -> {with_aliasing * 1e3:.1f} ms)"
    )
    if args.profile:
        fresh = copy.deepcopy(gm)
        _profile(lambda: backend(fresh, example), args.profile)


if __name__ == "__main__":
    main()
