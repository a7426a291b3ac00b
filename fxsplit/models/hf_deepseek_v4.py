"""Hugging Face transformers' own ``DeepseekV4ForCausalLM``, tiny and randomly initialised.

Nothing is downloaded: :func:`tiny_config` builds a ``transformers.DeepseekV4Config`` small enough
that a prefill forward takes about 10 ms on CPU, and :func:`build` initialises the weights from
``torch.manual_seed(seed)``. :func:`example` wraps the model in :class:`LogitsOnly` so that
``model(input_ids)`` returns the logits tensor ``[batch, seq_len, vocab_size]``, ready for
``torch.compile(model, backend=...)``.

The tiny model keeps every V4 code path of transformers 5.x: one layer of each attention type
(``sliding_attention``; ``compressed_sparse_attention`` = CSA with compressor and lightning indexer;
``heavily_compressed_attention`` = HCA), both MoE routers (hash and top-k), manifold-constrained
hyper-connections (mHC) and attention sinks. Module paths in the HF model (add the prefix
``lm.`` under :class:`LogitsOnly`; Dynamo's ``nn_module_stack`` writes ``L['self'].lm.model...``)::

    model.layers.{0,1,2}.self_attn                     DeepseekV4Attention
    model.layers.1.self_attn.compressor                DeepseekV4CSACompressor
    model.layers.1.self_attn.compressor.indexer        DeepseekV4Indexer
    model.layers.1.self_attn.compressor.indexer.scorer DeepseekV4IndexerScorer
    model.layers.2.self_attn.compressor                DeepseekV4HCACompressor
    model.layers.{0,1,2}.mlp                           DeepseekV4SparseMoeBlock
    model.layers.{0,1,2}.{attn_hc,ffn_hc}              DeepseekV4HyperConnection

Prefill (``use_cache=False``) traces with Dynamo into one graph under ``fullgraph=True``, both
``dynamic=False`` and ``dynamic=True``; no op in it has a data-dependent output shape and none
syncs with the host (``topk``/``where``/``scatter_``/``gather`` on fixed shapes only). Two things
the sequence length still decides, so each needs its own graph (``dynamic=True`` guards on them):
how many compressor windows close (``seq_len // compress_rate``, with ``if n_windows > 1`` and
``if chunk_kv.shape[1] > 0`` branches) and the indexer's top-k shortcut
``k = min(index_topk, seq_len // compress_rate)``. Under ``dynamic=True`` (torch 2.13,
``torch._dynamo.config.specialize_float=False``) Dynamo also lifts ~50 float module attributes
(norm ``eps``, ``hc_eps``, rotary ``attention_scaling``, ...) to 0-d CPU tensor inputs read back
with ``.item()`` in the graph; ``specialize_float=True`` or ``dynamic=False`` avoids them.

transformers is imported inside functions only: ``fxsplit`` imports without it, and callers
check :func:`available` first.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn

__all__ = [
    "ENGINE_MODULE_REGIONS",
    "INSTALL_HINT",
    "MIN_TRANSFORMERS",
    "MODULE_REGIONS",
    "LogitsOnly",
    "available",
    "build",
    "example",
    "input_ids",
    "tiny_config",
]

MIN_TRANSFORMERS = (5, 8, 1)
# what pyproject.toml's "hf" extra installs (transformers' Inkling model imports scipy)
INSTALL_HINT = "pip install 'transformers>=5.8.1' 'scipy>=1.10'"

# Module class -> fxsplit region (see fxsplit.regions / fxsplit.runners).
# Only the lightning indexer is marked: it is the DSA-specific piece an engine keeps out of its
# captured graphs (top-k selection feeding a sparse attention kernel), and in transformers it is a
# module of its own. Nothing here is an ATTN_PREP region: prefill without a cache reads no per-step
# metadata (positions are an in-graph ``arange`` of the sequence length). The core attention is not
# a module in transformers (``eager_attention_forward`` is a function), so an "attention" region can
# only be had through the whole DeepseekV4Attention block (projections, compressor, indexer, output
# projection included); that is ENGINE_MODULE_REGIONS below, for engine-like splits. The built-in
# presets (fxsplit.presets, on by default) find the indexer and the rotary embeddings without it.
MODULE_REGIONS: dict[str, str] = {"DeepseekV4Indexer": "sparse_indexer"}

# As MODULE_REGIONS, plus every attention block as region "attention" (the indexer nodes then
# carry both regions; runners v1 and v2 run both eagerly).
ENGINE_MODULE_REGIONS: dict[str, str] = {
    "DeepseekV4Indexer": "sparse_indexer",
    "DeepseekV4Attention": "attention",
}

_LAYER_CYCLE = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
    return tuple(parts)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when transformers >= 5.8.1 is importable and ships ``DeepseekV4ForCausalLM``."""
    try:
        import transformers
    except Exception:
        return False
    if _version_tuple(getattr(transformers, "__version__", "0")) < MIN_TRANSFORMERS:
        return False
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: F401
    except Exception:
        return False
    return True


