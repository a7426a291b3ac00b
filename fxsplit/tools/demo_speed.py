"""The decode table of ``fxsplit demo``: eager against fxsplit (runners v1 and v2) and against
``torch.compile(mode="reduce-overhead")``, tokens compared and milliseconds per token: what
fxsplit is for, decoding faster than eager, on the demo's device.

Two models decode at batch 1, one new token per step:

- the serving-style DeepSeek-V4 reference model (:mod:`fxsplit.models.deepseek_v4`), fed by its
  engine-style runner (persistent buffers under v2, fresh metadata tensors under v1);
- transformers' ``LlamaForCausalLM`` (:mod:`fxsplit.models.hf_architectures`' tiny config,
  random weights, no download) with a ``StaticCache``: a prompt, then one token per step.

Each runs as :data:`VARIANTS` says: ``eager`` (the model itself), ``fxsplit v1`` and ``fxsplit
v2`` (``torch.compile`` with an fxsplit backend under that runner: CUDA graphs on a GPU, the CPU
capture emulator elsewhere), and on CUDA only ``reduce-overhead`` (Inductor with whole-graph CUDA
graphs). Every variant gets a fresh model with the same weights and the same inputs: tokens
fixed in advance, so that each reads the tokens eager reads whatever it predicts. Per step, the
next token it predicts (the logits' argmax) and the logits are compared with eager's.

The first :data:`WARMUP_STEPS` decode steps (after the Llama prompt) compile and capture, and are
not timed: fxsplit and cudagraph trees both run a graph once before recording it and replay it
from the third call, and the first decode step of Llama compiles a graph of its own. The next
``steps`` are timed as an engine would see them: host time, the inputs' preparation included,
the device synchronised before and after.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import fxsplit
from fxsplit.models import deepseek_v4, hf_architectures
from fxsplit.tools.coverage import EAGER_TOLERANCE

__all__ = [
    "ALLOWED",
    "MODELS",
    "STEPS",
    "VARIANTS",
    "WARMUP_STEPS",
    "Row",
    "measure",
    "notes",
    "table_rows",
    "variants",
]

VARIANTS = ("eager", "fxsplit v1", "fxsplit v2", "reduce-overhead")
CUDA_ONLY = ("reduce-overhead",)
MODELS = ("DeepSeek-V4", "Llama")
LLAMA = "LlamaForCausalLM"
WARMUP_STEPS = 4
STEPS = {"cuda": 64, "cpu": 32}
"""Timed decode steps per variant by device (on a CPU a step takes 1 to 3 ms: the compiles
before them take the time)."""
ALLOWED = {"Llama": EAGER_TOLERANCE}
"""Per model, the difference from eager its fxsplit rows may have beside the demo's own
allowance: transformers computes Llama's attention another way under ``torch.compile`` than
eagerly (Dynamo's graph run eagerly is 7e-8 from eager on a CPU, and fxsplit equals that graph
bit for bit), as :mod:`fxsplit.tools.coverage` allows for every architecture."""


@dataclass
class Row:
    """One model under one variant.

    Attributes:
        model / variant: from :data:`MODELS` / :data:`VARIANTS`.
        ms: milliseconds per token (per decode step: batch 1) over the timed steps.
        same_tokens: steps whose predicted next token is eager's, of ``steps``.
        steps: steps compared, warm-up steps included.
        diff: the largest logit difference from eager, None for eager itself.
        not_replayed: under fxsplit, runs of captured pieces during the timed steps that did
            not replay (a capture or an uncaptured run: the timing then holds more than
            replays); 0 for the others, whose runs fxsplit does not count.
        error: ``"Type: first line"`` of the error the variant raised, which leaves no figure
            (``ms`` 0, ``diff`` None); None where it ran.
    """

    model: str
    variant: str
    ms: float
    same_tokens: int
    steps: int
    diff: float | None
    not_replayed: int
    error: str | None = None


def variants(device: str) -> tuple[str, ...]:
    """The variants that run on ``device``: reduce-overhead's CUDA graphs need a GPU."""
    return tuple(v for v in VARIANTS if device == "cuda" or v not in CUDA_ONLY)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step: Callable[[int], torch.Tensor], total: int, warmup: int, device: str):
    """``step(i)`` for ``i`` in ``range(total)``: every step's logits (cloned: a replayed graph
    overwrites its output at the next step), milliseconds per step over the steps from
    ``warmup`` on, and the runs of fxsplit's captured pieces during those steps that did not
    replay."""
    logits = []
    with torch.no_grad():
        for i in range(total):
            if i == warmup:
                _sync(device)
                before = fxsplit.counters.snapshot()
                start = time.perf_counter()
            logits.append(step(i).clone())
        _sync(device)
        seconds = time.perf_counter() - start
    after = fxsplit.counters.snapshot()
    missed = sum(after[k] - before[k] for k in ("captures", "uncaptured_runs"))
    return logits, seconds / (total - warmup) * 1e3, missed


