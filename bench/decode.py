"""Decode with the peers side by side: eager, fxsplit (runners v1 and v2, eager and Inductor
pieces), a bare piecewise floor, Inductor's graph partition and whole-model reduce-overhead.

Models (``--models``):

- ``llama``: transformers' ``LlamaForCausalLM`` with random weights (no download) decoding
  through ``generate()`` with a new ``StaticCache`` per call, as transformers does; ``forward``
  compiled (the README's way 1). On CUDA hidden 2048, 16 layers, bf16 (``--layers``,
  ``--hidden``); on the CPU the same depth at a small width, float32. ``llama_cc``: the same,
  transformers compiling ``forward`` itself (``CompileConfig``, the README's way 2);
  ``llama_dynamic``: forward compiled, a ``DynamicCache``. ``--check`` compares each compiled
  variant's tokens (an untimed call, the replay not stubbed) with those of
  ``torch.compile(backend="eager")`` (in bf16 transformers under Dynamo differs from plain
  eager after a few dozen tokens).
- ``deepseek``: fxsplit's serving-style DeepSeek-V4 (:mod:`fxsplit.models.deepseek_v4`) fed by
  its engine-style runner, one token per sequence per step (persistent buffers for v2 and the
  floor, fresh metadata tensors for v1).

Variants (``--variants``; those needing CUDA are left out on a CPU):

- ``eager``: the model itself.
- ``v1_eager``, ``v1_inductor``, ``v2_eager``, ``v2_inductor``: fxsplit under that runner with
  its captured pieces as generated Python or compiled by Inductor.
- ``floor``: the bare piecewise floor: fxsplit's own split (Llama: runner v1, as transformers
  keeps no persistent buffers; DeepSeek-V4: runner v2 over its runner's persistent buffers, so
  its floor is v2's, and v1, which copies fresh metadata and runs the preparation eagerly, is
  not held to it), each captured piece one plain graph per input shape over static input
  buffers (a fresh input copied in, nothing checked, outputs returned as they lie): what vLLM's
  ``CUDAGraphWrapper`` costs.
- ``partition`` (CUDA): Inductor's graph partition (``graph_partition=True``,
  ``custom_should_partition_ops`` on the attention ops) under ``mode="reduce-overhead"``:
  cudagraph trees per partition. Llama only (DeepSeek-V4's regions are plain ops).
- ``reduce_overhead`` (CUDA): the whole model under ``mode="reduce-overhead"``.

On a CPU fxsplit and the floor capture with the emulator, and **the replay is stubbed** while
timed (``EmulatedGraph.replay`` does nothing): a GPU replays asynchronously and, at small batch,
waits for the host, so what is timed is host time per token, the GPU's bottleneck there (the
process's CPU time, which other work on the machine inflates less than wall time; eager's row
does its full work). Numbers from a stubbed replay are not compared. Each part reports its
fastest timed call.

Per variant and batch it prints milliseconds per token, and for fxsplit per decode step:
captures per ``generate()`` call (after the first call), replays, input copies and bytes
copied; each fxsplit variant's ratio to the floor and, on CUDA, to the graph partition; and the
milliseconds per token Python's garbage collector ran (Inductor's compiled pieces leave many
more objects for a full collection to walk: a cost per step no piece shows).

Usage: python bench/decode.py [--device cpu|cuda] [--models llama ... deepseek] [--variants ...]
       [--parts model:variant ...] [--batches 1 8 32] [--layers 16] [--hidden H]
       [--new-tokens 16] [--calls 3] [--check] [--part-timeout 120] [--budget S] [--dry-run]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import signal
import time
from dataclasses import dataclass, field

import torch
from decode_latency import RESERVE, Budget, _time_limit, dry_run, run_parts

import fxsplit
from fxsplit import counters
from fxsplit.runtime.emulation.emulator import EmulatedGraph

VARIANTS = (
    "eager",
    "v1_eager",
    "v1_inductor",
    "v2_eager",
    "v2_inductor",
    "floor",
    "partition",
    "reduce_overhead",
)
CUDA_ONLY = ("partition", "reduce_overhead")
MODELS = ("llama", "llama_cc", "llama_dynamic", "deepseek")
FXSPLIT = tuple(v for v in VARIANTS if v[:2] in ("v1", "v2"))
PER_STEP = ("replays", "input_copies", "input_copy_bytes")


@dataclass
class Figures:
    """One (model, variant, batch): milliseconds per token; for fxsplit, per decode step of the
    timed calls: captures per call, replays, input copies and bytes copied; with ``--check``,
    whether a Llama variant's tokens (an untimed call, the replay not stubbed) are those of
    ``torch.compile(backend="eager")``."""

    ms: float
    captures_per_call: float | None = None
    per_step: dict[str, float] = field(default_factory=dict)
    same_tokens: bool | None = None  # with --check: the tokens of backend="eager"
    gc_ms: float | None = None  # the garbage collector's milliseconds per token


@contextlib.contextmanager
def _stubbed_replay(device: str):
    """On a CPU, an emulated replay does nothing while timed (see the module docstring)."""
    if device == "cuda":
        yield
        return
    replay = EmulatedGraph.replay
    EmulatedGraph.replay = lambda self: None
    try:
        yield
    finally:
        EmulatedGraph.replay = replay


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# The floor: fxsplit's split, each captured piece a bare graph


class _BarePiece:
    """One captured piece as an engine's thinnest wrapper runs it: a graph per input shape over
    static buffers; a call copies each tensor input that is not the static one in, replays and
    returns the static outputs. No binding check, no hand-out, no order rule."""

    def __init__(self, forward, device: str, pool):
        self.forward = forward
        self.device = device
        self.pool = pool
        self.entries: dict[tuple, tuple] = {}

    def __call__(self, *inputs):
        key = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in inputs)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._capture(inputs)
            return entry[2]
        graph, statics, outputs = entry
        for static, value in zip(statics, inputs, strict=True):
            if isinstance(value, torch.Tensor) and value is not static:
                static.copy_(value)
        graph.replay()
        return outputs

    def _capture(self, inputs) -> tuple:
        statics = [
            t if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) else t.clone()
            for t in inputs
        ]
        self.forward(*statics)  # warm-up
        if self.device == "cuda":
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=self.pool, stream=stream):
                outputs = self.forward(*statics)
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
        else:
            graph = EmulatedGraph(self.pool)
            outputs = graph.capture(self.forward, *statics)
        return graph, statics, outputs


def floor_backend(device: str, **options):
    """A torch.compile backend: fxsplit's split under ``options`` (capture off), every captured
    piece a :class:`_BarePiece` sharing one pool."""
    split = fxsplit.Backend(capture="off", **options)
    if device == "cuda":
        pool = torch.cuda.graph_pool_handle()
    else:
        from fxsplit.runtime.emulation.emulated_pool import EmulatedPool

        pool = EmulatedPool()

    def backend(gm, example_inputs, **kwargs):
        split(gm, example_inputs, **kwargs)
        result = split.compiled[-1]
        stitched = result.stitched
        for piece in result.pieces:
            if piece.part.kind == "captured":
                bare = _BarePiece(piece.module.forward, device, pool)
                object.__setattr__(stitched, piece.module.name, bare)
        return stitched.forward

    return backend


# ---------------------------------------------------------------------------------------------
# Variants


def _backend(variant: str, device: str, model: str):
    """The torch.compile ``backend`` and ``mode`` of ``variant`` (not ``eager``)."""
    if variant in ("reduce_overhead", "partition"):  # the partition under _partitioned()
        return "inductor", "reduce-overhead"
    capture = "cuda" if device == "cuda" else "emulate"
    binding = {"input_binding": "copy"} if model.startswith("llama") else {}
    if variant == "floor":
        runner = "v1" if model.startswith("llama") else "v2"
        return floor_backend(device, runner=runner, **binding), None
    runner, pieces = variant.split("_")
    backend = fxsplit.Backend(runner=runner, capture=capture, compile_pieces=pieces, **binding)
    return backend, None


def _compiled(variant: str, fn, device: str, model: str):
    """``fn`` (a module, or a bound ``forward``) as ``variant`` runs it."""
    if variant == "eager":
        return fn
    backend, mode = _backend(variant, device, model)
    return torch.compile(fn, backend=backend, mode=mode)


# The ops Inductor's graph partition cuts at for Llama: every form sdpa lowers to
_LLAMA_ATTENTION = [
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::scaled_dot_product_attention",
]


@contextlib.contextmanager
def _partitioned(variant: str):
    if variant != "partition":
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch(
        graph_partition=True, custom_should_partition_ops=list(_LLAMA_ATTENTION)
    ):
        yield


def _llama_config(device: str, args):
    from transformers import LlamaConfig

    hidden = args.hidden or (2048 if device == "cuda" else 64)
    heads = max(4, hidden // 64)
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        vocab_size=32000 if device == "cuda" else 256,
        max_position_embeddings=1024,
    )


def _llama(variant, device, batch, args, model_name: str) -> Figures:
    """transformers' Llama through ``generate()``, a new cache per call: ``llama`` (forward
    compiled, StaticCache), ``llama_cc`` (transformers compiles forward: CompileConfig,
    StaticCache), ``llama_dynamic`` (forward compiled, DynamicCache)."""
    from transformers import CompileConfig, DynamicCache, LlamaForCausalLM, StaticCache

    config = _llama_config(device, args)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval().to(device, dtype)
    prompt = torch.randint(
        0, config.vocab_size, (batch, 8), generator=torch.Generator().manual_seed(0)
    )
    prompt = prompt.to(device)
    new = args.new_tokens
    if model_name == "llama_cc":
        if variant != "eager":
            backend, mode = _backend(variant, device, model_name)
            compile_config = CompileConfig(backend=backend, mode=mode)
            compile_config._compile_all_devices = True  # transformers compiles on CUDA only
            model.generation_config.compile_config = compile_config
    else:
        model.forward = _compiled(variant, model.forward, device, model_name)
    options = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}

    def cache():
        if model_name == "llama_dynamic":
            return DynamicCache(config=config)
        return StaticCache(config=config, max_cache_len=8 + new + 8)

    def call():
        return model.generate(prompt, cache=cache(), **options)

    with torch.no_grad():
        call()  # compiles, warms up and captures
        tokens = call()
        figures = _timed(call, args.calls, new, device, variant in FXSPLIT)
        if args.check and variant != "eager":
            figures.same_tokens = torch.equal(tokens, _reference(device, batch, args, model_name))
        return figures


_REFERENCES: dict[tuple, torch.Tensor] = {}


def _reference(device: str, batch: int, args, model_name: str) -> torch.Tensor:
    """The tokens of ``model_name`` under ``torch.compile(backend="eager")``, the reference of
    compiled variants (in bf16 transformers under Dynamo already differs from plain eager after
    a few dozen tokens)."""
    key = (device, batch, model_name)
    if key not in _REFERENCES:
        torch._dynamo.reset()
        _REFERENCES[key] = _llama_tokens(device, batch, args, model_name)
    return _REFERENCES[key]


def _llama_tokens(device: str, batch: int, args, model_name: str) -> torch.Tensor:
    from transformers import DynamicCache, LlamaForCausalLM, StaticCache

    config = _llama_config(device, args)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval().to(device, dtype)
    model.forward = torch.compile(model.forward, backend="eager")
    prompt = torch.randint(
        0, config.vocab_size, (batch, 8), generator=torch.Generator().manual_seed(0)
    ).to(device)
    new = args.new_tokens
    cache = (
        DynamicCache(config=config)
        if model_name == "llama_dynamic"
        else StaticCache(config=config, max_cache_len=8 + new + 8)
    )
    with torch.no_grad():
        return model.generate(
            prompt,
            cache=cache,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )


def _deepseek(variant, device, batch, args) -> Figures:
    from fxsplit.models import deepseek_v4

    config = deepseek_v4.DeepseekV4Config(num_layers=args.layers)
    model = deepseek_v4.build(config).to(device)
    persistent = variant != "v1_eager" and variant != "v1_inductor"
    feed = deepseek_v4.DecodeRunner(config, batch, persistent=persistent, device=device)
    for _ in range(3):
        feed.step(batch)
    compiled = _compiled(variant, model, device, "deepseek")
    steps = args.new_tokens

    def call():
        for _ in range(steps):
            compiled(*feed.step(batch))

    with torch.no_grad():
        call()
        call()
        return _timed(call, args.calls, steps, device, variant in FXSPLIT)


@contextlib.contextmanager
def _collections():
    """The seconds Python's garbage collector ran (any generation) while inside, in a one-item
    list: a full collection walks every tracked object, which Inductor's compiled pieces make
    many more of, a cost per step no piece shows."""
    spent = [0.0]
    started = []

    def timing(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            spent[0] += time.perf_counter() - started.pop()

    gc.callbacks.append(timing)
    try:
        yield spent
    finally:
        gc.callbacks.remove(timing)


def _timed(call, calls: int, tokens: int, device: str, counted: bool) -> Figures:
    """``calls`` timed calls of ``tokens`` decode steps each; ms per token of the fastest call.
    On CUDA wall time, the device synchronised around each call; on a CPU (the replay stubbed)
    the process's CPU time, which other work on the machine does not inflate as it does wall
    time. ``counted``: fxsplit ran them, and its counters say what happened."""
    clock = time.perf_counter if device == "cuda" else time.process_time
    before = counters.snapshot()
    best = float("inf")
    with _stubbed_replay(device), _collections() as collected:
        for _ in range(calls):
            _sync(device)
            start = clock()
            call()
            _sync(device)
            best = min(best, clock() - start)
    after = counters.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    steps = calls * tokens
    figures = Figures(best / tokens * 1e3)
    figures.gc_ms = collected[0] / steps * 1e3
    if counted:
        figures.captures_per_call = delta["captures"] / calls
        figures.per_step = {k: delta[k] / steps for k in PER_STEP}
    return figures


def _run(model: str, variant: str, device: str, batch: int, args) -> Figures:
    torch._dynamo.reset()
    counters.reset()
    with _partitioned(variant):
        if model == "deepseek":
            return _deepseek(variant, device, batch, args)
        return _llama(variant, device, batch, args, model)


# ---------------------------------------------------------------------------------------------
# Report


def report(results: dict, device: str) -> list[str]:
    """The table: per model and batch, each variant's ms per token and counts, and the ratios
    of the fxsplit variants to the floor (and to the graph partition on CUDA)."""
    lines = []
    what = "ms per token" if device == "cuda" else "host ms per token (replay stubbed)"
    for (model, batch), row in results.items():
        lines.append(f"{model}, batch {batch}: {what}")
        lines.append(
            f"  {'variant':<16}{'ms':>9}{'captures/call':>14}{'replays/step':>13}"
            f"{'copies/step':>12}{'bytes/step':>12}{'vs floor':>9}{'vs partition':>13}"
            f"{'gc ms':>7}{'tokens':>8}"
        )
        for variant, figures in row.items():
            if figures is None:
                continue
            ratio = _ratio(figures, row.get("floor"))
            versus = _ratio(figures, row.get("partition"))
            per = figures.per_step
            lines.append(
                f"  {variant:<16}{figures.ms:9.3f}"
                f"{_cell(figures.captures_per_call, 14)}{_cell(per.get('replays'), 13)}"
                f"{_cell(per.get('input_copies'), 12)}{_cell(per.get('input_copy_bytes'), 12, 0)}"
                f"{_cell(ratio, 9, 2, 'x')}{_cell(versus, 13, 2, 'x')}"
                f"{_cell(figures.gc_ms, 7, 3)}{_tokens(figures.same_tokens):>8}"
            )
    return lines


def _tokens(same: bool | None) -> str:
    return "-" if same is None else "same" if same else "DIFFER"


def _ratio(figures: Figures, other: Figures | None) -> float | None:
    return figures.ms / other.ms if other is not None and other.ms else None


def _cell(value, width: int, digits: int = 1, suffix: str = "") -> str:
    return ("-" if value is None else f"{value:.{digits}f}{suffix}").rjust(width)


def plan(models, variants, batches, device: str, parts=()) -> list[tuple[str, int]]:
    """The (``model:variant``, batch) parts in run order: ``parts`` (``model:variant`` names)
    where given, else every model under every variant; CUDA-only variants left out on a CPU,
    the partition for Llama only (forward compiled)."""
    names = list(parts) or [f"{m}:{v}" for m in models for v in variants]
    names = [
        name
        for name in names
        if (device == "cuda" or name.split(":")[1] not in CUDA_ONLY)
        and not (name.endswith(":partition") and not name.startswith("llama:"))
    ]
    return [(name, batch) for batch in sorted(batches) for name in names]


def _part(text: str) -> str:
    """An argparse type: ``model:variant``."""
    model, _, variant = text.partition(":")
    if model not in MODELS or variant not in VARIANTS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected model:variant, a model of {', '.join(MODELS)} and a variant of "
            f"{', '.join(VARIANTS)}"
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--parts", nargs="+", type=_part, default=(), help="model:variant pairs, in run order"
    )
    parser.add_argument(
        "--check", action="store_true", help='compare Llama tokens with backend="eager"'
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=None, help="Llama's (2048 CUDA, 64 CPU)")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps per call")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per part")
    parser.add_argument("--part-timeout", type=float, default=120, help="seconds per part")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run")
    parser.add_argument("--dry-run", action="store_true", help="print the worst-case plan")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.budget is not None and args.budget <= RESERVE:
        parser.error(f"--budget {args.budget:g}: must be over the {RESERVE:g} s kept for the table")
    budget = Budget(args.part_timeout, args.budget)
    parts = plan(args.models, args.variants, args.batches, args.device, args.parts)
    if args.dry_run:
        lines, fits = dry_run(parts, budget)
        print("\n".join(lines))
        raise SystemExit(0 if fits else 1)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA or ROCm device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    figures: dict[tuple[str, int], Figures] = {}

    def run_part(name: str, batch: int, seconds: float) -> float:
        model, variant = name.split(":")
        with _time_limit(seconds):
            found = figures[name, batch] = _run(model, variant, args.device, batch, args)
        return found.ms

    _, skipped = run_parts(parts, budget, run_part)
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    results: dict[tuple[str, int], dict[str, Figures | None]] = {}
    for name, batch in parts:
        model, variant = name.split(":")
        results.setdefault((model, batch), {})[variant] = figures.get((name, batch))
    print(f"{args.device}, torch {torch.__version__}, {args.layers} layers")
    print("\n".join(report(results, args.device)))
    for line in skipped:
        print(f"not measured: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": args.device,
                    "torch": torch.__version__,
                    "layers": args.layers,
                    "figures": {f"{n}@{b}": vars(f) for (n, b), f in figures.items()},
                    "skipped": skipped,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