def _require() -> None:
    if not available():
        raise ImportError(
            "fxsplit.models.hf_deepseek_v4 needs transformers >= "
            + ".".join(map(str, MIN_TRANSFORMERS))
            + f" with DeepseekV4ForCausalLM ({INSTALL_HINT})"
        )


def tiny_config(**overrides: Any):
    """A tiny ``transformers.DeepseekV4Config`` (about 0.2 M parameters, ~10 ms per prefill on CPU).

    Defaults (real V4-Flash values in brackets):

    - 3 layers [43]: ``layer_types`` = sliding, CSA, HCA (one of each);
      ``mlp_layer_types`` = hash_moe, moe, moe.
    - hidden 64 [4096], vocab 128 [129280], 4 query heads [64] of ``head_dim`` 32 [512] sharing one
      KV head, RoPE on the last 8 dims of each head (``partial_rotary_factor`` 0.25 [0.125]),
      ``q_lora_rank`` 32 [1024], grouped output projection 2 groups x 16 [8 x 1024].
    - ``compress_rates``: CSA 2 [4], HCA 8 [128], so prefills of 5 / 8 / 13 tokens give the CSA
      indexer 2 / 4 / 6 compressed entries against ``index_topk`` 4 [512] (shorter than, equal to,
      longer than k) and the HCA compressor 0 / 1 / 1 entries.
    - lightning indexer: ``index_n_heads`` 8 [64] x ``index_head_dim`` 16 [128]. Eight heads make
      exact ties of the ReLU-summed scores (all heads ReLU'd to 0) rare.
    - MoE: 4 routed experts [256], 2 per token [6], 1 shared expert, ``moe_intermediate_size`` 32.
    - ``sliding_window`` 8 [128]; mHC with ``hc_mult`` 4 [4] and ``hc_sinkhorn_iters`` 3 [20] (each
      Sinkhorn iteration adds ~16 graph nodes per hyper-connection, 2 per layer).
    - ``attn_implementation="eager"`` (the only one V4 supports), ``experts_implementation=
      "batched_mm"`` (dense gather + bmm: traceable with no custom op, no ``.tolist()``; the default
      ``"grouped_mm"`` becomes the opaque custom op ``transformers::grouped_mm_fallback`` under
      Dynamo on CPU/float32, and ``"eager"`` loops over ``nonzero()`` and graph-breaks),
      ``use_cache=False``.

    Args:
        **overrides: any ``DeepseekV4Config`` field (or ``attn_implementation`` /
            ``experts_implementation``). Overriding ``num_hidden_layers`` alone extends the layer
            schedules cyclically (sliding, CSA, HCA; first layer hash_moe, the rest moe).

    Returns:
        ``transformers.DeepseekV4Config``.

    Raises:
        ImportError: transformers is missing or too old (see :func:`available`).
    """
    _require()
    from transformers import DeepseekV4Config

    num_layers = overrides.get("num_hidden_layers", 3)
    kwargs: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "q_lora_rank": 32,
        "partial_rotary_factor": 0.25,
        "o_groups": 2,
        "o_lora_rank": 16,
        "layer_types": [_LAYER_CYCLE[i % len(_LAYER_CYCLE)] for i in range(num_layers)],
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
        "mlp_layer_types": ["hash_moe"] + ["moe"] * (num_layers - 1),
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 4,
        "sliding_window": 8,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 3,
        "max_position_embeddings": 256,
        "use_cache": False,
        "attn_implementation": "eager",
        "experts_implementation": "batched_mm",
    }
    kwargs.update(overrides)
    return DeepseekV4Config(**kwargs)