def _compiled(variant: str, model, options: dict):
    """``model`` as ``variant`` runs it; ``options``: fxsplit's, beside the runner."""
    if variant == "eager":
        return model
    if variant == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    backend = fxsplit.Backend(runner=variant.removeprefix("fxsplit "), **options)
    return torch.compile(model, backend=backend)


def _deepseek(variant: str, device: str, steps: int, options: dict):
    """The DeepSeek-V4 reference model's decode under ``variant``: see :func:`_timed`."""
    torch._dynamo.reset()
    model = deepseek_v4.build().to(device)
    persistent = variant != "fxsplit v1"  # v1's runner hands fresh metadata tensors each step
    feed = deepseek_v4.DecodeRunner(model.config, 1, persistent=persistent, device=device)
    call = _compiled(variant, model, options)
    return _timed(lambda i: call(*feed.step(1)), WARMUP_STEPS + steps, WARMUP_STEPS, device)


def _llama(variant: str, device: str, steps: int, options: dict):
    """transformers' Llama under ``variant``: a prompt, then one token per step, with a
    ``StaticCache``; see :func:`_timed` (the prompt's step is one more warm-up step)."""
    torch._dynamo.reset()
    model = hf_architectures.build(LLAMA).to(device)
    ids = [t.to(device) for t in hf_architectures.token_ids(model, WARMUP_STEPS + steps)]
    cache = hf_architectures.new_cache(model.config, "static", sum(t.shape[-1] for t in ids))
    # transformers hands a fresh input_ids tensor every step: copied, under v2 too
    call = _compiled(variant, model, {**options, "input_binding": "copy"})

    def step(i: int) -> torch.Tensor:
        logits = call(input_ids=ids[i], cache=cache, use_cache=True).logits[:, -1]
        if i == 0:  # the prompt wrote the cache: bound by address from now on
            hf_architectures.declare_static(cache)
        return logits

    return _timed(step, len(ids), 1 + WARMUP_STEPS, device)


def measure(
    device: str,
    capture: str,
    compile_pieces: str,
    steps: int | None = None,
    dumps: Callable[[str], dict] = lambda section: {},
) -> list[Row]:
    """Every model under every variant that runs on ``device``, eager first.

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        capture / compile_pieces: the fxsplit options of those names.
        steps: timed decode steps per variant (default :data:`STEPS` of ``device``).
        dumps: the options that dump a section's graphs, from the section's name (none by
            default).

    Returns:
        rows of :class:`Row`, model by model, in :data:`VARIANTS` order.
    """
    steps = STEPS[device] if steps is None else steps
    rows = []
    with _one_thread(device):
        for name, decode in zip(MODELS, (_deepseek, _llama), strict=True):
            rows += _model_rows(name, decode, device, steps, capture, compile_pieces, dumps)
    torch._dynamo.reset()
    return rows


