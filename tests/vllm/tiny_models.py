"""Tiny random checkpoints of the architectures the vLLM tests run, built locally.

No checkpoint is downloaded: each model is a transformers config with random weights saved with
``save_pretrained``. Sizes are the smallest vLLM's CPU kernels accept: head_dim 64 (its CPU
attention rejects 16) and, for multi-head latent attention, kv_lora_rank 512 with a rope dim
of 64 (576 in all). Run as a script to build them: ``python3 tests/vllm/tiny_models.py DIR``.
"""

from __future__ import annotations

import json
import os
import sys

ARCHITECTURES = ("llama", "qwen2_moe", "mixtral", "gemma2", "deepseek_v2")
VOCAB = 512
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "dtype": "float32",
}


def _config(name: str):
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**_COMMON)
    if name == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **_COMMON,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
        )
    if name == "mixtral":
        return tf.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)
    if name == "gemma2":
        return tf.Gemma2Config(**_COMMON, sliding_window=64)
    if name == "deepseek_v2":
        common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
        common["num_key_value_heads"] = 2
        return tf.DeepseekV2Config(
            **common,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
        )
    raise ValueError(
        f"unknown tiny architecture {name!r}; choose one of {', '.join(ARCHITECTURES)}"
    )


def build(name: str, folder: str, seed: int = 0) -> str:
    """Save the tiny random model ``name`` (one of :data:`ARCHITECTURES`) under
    ``folder/name`` unless it is there already; returns that path.

    Raises:
        ValueError: an unknown architecture name.
    """
    import torch
    import transformers as tf

    path = os.path.join(folder, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = _config(name)
    tf.utils.logging.disable_progress_bar()  # one line per model, not a bar per shard
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False}, f)
    return path


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "tiny_models"
    for arch in ARCHITECTURES:
        print(build(arch, target))
