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

    Raises:
        TypeError / ValueError: a field of the wrong type, an empty name, or a malformed op name.
    """

    name: str
    region: str
    ops: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from fxsplit.passes.ops import parse_op_name

        for field_name in ("name", "region"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Preset {field_name} must be a non-empty str, got {value!r}")
        for field_name in ("ops", "modules"):
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
_ENGINE_OPS = (
    "vllm::unified_attention",
    "vllm::unified_attention_with_output",
    "vllm::unified_mla_attention",
    "vllm::unified_mla_attention_with_output",
    "sglang::unified_attention_with_output",
    "trtllm::attn_custom_op_inplace",
    "trtllm::mla_custom_op_inplace",
)
# Sparse top-k indexers of DeepSeek sparse attention, as transformers names their modules.
_INDEXERS = ("DeepseekV32Indexer", "DeepseekV4Indexer")


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
        Preset("engine_attention", ATTENTION, ops=_ENGINE_OPS),
        Preset("rotary_embedding", ATTN_PREP, modules=("*RotaryEmbedding",)),
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
    ``{name: Preset or {"region": ..., "ops": [...], "modules": [...]}}``.

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
            "'region' and 'ops' and/or 'modules'"
        )
    unknown = sorted(set(entry) - {"region", "ops", "modules"})
    if unknown or "region" not in entry:
        what = f"unknown key {unknown[0]!r}" if unknown else "no 'region'"
        raise ValueError(
            f"fxsplit option {key}[{name!r}] has {what}; keys: 'region' (required), 'ops', "
            "'modules'"
        )
    return Preset(name, entry["region"], entry.get("ops", ()), entry.get("modules", ()))
