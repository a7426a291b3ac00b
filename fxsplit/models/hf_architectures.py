"""Hugging Face transformers architectures, tiny and randomly initialised, with a KV-cache decode.

Every architecture :func:`fxsplit.runners.default_runner` names, plus widely used references
(Llama, Qwen2, Qwen3, Mistral, Mixtral, Gemma2, Gemma3, Phi3, GPT2, OPT, Bloom, GPT-OSS,
GraniteSWA, RecurrentGemma), as a tiny config built locally (nothing is downloaded): 2 decoder
layers, hidden size 64, vocabulary 128. :func:`build` makes the model with deterministic
weights; :func:`decode` runs a prefill and decode steps with transformers' own ``DynamicCache``
or ``StaticCache`` (:data:`CACHES`) and returns the logits of every step, the same way for eager
and compiled models.

Choices that apply to all of them (see :func:`tiny_config`):

- ``attn_implementation="sdpa"`` (transformers' default where the model supports it): attention
  is one ``scaled_dot_product_attention`` call per layer, which :mod:`fxsplit.presets` puts in
  region ``attention``. GPT-OSS has no sdpa path (attention sinks) and its flex-attention path
  refuses sinks on CPU, so it runs ``"eager"``; so does Gemma2 (sdpa refuses its logit
  soft-capping); DeepSeek-V4, Bloom and GraniteSWA support only ``"eager"``. Eager attention is
  plain matmul + softmax, which no op preset can tell from other matmuls.
- Sliding windows of 4 tokens, shorter than the prefill: every decode step runs the full-window
  path (a window filling up mid-decode changes the branches Dynamo traced, and it recompiles).
- ``experts_implementation="batched_mm"`` for MoE models: dense gather + bmm, traceable with no
  custom op and no host sync (the default ``"grouped_mm"`` is an opaque custom op on CPU, and
  ``"eager"`` loops over ``nonzero()``). LongcatFlash's experts ignore it and loop.
- LongcatFlash has 1 layer (holding two attention blocks) with 2 routed experts and 1 zero
  expert; DeepSeek-V4 is :func:`fxsplit.models.hf_deepseek_v4.tiny_config` (3 layers) with the
  cache on.

Architectures listed in :data:`fxsplit.runners.V2_ARCHITECTURES` that transformers does not ship
are in :data:`NOT_SHIPPED`, with the shipped relative used in their place where one exists.

transformers is imported inside functions only: ``fxsplit`` imports without it.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxsplit.models.hf_deepseek_v4 import INSTALL_HINT, MIN_TRANSFORMERS, _version_tuple
from fxsplit.models.hf_deepseek_v4 import tiny_config as _deepseek_v4_config

__all__ = [
    "ARCHITECTURES",
    "CACHES",
    "NOT_SHIPPED",
    "PREFILL_LEN",
    "Architecture",
    "UnknownArchitecture",
    "available",
    "build",
    "declare_static",
    "decode",
    "names",
    "new_cache",
    "shipped",
    "token_ids",
]

PREFILL_LEN = 5

_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "attn_implementation": "sdpa",
}
# Shorter than the prefill: every decode step runs a sliding-window layer's full-window path (a
# window filling up mid-decode would change the graph's branches, and Dynamo recompiles).
_WINDOW = 4
_TOKEN_IDS: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_MOE: dict[str, Any] = {
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "experts_implementation": "batched_mm",
}
_MLA: dict[str, Any] = {  # multi-head latent attention (DeepSeek-V2 and relatives)
    "num_key_value_heads": 4,  # MLA expands keys to every query head
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "head_dim": 8,  # the rotary width: transformers sizes the rotary embedding from head_dim
    "v_head_dim": 16,
}


@dataclass(frozen=True)
class Architecture:
    """One transformers architecture and how to make it tiny.

    Attributes:
        name: the architecture name (``config.architectures[0]``), e.g. ``"Qwen2MoeForCausalLM"``.
        config: the transformers config class name.
        options: config fields on top of the shared tiny defaults.
        stands_for: the listed architecture this shipped relative replaces, or None.
    """

    name: str
    config: str
    options: Callable[[], dict[str, Any]]
    stands_for: str | None = None


def _inkling_text() -> dict[str, Any]:
    return {
        **_COMMON,
        **_MOE,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "sliding_window_size": _WINDOW,
        "rel_extent": 16,
        "d_rel": 4,
        "layer_types": ["hybrid_sliding", "hybrid"],
        "mlp_layer_types": ["dense", "sparse"],
    }


def _inkling() -> dict[str, Any]:
    text = _inkling_text()
    return {
        "text_config": {k: v for k, v in text.items() if not k.endswith("_implementation")},
        "audio_config": {"text_hidden_size": 64},
        "vision_config": {
            "text_hidden_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        "attn_implementation": "sdpa",
        "experts_implementation": "batched_mm",
    }


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            "DeepseekV2ForCausalLM",
            "DeepseekV2Config",
            lambda: {
                **_COMMON,
                **_MOE,
                **_MLA,
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
            },
        ),
        Architecture(
            "DeepseekV4ForCausalLM",
            "DeepseekV4Config",
            lambda: {"num_hidden_layers": 3, "use_cache": True},
        ),
        Architecture(
            "GraniteMoeForCausalLM",
            "GraniteMoeConfig",
            lambda: {**_COMMON, **_MOE, "num_local_experts": 4},
        ),
        Architecture("InklingForCausalLM", "InklingTextConfig", _inkling_text),
        Architecture("InklingForConditionalGeneration", "InklingConfig", _inkling),
        Architecture(
            "LongcatFlashForCausalLM",
            "LongcatFlashConfig",
            lambda: {
                **{k: v for k, v in _COMMON.items() if k not in ("num_hidden_layers",)},
                **_MLA,
                "num_layers": 1,
                "ffn_hidden_size": 128,
                "expert_ffn_hidden_size": 32,
                # LongcatFlashExperts loops over the experts hit, graph-breaking on .item()
                # each time: few experts keep the number of graphs (and compiles) down.
                "n_routed_experts": 2,
                "zero_expert_num": 1,
                "moe_topk": 2,
                "experts_implementation": "batched_mm",
            },
            stands_for="LongcatFlashNgramForCausalLM",
        ),
        Architecture(
            "Qwen2MoeForCausalLM",
            "Qwen2MoeConfig",
            lambda: {**_COMMON, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 64},
        ),
        Architecture("LlamaForCausalLM", "LlamaConfig", lambda: dict(_COMMON)),
        Architecture("Qwen3ForCausalLM", "Qwen3Config", lambda: dict(_COMMON)),
        Architecture(
            "MixtralForCausalLM",
            "MixtralConfig",
            lambda: {**_COMMON, **_MOE, "num_local_experts": 4},
        ),
        Architecture(
            "GptOssForCausalLM",
            "GptOssConfig",
            lambda: {
                **_COMMON,
                **_MOE,
                "num_local_experts": 4,
                "sliding_window": _WINDOW,
                # YaRN's original context is 4096 tokens with factor 32: keep them consistent
                "max_position_embeddings": 131072,
                "attn_implementation": "eager",
            },
        ),
        # Widely used architectures and the kinds of attention and cache they bring: sliding
        # windows (Mistral, Gemma2/3, GraniteSWA), eager attention (Gemma2 with its logit
        # soft-capping; Bloom with ALiBi and GraniteSWA: no sdpa path), learned positions
        # (GPT2, OPT) and a recurrent block beside local attention (RecurrentGemma).
        Architecture("Qwen2ForCausalLM", "Qwen2Config", lambda: dict(_COMMON)),
        Architecture(
            "MistralForCausalLM", "MistralConfig", lambda: {**_COMMON, "sliding_window": _WINDOW}
        ),
        Architecture(
            "Gemma2ForCausalLM",
            "Gemma2Config",
            lambda: {
                **_COMMON,
                **_TOKEN_IDS,
                "sliding_window": _WINDOW,
                "query_pre_attn_scalar": 16,
                "layer_types": ["sliding_attention", "full_attention"],
                "attn_implementation": "eager",
            },
        ),
        Architecture(
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            lambda: {
                **_COMMON,
                **_TOKEN_IDS,
                "sliding_window": _WINDOW,
                "query_pre_attn_scalar": 16,
                "layer_types": ["sliding_attention", "full_attention"],
            },
        ),
        Architecture("Phi3ForCausalLM", "Phi3Config", lambda: {**_COMMON, **_TOKEN_IDS}),
        Architecture(
            "GPT2LMHeadModel",
            "GPT2Config",
            lambda: {
                "vocab_size": 128,
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "n_inner": 128,
                "n_positions": 128,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "attn_implementation": "sdpa",
            },
        ),
        Architecture(
            "OPTForCausalLM",
            "OPTConfig",
            lambda: {
                **_TOKEN_IDS,
                "vocab_size": 128,
                "hidden_size": 64,
                "word_embed_proj_dim": 64,
                "ffn_dim": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "max_position_embeddings": 128,
                "attn_implementation": "sdpa",
            },
        ),
        Architecture(
            "BloomForCausalLM",
            "BloomConfig",
            lambda: {
                **_TOKEN_IDS,
                "vocab_size": 128,
                "hidden_size": 64,
                "n_layer": 2,
                "n_head": 4,
                "attn_implementation": "eager",
            },
        ),
        Architecture(
            "GraniteSWAForCausalLM",
            "GraniteSWAConfig",
            lambda: {
                **_COMMON,
                **_TOKEN_IDS,
                "sliding_window": _WINDOW,
                "layer_types": ["full_attention", "sliding_attention"],
                "layer_rope_theta": [10000.0, 10000.0],
                "attn_implementation": "eager",  # its only one
            },
        ),
        Architecture(
            "RecurrentGemmaForCausalLM",
            "RecurrentGemmaConfig",
            lambda: {
                **_COMMON,
                **_TOKEN_IDS,
                "lru_width": 64,
                "attention_window_size": _WINDOW,
                "block_types": ["recurrent", "attention"],
            },
        ),
    )
}

# Listed in fxsplit.runners.V2_ARCHITECTURES, not shipped by transformers -> the shipped relative
# used in its place (None: no relative).
NOT_SHIPPED: dict[str, str | None] = {
    "KimiK3ForConditionalGeneration": None,
    "LongcatFlashNgramForCausalLM": "LongcatFlashForCausalLM",
}


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when transformers >= 5.8.1 is importable."""
    try:
        import transformers
    except Exception:
        return False
    return _version_tuple(getattr(transformers, "__version__", "0")) >= MIN_TRANSFORMERS


