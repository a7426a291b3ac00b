"""Host overhead of a captured piece per call: binding checks plus replay dispatch.

Compiles the DeepSeek-V4 reference model with the CPU capture emulator, captures every piece,
then replaces each graph's replay with a no-op so that only fxsplit's own per-call work remains:
key building, the entry lookup, the data-pointer table checks of runner and internal inputs
(parameters are checked once per step, not per piece), the replay call and the counters; and
the per-step check that no loan of a captured output was kept by an eager op. Each
captured piece is then called with the real inputs it saw in a decode step, lifted parameters
included. Each eager piece is timed as the runtime calls it, its body replaced by nothing:
as a module, or through its loans where it reads captured outputs it may keep.

Usage: python bench/replay_overhead.py [--calls 20000] [--runner v1|v2]
"""

from __future__ import annotations

import argparse
import time

import torch

import fxsplit
from fxsplit.models import deepseek_v4
from fxsplit.runtime.memory.lending import Borrower


class _NoOp(torch.nn.Module):
    """An eager piece that does nothing: what remains of a call is the call and the lending."""

    def forward(self, *inputs):
        return None


def _per_call_us(piece, inputs, calls: int) -> float:
    call = piece.__call__
    for _ in range(1000):
        call(*inputs)
    start = time.perf_counter()
    for _ in range(calls):
        call(*inputs)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--runner", default="v2")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    config = deepseek_v4.DeepseekV4Config(num_layers=args.layers)
    model = deepseek_v4.build(config)
    persistent = fxsplit.runners.get(args.runner).persistent_inputs
    feed = deepseek_v4.DecodeRunner(config, 8, persistent=persistent)
    backend = fxsplit.Backend(runner=args.runner, capture="emulate", warmup_runs=0)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    step = feed.step(4)
    with torch.no_grad():
        compiled(*step)  # captures every piece
        runtime = backend.runtimes[0]
        seen, originals, graph_args = {}, {}, {}
        for piece in runtime.pieces:
            originals[piece.name] = piece.run_eagerly

            def record(*inputs, _name=piece.name):
                seen[_name] = inputs
                return originals[_name](*inputs)

            for entry in piece.entries.values():
                entry.graph.replay = lambda: None
            piece.run_eagerly = record
        forward = runtime._forward

        def spy(*graph_inputs):
            graph_args["inputs"] = graph_inputs
            return forward(*graph_inputs)

        # One uncaptured step (no size is a capture size) records every piece's real inputs.
        runtime._forward, runtime.capture_sizes = spy, frozenset()
        compiled(*step)
        runtime._forward, runtime.capture_sizes = forward, None
        for piece in runtime.pieces:
            piece.run_eagerly = originals[piece.name]
        runtime.context.capture_step = True

        rows = []
        for piece in runtime.pieces:
            entry = next(iter(piece.entries.values()))
            bound = _per_call_us(piece, entry.statics, args.calls)
            real = _per_call_us(piece, seen[piece.name], args.calls)
            params = sum(s.kind == "param" for s in piece.specs)
            rows.append((piece.name, len(entry.statics), params, len(entry.checks), bound, real))

        check, inputs = runtime._follow_params, graph_args["inputs"]
        start = time.perf_counter()
        for _ in range(args.calls):
            check(inputs)
        per_step = (time.perf_counter() - start) / args.calls * 1e6

        loans = runtime.pool.ledger.loans
        start = time.perf_counter()
        for _ in range(args.calls):
            loans.settle()
        settle_us = (time.perf_counter() - start) / args.calls * 1e6
        lent = len(loans.lent)

        # One replayed step records what each eager piece is handed, as the stitched module
        # calls it: a Borrower where it reads captured outputs it may keep, else the module.
        stitched = runtime._stitched
        eager = {
            each.module.name: getattr(stitched, each.module.name)
            for each in runtime.split.pieces
            if each.part.kind != "captured"
        }
        eager_inputs = {}
        for name, called in eager.items():

            def spy_eager(*inputs, _name=name, _called=called):
                eager_inputs[_name] = inputs
                return _called(*inputs)

            object.__setattr__(stitched, name, spy_eager)
        compiled(*step)
        for name, called in eager.items():
            if isinstance(called, Borrower):
                object.__setattr__(stitched, name, called)
            else:
                del stitched.__dict__[name]
        lending = []
        for name, called in eager.items():
            piece_inputs = eager_inputs[name]
            noop = _NoOp()
            positions = called.positions if isinstance(called, Borrower) else ()
            lent_call = Borrower(noop, positions, (), loans) if positions else noop
            lending.append(
                (
                    name,
                    len(positions),
                    _per_call_us(noop, piece_inputs, args.calls),  # as an nn.Module call
                    _per_call_us(lent_call, piece_inputs, args.calls),
                )
            )

    print(f"runner {args.runner}, {len(runtime.pieces)} captured pieces, {args.calls} calls each")
    print("us/call bound: inputs at their captured addresses (steady state, no copies)")
    print("us/call step:  the inputs of a real decode step (eager outputs and fresh runner inputs")
    print("               are copied into the static buffers: data movement, counted as copies)")
    print(f"{'piece':10} {'inputs':>6} {'params':>6} {'checked':>7} {'bound':>8} {'step':>8}")
    for name, n_inputs, n_params, n_checked, bound, real in rows:
        print(f"{name:10} {n_inputs:6d} {n_params:6d} {n_checked:7d} {bound:8.2f} {real:8.2f}")
    n_params = len(runtime.statics.params)
    print(f"parameter address check, once per step: {per_step:.2f} us, {n_params} params")
    print(f"kept-loan check, once per step: {settle_us:.2f} us, {lent} outputs lent to eager code")
    for name, n_lent, module_us, lent_us in lending:
        print(
            f"eager {name}: {n_lent} lent inputs; called as a module {module_us:.2f} us, "
            f"as the runtime calls it {lent_us:.2f} us"
        )


if __name__ == "__main__":
    main()
