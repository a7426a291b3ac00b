"""Running a tiny model in vLLM's in-process engine, eagerly or through fxsplit.

Engines run one after another in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
each with a small KV cache (vLLM on the CPU reserves a share of the host's memory otherwise).
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass

import torch

from fxsplit import counters
from tests.vllm import backends, tiny_models

PROMPTS = 8
TOKENS = 32
KV_CACHE_BYTES = 64 << 20


@dataclass
class Run:
    """What one engine produced.

    Attributes:
        tokens: the greedy tokens of each prompt.
        counts: fxsplit's counters over ``generate`` (engine start-up left out).
        backend: the fxsplit backend object (None for vLLM eager).
    """

    tokens: list[list[int]]
    counts: dict[str, int]
    backend: object = None

    @property
    def replay_share(self) -> float:
        """Replays over every call of a captured piece during ``generate``."""
        c = self.counts
        calls = c["replays"] + c["captures"] + c["uncaptured_runs"]
        return c["replays"] / calls if calls else 0.0


def record(name: str, run: Run) -> None:
    """Append ``run``'s figures to ``$FXSPLIT_VLLM_FIGURES`` (one JSON line), where set:
    ``scripts/vllm_check.sh`` prints them as a table."""
    path = os.environ.get("FXSPLIT_VLLM_FIGURES")
    if not path:
        return
    line = {"run": name, "replay_share": round(run.replay_share, 4), **run.counts}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def models_folder() -> str:
    """``$FXSPLIT_VLLM_MODELS`` (``scripts/vllm_check.sh`` builds the models there), else a
    folder under the system's temporary one."""
    import tempfile

    return os.environ.get("FXSPLIT_VLLM_MODELS") or os.path.join(
        tempfile.gettempdir(), "fxsplit-vllm-models"
    )


def prompts():
    """Eight prompts of 5 to 12 token ids."""
    from vllm.inputs import TokensPrompt

    return [
        TokensPrompt(
            prompt_token_ids=[(7 * i + j) % (tiny_models.VOCAB - 1) + 1 for j in range(5 + i)]
        )
        for i in range(PROMPTS)
    ]


def run(arch: str, backend: str | None, **engine) -> Run:
    """Generate :data:`TOKENS` greedy tokens for each of :func:`prompts` with the tiny model
    ``arch``: vLLM eager where ``backend`` is None, else through ``tests.vllm.backends.<backend>``
    (reset first) in vLLM's DYNAMO_TRACE_ONCE mode."""
    from vllm import LLM, SamplingParams

    path = tiny_models.build(arch, models_folder())
    fxsplit_backend = getattr(backends, backend) if backend else None
    torch._dynamo.reset()
    if fxsplit_backend is not None:
        fxsplit_backend.reset()
        config = {"mode": 2, "backend": f"tests.vllm.backends.{backend}"}
    else:
        config = {"mode": 0}
    if arch == "deepseek_v2":
        # vLLM prefers its AMX MLA backend where the CPU has AMX tiles, and that backend packs
        # bfloat16 weights only: these models are float32, so ask for the reference CPU MLA
        # (what a CPU without AMX runs), the same on every machine
        engine.setdefault("attention_backend", "CPU_MLA")
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=PROMPTS,
        enforce_eager=backend is None,
        compilation_config=config,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        gpu_memory_utilization=0.05,
        seed=0,
        **engine,
    )
    try:
        before = counters.snapshot()
        outputs = llm.generate(
            prompts(), SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        )
        after = counters.snapshot()
    finally:
        _close(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    counts = {k: after[k] - before.get(k, 0) for k in after}
    return Run(tokens, counts, fxsplit_backend)


def _close(llm) -> None:
    """Shut the engine down and free its process-wide state, so the next one starts clean."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