def shipped(name: str) -> bool:
    """Whether the installed transformers has a model class called ``name``."""
    if not available():
        return False
    import transformers

    return hasattr(transformers, name)


def names() -> list[str]:
    """Architecture names :func:`build` knows, in table order."""
    return list(ARCHITECTURES)


class UnknownArchitecture(ValueError):
    """An architecture name the builder does not know (the message lists the known ones)."""


def _architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        relative = NOT_SHIPPED.get(name)
        hint = f"; transformers does not ship it, use {relative}" if relative else ""
        if name in NOT_SHIPPED and relative is None:
            hint = "; transformers does not ship it and has no relative of it"
        raise UnknownArchitecture(
            f"unknown architecture {name!r}{hint}; known architectures: {', '.join(names())}"
            f"{'' if name in NOT_SHIPPED else _did_you_mean(name)}"
        ) from None


def _did_you_mean(name: str) -> str:
    """``"; did you mean 'LlamaForCausalLM'?"`` for ``name`` close to known architectures,
    ignoring case, or to their model family alone (``"llama"``); ``""`` when none is close.
    An exact family match names that family only; else up to 3, the closest first."""
    keys: dict[str, set[str]] = {}  # lower-case full name or family -> architectures
    for known in names():
        family = re.sub(r"(For[A-Z]\w*|LMHeadModel)$", "", known)
        for key in (known.lower(), family.lower()):
            keys.setdefault(key, set()).add(known)
    wanted = name.strip().lower()
    if wanted in keys:
        close = sorted(keys[wanted])
    else:
        score: dict[str, float] = {}
        for key in difflib.get_close_matches(wanted, keys, n=3):
            ratio = difflib.SequenceMatcher(None, wanted, key).ratio()
            for known in keys[key]:
                score[known] = max(score.get(known, 0.0), ratio)
        close = sorted(score, key=lambda known: (-score[known], known))[:3]
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def tiny_config(name: str):
    """The tiny transformers config of architecture ``name``.

    Raises:
        ValueError: an unknown architecture (the message lists the known ones).
        ImportError: transformers is missing, too old, or lacks the architecture.
    """
    arch = _architecture(name)
    if not shipped(arch.name):
        raise ImportError(
            f"{arch.name} needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} with "
            f"that class ({INSTALL_HINT})"
        )
    if arch.name == "DeepseekV4ForCausalLM":
        return _deepseek_v4_config(**arch.options())
    import transformers

    return getattr(transformers, arch.config)(**arch.options())