def build(seed: int = 0, **config_overrides: Any) -> nn.Module:
    """``DeepseekV4ForCausalLM(tiny_config(**config_overrides))`` with deterministic weights.

    Weights come from transformers' own initialiser run under ``torch.manual_seed(seed)`` (normal
    std 0.02, zero attention sinks / position biases / router correction bias). The hash-MoE
    routing table ``tid2eid`` ``[vocab_size, num_experts_per_tok]``, zeros from the initialiser
    (every token to expert 0), is filled with distinct random experts per token from the same
    seed. Float32, CPU, eval mode. The global RNG state is restored afterwards.

    Call it as ``model(input_ids=ids)`` with ``ids`` int64 ``[batch, seq_len]``; it returns a
    ``MoeCausalLMOutputWithPast`` whose ``.logits`` is float32 ``[batch, seq_len, vocab_size]``.
    Wrap it in :class:`LogitsOnly` to get the tensor directly.

    Raises:
        ImportError: transformers is missing or too old (see :func:`available`).
    """
    _require()
    from transformers import DeepseekV4ForCausalLM

    config = tiny_config(**config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(config)
        with torch.no_grad():
            for module in model.modules():
                table = getattr(module, "tid2eid", None)
                if isinstance(table, torch.Tensor):
                    vocab, top_k = table.shape
                    experts = torch.rand(vocab, config.n_routed_experts).argsort(dim=-1)
                    table.copy_(experts[:, :top_k])
    return model.to(device="cpu", dtype=torch.float32).eval()


class LogitsOnly(nn.Module):
    """Adapter: ``forward(input_ids)`` returns the HF model's prefill logits as a plain tensor.

    Calls the wrapped ``DeepseekV4ForCausalLM`` with ``use_cache=False`` (no cache object, no
    compressor state carried between calls).

    Args:
        lm: a ``DeepseekV4ForCausalLM`` (from :func:`build`); kept as attribute ``lm``, so module
            paths read ``lm.model.layers.1.self_attn.compressor.indexer``.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    @property
    def config(self):
        """The wrapped model's ``DeepseekV4Config``."""
        return self.lm.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[batch, seq_len]`` token ids -> float32 logits ``[batch, seq_len, vocab]``."""
        return self.lm(input_ids=input_ids, use_cache=False).logits


def input_ids(seq_len: int = 8, batch_size: int = 1, seed: int = 0, vocab_size: int = 128):
    """Random token ids, int64 ``[batch_size, seq_len]`` in ``[0, vocab_size)``, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)


def example(seq_len: int = 8, batch_size: int = 1, seed: int = 0, **config_overrides: Any):
    """``(model, (input_ids,))`` such that ``model(*args)`` is the prefill logits tensor.

    Args:
        seq_len: prompt length (any length >= 1 runs; see :func:`tiny_config` for how it relates
            to the compressors and ``index_topk``).
        batch_size: prompts per batch.
        seed: seeds both the weights (:func:`build`) and the token ids (:func:`input_ids`).
        **config_overrides: passed to :func:`tiny_config`.

    Returns:
        ``(LogitsOnly(build(seed)), (ids,))`` with ``ids`` int64 ``[batch_size, seq_len]``; the
        model returns float32 ``[batch_size, seq_len, vocab_size]``.

    Raises:
        ImportError: transformers is missing or too old (see :func:`available`).
    """
    model = LogitsOnly(build(seed, **config_overrides))
    ids = input_ids(seq_len, batch_size, seed, model.config.vocab_size)
    return model, (ids,)
