"""Every causal-LM architecture transformers ships, made tiny from its own config class.

:func:`architectures` lists transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (one entry per
model class); :func:`tiny_config` takes the architecture's config class with its defaults and
shrinks every size field it has (2 layers, hidden 64, vocabulary 128, 4 heads of 16, ...; the
fields of :data:`TINY`, under their own names or through the config's ``attribute_map``),
truncates per-layer lists to the layer count and keeps special token ids inside the
vocabulary, in every sub-config (``text_config``, ``vision_config``, ...: every attribute that
is a config itself). Nothing is
downloaded. :func:`build` makes the model with deterministic weights, ``attn_implementation=
"sdpa"`` where it has it (else ``"eager"``) and ``experts_implementation="batched_mm"`` where it
takes one.

No per-architecture table: an architecture whose config this generic shrinking does not fit
fails in :func:`build` with transformers' own error, which ``scripts/hf_zoo.py`` reports.

transformers is imported inside functions only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TINY", "architectures", "build", "tiny_config"]

LAYERS = 2
VOCAB = 128

TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "d_model": 64,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "num_decoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "num_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "word_embed_proj_dim": 64,
    "embedding_size": 64,
    "max_position_embeddings": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 64,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rotary_dim": 8,
    "lru_width": 64,
    "sliding_window": 4,
    "attention_window_size": 4,
    "sliding_window_size": 4,
}
"""Size fields and their tiny values, set where the config has the field. A sliding window of
4 is shorter than the prefill, so every decode step runs the full-window path."""

_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def architectures() -> list[str]:
    """Causal-LM model class names of the installed transformers, sorted, each once."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()))


def _config_class(architecture: str):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if name == architecture and model_type in CONFIG_MAPPING_NAMES:
            return getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    from fxsplit.models.hf_architectures import UnknownArchitecture

    raise UnknownArchitecture(
        f"{architecture!r} is not a causal-LM architecture of this transformers"
    )


def _layers(config, count: int | None) -> list[int] | None:
    """Which of ``count`` layers to keep: the first of each kind (``layer_types`` and the like
    name one per layer; a hybrid model needs an attention layer beside its recurrent ones),
    then the first ones, :data:`LAYERS` at least."""
    if not count:
        return None
    keep: list[int] = []
    for value in vars(config).values():
        if (
            isinstance(value, list)
            and len(value) == count
            and all(isinstance(v, str) for v in value)
        ):
            keep += [value.index(kind) for kind in dict.fromkeys(value)]
    keep = sorted(set(keep))
    keep += [i for i in range(count) if i not in keep][: max(LAYERS - len(keep), 0)]
    return sorted(keep)


def _shrink(config) -> None:
    """Set every :data:`TINY` field ``config`` has, in place, then its per-layer lists and
    token ids; recurse into sub-configs."""
    aliases = getattr(config, "attribute_map", {}) or {}
    before = getattr(config, "num_hidden_layers", None)
    keep = _layers(config, before if isinstance(before, int) else None)
    for key, value in TINY.items():
        name = aliases.get(key, key)
        if hasattr(config, name) and isinstance(getattr(config, name), int):
            setattr(config, name, value)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):
        # multi-head latent attention: the rotary embedding is sized from head_dim
        config.head_dim = config.qk_rope_head_dim
        config.num_key_value_heads = config.num_attention_heads
    if keep is not None and isinstance(before, int):
        for name, value in list(vars(config).items()):
            if isinstance(value, list) and len(value) == before:
                setattr(config, name, [value[i] for i in keep])
        config.num_hidden_layers = len(keep)
    for name in _TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, name, min(_TOKEN_IDS.index(name), VOCAB - 1))
        elif isinstance(value, list):
            setattr(config, name, [v if v < VOCAB else 2 for v in value])
    from transformers import PretrainedConfig

    for sub in list(vars(config).values()):
        if isinstance(sub, PretrainedConfig):
            _shrink(sub)


def tiny_config(architecture: str):
    """The config of ``architecture`` shrunk to tiny sizes (see the module docstring).

    Raises:
        UnknownArchitecture: (a ValueError) not a causal-LM architecture of the installed
            transformers.
        Exception: whatever the config class raises on the tiny values.
    """
    config = _config_class(architecture)()
    _shrink(config)
    return config


def build(architecture: str, seed: int = 0) -> nn.Module:
    """The tiny model, float32, CPU, eval mode, weights from transformers' initialiser under
    ``torch.manual_seed(seed)`` (the global RNG state is restored).

    Raises:
        ValueError / Exception: see :func:`tiny_config`; transformers' own errors for models it
            cannot build from that config.
    """
    import transformers

    config = tiny_config(architecture)
    cls = getattr(transformers, architecture)
    options: dict[str, Any] = {}
    if any("expert" in name for name in config.to_dict()):
        options["experts_implementation"] = "batched_mm"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = cls._from_config(config, attn_implementation="sdpa", **options)
        except (ValueError, TypeError):
            torch.manual_seed(seed)
            model = cls._from_config(config, attn_implementation="eager", **options)
    return model.to(device="cpu", dtype=torch.float32).eval()