def build(name: str, seed: int = 0) -> nn.Module:
    """``<name>(tiny_config(name))`` with weights from transformers' initialiser under
    ``torch.manual_seed(seed)``; float32, CPU, eval mode. The global RNG state is restored.

    Raises:
        ValueError / ImportError: see :func:`tiny_config`.
    """
    import transformers

    config = tiny_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, name)(config)
    return model.to(device="cpu", dtype=torch.float32).eval()


def _vocab_size(model: nn.Module) -> int:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.vocab_size


def token_ids(model: nn.Module, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Token ids for :func:`decode`: int64 ``[1, PREFILL_LEN]``, then ``steps`` of ``[1, 1]``,
    fixed in advance so that eager and compiled runs read the same tokens whatever they predict.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = _vocab_size(model)
    prompt = torch.randint(0, vocab, (1, PREFILL_LEN), generator=generator)
    return [prompt, *(torch.randint(0, vocab, (1, 1), generator=generator) for _ in range(steps))]


CACHES = ("dynamic", "static")


def new_cache(config, kind: str, length: int):
    """A fresh KV cache of transformers: ``"dynamic"`` (``DynamicCache``, grown by concatenation
    every step) or ``"static"`` (``StaticCache`` of ``length`` tokens, written in place).

    Raises:
        ValueError: another ``kind``.
    """
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=config)
    if kind == "static":
        return StaticCache(config=config, max_cache_len=length)
    raise ValueError(f"unknown cache kind {kind!r}; expected one of {', '.join(CACHES)}")


