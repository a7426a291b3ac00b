"""``fxsplit demo``: the main job, end to end on CPU (or CUDA where present).

1. The serving-style DeepSeek-V4 model (:mod:`fxsplit.models.deepseek_v4`) compiled with
   ``backend="fxsplit"`` under runners v1 and v2, decoding with changing batch sizes and per-step
   metadata; prints each plan and the max abs difference against eager per step.
2. Hugging Face transformers' own ``DeepseekV4ForCausalLM`` (tiny config, random weights) with
   ``module_regions={"DeepseekV4Indexer": "sparse_indexer"}`` under both runners; prefill logits
   against eager for several sequence lengths.

Every comparison must match exactly (the split changes no number); the exit status is 1 if one
does not.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

import fxsplit
from fxsplit.models import deepseek_v4, hf_deepseek_v4

STEPS = (4, 4, 3, 5, 5, 2, 4, 6)
PREFILL_LENGTHS = (5, 8, 13)


def _deepseek(console: Console, runner: str) -> bool:
    torch._dynamo.reset()
    persistent = fxsplit.runners.get(runner).persistent_inputs
    model = deepseek_v4.build()
    reference = deepseek_v4.clone_model(model)
    backend = fxsplit.Backend(runner=runner)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    feed = deepseek_v4.DecodeRunner(model.config, max(STEPS), persistent=persistent)
    feed_ref = deepseek_v4.DecodeRunner(model.config, max(STEPS), persistent=persistent)
    table = Table(
        title=f"DeepSeek-V4 decode, runner {runner} (metadata: "
        f"{'persistent buffers' if persistent else 'fresh tensors each step'})"
    )
    for column in ("step", "batch", "max |fxsplit - eager|", "ok"):
        table.add_column(column)
    ok = True
    for step, batch in enumerate(STEPS):
        got = compiled(*feed.step(batch))
        want = reference(*feed_ref.step(batch))
        diff = (got - want).abs().max().item()
        ok &= diff == 0.0
        table.add_row(str(step), str(batch), f"{diff:.3g}", "yes" if diff == 0.0 else "NO")
    for plan in backend.plans:
        console.print(plan.format(), highlight=False, soft_wrap=True)
    console.print(table)
    return ok


def _hf(console: Console, runner: str) -> bool:
    table = Table(title=f"transformers DeepseekV4ForCausalLM prefill, runner {runner}")
    for column in ("seq_len", "pieces (captured/eager)", "max |fxsplit - eager|", "ok"):
        table.add_column(column)
    ok = True
    for seq_len in PREFILL_LENGTHS:
        torch._dynamo.reset()
        model, args = hf_deepseek_v4.example(seq_len=seq_len)
        with torch.no_grad():
            want = model(*args)
            backend = fxsplit.Backend(runner=runner, module_regions=hf_deepseek_v4.MODULE_REGIONS)
            got = torch.compile(model, backend=backend)(*args)
        diff = (got - want).abs().max().item()
        ok &= diff == 0.0
        pieces = f"{sum(len(p.captured) for p in backend.plans)}/"
        pieces += f"{sum(len(p.eager) for p in backend.plans)}"
        table.add_row(str(seq_len), pieces, f"{diff:.3g}", "yes" if diff == 0.0 else "NO")
    for plan in backend.plans:  # the plans of the longest prefill
        console.print(plan.format(), highlight=False, soft_wrap=True)
    console.print(table)
    return ok


def run() -> int:
    """Run the demo; returns the process exit status (0 when every comparison matched)."""
    console = Console()
    ok = True
    for runner in ("v1", "v2"):
        ok &= _deepseek(console, runner)
    if hf_deepseek_v4.available():
        for runner in ("v1", "v2"):
            ok &= _hf(console, runner)
    else:
        console.print("[red]transformers >= 5.8.1 with DeepseekV4ForCausalLM is not installed[/]")
        ok = False
    console.print("[green]all comparisons passed[/]" if ok else "[red]a comparison FAILED[/]")
    return 0 if ok else 1