@contextlib.contextmanager
def _one_thread(device: str):
    """One torch thread on a CPU: with more, on a shared machine, OpenMP's waits made a step of
    these tiny models ten times slower at random (80 ms eager against 6 ms), and the figures
    meaningless."""
    if device == "cuda":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _model_rows(
    name: str,
    decode: Callable,
    device: str,
    steps: int,
    capture: str,
    compile_pieces: str,
    dumps: Callable[[str], dict],
) -> list[Row]:
    """:func:`measure`'s rows of one model: ``decode`` (:func:`_deepseek` or :func:`_llama`)
    under every variant, eager first, each compared with eager. A compiled variant that raises
    is a row saying so, so that the table still shows the others (eager's error is raised:
    nothing could be compared)."""
    rows, want = [], None
    for variant in variants(device):
        section = f"decode_{name}_{variant}".replace(" ", "_").replace("-", "_").lower()
        options = {"capture": capture, "compile_pieces": compile_pieces, **dumps(section)}
        try:
            logits, ms, missed = decode(variant, device, steps, options)
        except Exception as error:
            if variant == "eager":
                raise
            first = next(iter(str(error).splitlines()), "")
            rows.append(Row(name, variant, 0.0, 0, 0, None, 0, f"{type(error).__name__}: {first}"))
            continue
        got = torch.stack(logits).float()
        want = got if want is None else want
        same = (got.argmax(-1) == want.argmax(-1)).flatten().tolist()
        diff = None if variant == "eager" else (got - want).abs().max().item()
        rows.append(Row(name, variant, ms, sum(same), len(same), diff, missed))
    return rows


def table_rows(rows: list[Row], allowed: float) -> list[tuple[tuple[str, ...], bool]]:
    """The cells of each row (model, variant, tokens as eager, max diff, ms per token, speed-up
    over eager, ok) and whether it is ok: an fxsplit row whose logits are within ``allowed`` of
    eager's (0: bit for bit; :data:`ALLOWED` for its model where larger), its tokens then
    eager's but at a near tie; one that failed is not. Eager and reduce-overhead are what
    fxsplit is compared with: always ok, ``-`` in that column."""
    eager = {r.model: r.ms for r in rows if r.variant == "eager"}
    out = []
    for r in rows:
        judged = r.variant.startswith("fxsplit")
        if r.error is not None:
            out.append(
                ((r.model, r.variant, "-", "-", "failed", "-", "NO" if judged else "-"), not judged)
            )
            continue
        good = not judged or r.diff <= max(allowed, ALLOWED.get(r.model, 0.0))
        cells = (
            r.model,
            r.variant,
            "-" if r.diff is None else f"{r.same_tokens}/{r.steps}",
            "-" if r.diff is None else f"{r.diff:.3g}",
            f"{r.ms:.2f}",
            f"{eager[r.model] / r.ms:.2f}x",
            ("yes" if good else "NO") if judged else "-",
        )
        out.append((cells, good))
    return out


def notes(rows: list[Row], device: str, steps: int, allowed: float) -> list[str]:
    """What the table's figures are, one line each: how they were timed, which model may
    differ from eager by more than ``allowed`` (see :func:`table_rows`), what the figures mean
    on a CPU, every variant that failed, and every fxsplit row whose timed steps held more
    than replays."""
    lines = [
        f"batch 1, one token per step; ms per token: the mean of {steps} decode steps after "
        f"{WARMUP_STEPS} that compile and capture (and Llama's prompt), from the host, the "
        "inputs' preparation included; speed-up: eager's ms over the variant's; tokens as "
        "eager: steps whose next token (the logits' argmax) is eager's",
    ]
    for model, more in ALLOWED.items():
        if more > allowed:
            lines.append(
                f"{model}: fxsplit may differ from eager by {more:g}: transformers computes it "
                "another way under torch.compile than eagerly"
            )
    if device != "cuda":
        lines.append(
            "on a CPU fxsplit emulates capture (the emulator replays recorded ops from "
            "Python), so these times show its cost, not a CUDA graph's gain; reduce-overhead "
            "needs CUDA; fxsplit demo --device cuda on a GPU shows the speed-up"
        )
    for r in rows:
        if r.error is not None:
            lines.append(f"{r.model}, {r.variant} failed: {r.error}")
        if r.not_replayed:
            lines.append(
                f"{r.model}, {r.variant}: {r.not_replayed} runs of captured pieces in the timed "
                "steps did not replay (captures or uncaptured runs): its time holds more than "
                "replays"
            )
    return lines