def declare_static(cache) -> None:
    """Declare the tensors of a ``StaticCache`` persistent (``torch._dynamo.mark_static_address``),
    as transformers does itself when the cache is first written outside ``torch.compile``; a
    compiled prefill writes it first inside, where transformers skips that. Declared, the cache
    is bound by address in captured graphs and never copied."""
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values", "cumulative_length"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                torch._dynamo.mark_static_address(value)


def decode(
    model: Callable, config, ids: list[torch.Tensor], cache: str = "dynamic"
) -> list[torch.Tensor]:
    """Prefill ``ids[0]``, then one decode step per further entry, with one KV cache.

    Args:
        model: the transformers model, eager or ``torch.compile``'d.
        config: its config (the cache sizes its layers from it).
        ids: from :func:`token_ids`.
        cache: ``"dynamic"`` or ``"static"`` (see :func:`new_cache`; a static cache is
            declared persistent after the prefill, see :func:`declare_static`).

    Returns:
        each step's logits, cloned (a replayed graph overwrites its outputs on the next step).
    """
    kv = new_cache(config, cache, sum(t.shape[-1] for t in ids))
    logits = []
    with torch.no_grad():
        for step in ids:
            out = model(input_ids=step, cache=kv, use_cache=True)
            logits.append(out.logits.clone())
            if cache == "static" and len(logits) == 1:
                declare_static(kv)
    return logits
