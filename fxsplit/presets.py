"""Built-in region presets: the field's standard attention ops and module classes, by region.

A model nobody marked (any Hugging Face transformers model) still has its attention, rotary
embeddings and sparse indexers found: every compiled graph is matched against :func:`defaults`
unless the ``presets`` option turns them off (``presets=False``). A node a preset matches joins
the preset's region; where the runner runs that region eagerly the node's reasons read
``preset:<name>``. A user's ``splitting_ops`` and ``module_regions`` take precedence: a node one of
them matches is not matched against presets of the same kind (op or module).

Where PyTorch can tell, a preset is resolved from it rather than kept as a list: the sdpa preset
holds every ``aten`` op PyTorch registers under the scaled-dot-product-attention names, and
``flex_attention`` is PyTorch's higher-order op. Attention written as ops (two batched matmuls
around a softmax, transformers' ``attn_implementation="eager"``) is found by that shape in the
graph (:data:`EAGER_ATTENTION`). Other libraries' ops are names only: they match
once the library registers them (and never otherwise).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from fxsplit.regions import ATTENTION, ATTN_PREP, SPARSE_INDEXER

__all__ = ["EAGER_ATTENTION", "Preset", "defaults", "resolve"]


@dataclass(frozen=True)
class Preset:
    """A named rule putting ops and modules into one region.

    Attributes:
        name: shown in plan reasons as ``preset:<name>``.
        region: the region matched nodes join (``"attention"``, ``"attn_prep"``, ...).
        ops: op names ``"ns::op"`` or ``"ns::op.overload"`` (as ``splitting_ops`` takes them).
        modules: module class names, class-name globs (``"*RotaryEmbedding"``) or module-path
            globs (as ``module_regions`` takes them).
        methods: ``"Class.method"`` names: a node matches when a module of class ``Class``
            encloses it (``nn_module_stack``) and a frame of a function named ``method`` is on
            the stack Dynamo recorded for it (``stack_trace``): code a model keeps in one
            method without a module of its own (vLLM's DeepSeek-V4 attention input
            preparation, ``DeepseekV4Attention._prepare_and_attn``).

    Raises:
        TypeError / ValueError: a field of the wrong type, an empty name, or a malformed op name.
    """

    name: str
    region: str
    ops: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from fxsplit.facts.ops import parse_op_name

        for field_name in ("name", "region"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Preset {field_name} must be a non-empty str, got {value!r}")
        for field_name in ("ops", "modules", "methods"):
            value = getattr(self, field_name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TypeError(
                    f"Preset {self.name!r}: {field_name} must be a list of strings, got {value!r}"
                )
            value = tuple(value)
            bad = [v for v in value if not isinstance(v, str) or not v]
            if bad:
                raise ValueError(
                    f"Preset {self.name!r}: {field_name} holds {bad[0]!r}; entries must be "
                    "non-empty str"
                )
            object.__setattr__(self, field_name, value)
        for name in self.ops:
            parse_op_name(name)
        for name in self.methods:
            owner, _, method = name.rpartition(".")
            if not owner or not method.isidentifier():
                raise ValueError(
                    f"Preset {self.name!r}: methods holds {name!r}; entries are 'Class.method'"
                )


def _sdpa_ops() -> tuple[str, ...]:
    """Every forward scaled-dot-product-attention op aten registers (math, flash, efficient,
    cudnn, CPU and MPS variants, and the public ``aten::scaled_dot_product_attention``)."""
    found = {
        name.partition(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith(("aten::_scaled_dot_product_", "aten::scaled_dot_product_attention"))
    }
    return tuple(sorted(n for n in found if not n.endswith("_backward")))


def _flex_ops() -> tuple[str, ...]:
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return () if flex is None else (f"{flex.namespace}::{flex.name()}",)


# Attention custom ops of libraries and serving engines, as those register them; a name matches
# only where its library is loaded.
_FLASH_ATTN_OPS = (
    "flash_attn::_flash_attn_forward",
    "flash_attn::_flash_attn_varlen_forward",
)
# vLLM's ops are its own list when vLLM compiles through fxsplit (fxsplit.vllm reads it from
# vLLM); these are that list as vLLM 0.32 declares it (CompilationConfig._attention_ops), kept
# for graphs traced outside vLLM's compile path, a documented exception to reading op facts from
# their owner. Attention, linear attention and state-space ops read per-step metadata from
# vLLM's forward context, not from their arguments: eager under every runner.
VLLM_ATTENTION_OPS = (
    "vllm::unified_attention_with_output",
    "vllm::unified_mla_attention_with_output",
    "vllm::mamba_mixer2",
    "vllm::mamba_mixer",
    "vllm::short_conv",
    "vllm::qwen4_exp_ple_short_conv",
    "vllm::qwen4_exp_qsa_with_output",
    "vllm::qwen4_exp_qsa_prepare_with_output",
    "vllm::linear_attention",
    "vllm::qwen_gdn_attention_core",
    "vllm::qwen_gdn_attention_core_fused_norm_packed",
    "vllm::gdn_attention_core_xpu",
    "vllm::olmo_hybrid_gdn_full_forward",
    "vllm::deepseek_v4_attention",
    "vllm::hpc_rope_norm_forward",
)
# vLLM's sparse indexers: top-k over the cached keys (eager under every runner).
VLLM_INDEXER_OPS = ("vllm::sparse_attn_indexer", "vllm::rocm_aiter_sparse_attn_indexer")
# The KV-cache writes vLLM adds to its default splitting_ops (in code, not in a list it
# exposes). They write at the slot mapping of the step, read from the forward context: under a
# runner that rebuilds that metadata each step (v1) a replay would write where the capture's
# step did, so they are attention input preparation, captured only by a runner keeping it in
# persistent buffers (v2).
VLLM_KV_CACHE_UPDATE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")
ENGINE_OPS = (
    *VLLM_ATTENTION_OPS,
    "sglang::unified_attention_with_output",
    "trtllm::attn_custom_op_inplace",
    "trtllm::mla_custom_op_inplace",
)
# Sparse top-k indexers of DeepSeek sparse attention, as transformers and vLLM name their
# modules (vLLM's DeepseekV4Indexer prepares the indexer's queries; its SparseAttnIndexer scores
# and picks the top-k).
_INDEXERS = ("DeepseekV32Indexer", "DeepseekV4Indexer", "SparseAttnIndexer")
# vLLM's DeepSeek-V4 attention keeps its input preparation (query rotary, KV-cache insert, the
# indexer's and the compressor's inputs) in one method, which it runs eagerly under its V1
# model runner (``_prepare_and_attn_eager`` wraps it) and captures under V2; it has no module
# or op of its own to match.
_ATTN_PREP_METHODS = ("DeepseekV4Attention._prepare_and_attn",)


#: Attention written as ops (matmul, softmax, matmul), which no op or module name marks: found
#: by its shape in the graph (:mod:`fxsplit.passes.attention_pattern`).
EAGER_ATTENTION = Preset("eager_attention", ATTENTION)


@functools.cache
def defaults() -> tuple[Preset, ...]:
    """The built-in presets, in matching order."""
    return (
        Preset("sdpa", ATTENTION, ops=_sdpa_ops()),
        EAGER_ATTENTION,
        Preset("flex_attention", ATTENTION, ops=_flex_ops()),
        Preset("flash_attn", ATTENTION, ops=_FLASH_ATTN_OPS),
        Preset("engine_attention", ATTENTION, ops=ENGINE_OPS),
        Preset("engine_kv_cache_update", ATTN_PREP, ops=VLLM_KV_CACHE_UPDATE_OPS),
        Preset("engine_sparse_indexer", SPARSE_INDEXER, ops=VLLM_INDEXER_OPS),
        Preset("rotary_embedding", ATTN_PREP, modules=("*RotaryEmbedding",)),
        Preset("engine_attn_prep", ATTN_PREP, methods=_ATTN_PREP_METHODS),
        Preset("sparse_indexer", SPARSE_INDEXER, modules=_INDEXERS),
    )


def resolve(value: bool | tuple[Preset, ...]) -> tuple[Preset, ...]:
    """The presets a ``presets`` option value stands for: ``True`` the defaults, ``False`` none,
    a tuple of presets the defaults extended by them (one of the same name replaces a default)."""
    if value is True:
        return defaults()
    if value is False:
        return ()
    extra = {p.name: p for p in value}
    kept = [p for p in defaults() if p.name not in extra]
    return (*kept, *extra.values())


def from_option(key: str, value: object) -> bool | tuple[Preset, ...]:
    """Validate a ``presets`` option: a bool, a :class:`Preset`, a list of them, or a dict
    ``{name: Preset or {"region": ..., "ops": [...], "modules": [...], "methods": [...]}}``.

    Raises:
        TypeError: another type, naming the key and what is allowed.
        ValueError: a malformed preset (see :class:`Preset`) or an unknown dict key.
    """
    allowed = "True, False, a fxsplit.presets.Preset, a list of them, or a dict name -> preset"
    if isinstance(value, bool):
        return value
    if isinstance(value, Preset):
        return (value,)
    if isinstance(value, Mapping):
        return tuple(_from_entry(key, name, entry) for name, entry in value.items())
    if isinstance(value, list | tuple) and all(isinstance(p, Preset) for p in value):
        return tuple(value)
    raise TypeError(
        f"fxsplit option {key}={value!r} has type {type(value).__name__}; expected {allowed}"
    )


def _from_entry(key: str, name: object, entry: object) -> Preset:
    if isinstance(entry, Preset):
        if entry.name != name:
            raise ValueError(
                f"fxsplit option {key}[{name!r}] is a Preset named {entry.name!r}; use the "
                "same name"
            )
        return entry
    if not isinstance(entry, Mapping):
        raise TypeError(
            f"fxsplit option {key}[{name!r}]={entry!r}; expected a Preset or a dict with "
            "'region' and 'ops', 'modules' and/or 'methods'"
        )
    unknown = sorted(set(entry) - {"region", "ops", "modules", "methods"})
    if unknown or "region" not in entry:
        what = f"unknown key {unknown[0]!r}" if unknown else "no 'region'"
        raise ValueError(
            f"fxsplit option {key}[{name!r}] has {what}; keys: 'region' (required), 'ops', "
            "'modules', 'methods'"
        )
    return Preset(
        name,
        entry["region"],
        entry.get("ops", ()),
        entry.get("modules", ()),
        entry.get("methods", ()),
    )
