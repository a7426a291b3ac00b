"""Runner metadata: which regions a runner needs eager, and whether its inputs are persistent.

A runner is the engine component that feeds the model each step. Runner "v1" rebuilds attention
metadata (positions, slot mapping, block tables, sequence lengths) as fresh tensors every step, so
attention input preparation must run eagerly or a replay reads stale metadata. Runner "v2" keeps
metadata in persistent buffers updated in place, so preparation can be captured and only the
sparse indexer and attention stay eager.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from fxsplit.regions import ATTENTION, ATTN_PREP, SPARSE_INDEXER


@dataclass(frozen=True)
class Runner:
    """A runner policy.

    Attributes:
        name: registry name, e.g. ``"v1"``.
        eager_regions: region names (see :func:`fxsplit.region`) whose nodes run eagerly.
        persistent_inputs: True when the runner hands the model the same input tensors (same
            addresses) every step and updates them in place; False when inputs may be fresh
            tensors each step.
    """

    name: str
    eager_regions: frozenset[str]
    persistent_inputs: bool

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Runner name must be a non-empty str, got {self.name!r}")
        regions = self.eager_regions
        if isinstance(regions, str) or not isinstance(regions, Iterable):
            raise TypeError(
                f"Runner eager_regions must be an iterable of region names, got {regions!r}"
            )
        regions = frozenset(regions)
        bad = sorted(repr(r) for r in regions if not isinstance(r, str) or not r)
        if bad:
            raise ValueError(
                f"Runner eager_regions must be non-empty strings, got {', '.join(bad)}"
            )
        object.__setattr__(self, "eager_regions", regions)
        if not isinstance(self.persistent_inputs, bool):
            raise TypeError(
                f"Runner persistent_inputs must be a bool, got {self.persistent_inputs!r}"
            )


_REGISTRY: dict[str, Runner] = {
    "v1": Runner("v1", frozenset({ATTN_PREP, SPARSE_INDEXER, ATTENTION}), persistent_inputs=False),
    "v2": Runner("v2", frozenset({SPARSE_INDEXER, ATTENTION}), persistent_inputs=True),
}

# Architectures whose engine default is the persistent-buffer runner. Other architectures take
# "v1", the conservative choice.
V2_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV4ForCausalLM",
        "GraniteMoeForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
        "KimiK3ForConditionalGeneration",
        "LongcatFlashNgramForCausalLM",
        "Qwen2MoeForCausalLM",
    }
)
# A performance default on ROCm, not a correctness rule: both runners are correct there.
V1_ON_ROCM = frozenset({"DeepseekV4ForCausalLM"})


def register(runner: Runner, *, replace: bool = False) -> Runner:
    """Add a custom runner to the registry so ``runner="<name>"`` selects it.

    Raises:
        TypeError: ``runner`` is not a :class:`Runner`.
        ValueError: the name is taken and ``replace`` is False.
    """
    if not isinstance(runner, Runner):
        raise TypeError(f"register() takes a fxsplit.runners.Runner, got {type(runner).__name__}")
    if runner.name in _REGISTRY and not replace:
        raise ValueError(
            f"runner {runner.name!r} is already registered; pass replace=True to replace it"
        )
    _REGISTRY[runner.name] = runner
    return runner


def get(name: str | Runner) -> Runner:
    """The runner registered as ``name`` (a :class:`Runner` is returned as is).

    Raises:
        ValueError: no runner has that name; the message lists the registered names.
    """
    if isinstance(name, Runner):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        hint = _did_you_mean(str(name))
        raise ValueError(
            f"unknown runner {name!r}; registered runners: {', '.join(sorted(_REGISTRY))}{hint}"
        ) from None


def _did_you_mean(name: str) -> str:
    """``"; did you mean 'v2'?"`` for ``name`` differing from registered names in case or
    spaces only (that one), else by about one character in two (each such one); ``""`` when
    none is close."""
    lowered = {n.lower(): n for n in sorted(_REGISTRY)}
    key = name.strip().lower()
    if key in lowered:
        close = [lowered[key]]
    else:  # runner names are short: "v3" is one edit from "v1" and "v2" (ratio 0.5)
        close = sorted(lowered[n] for n in difflib.get_close_matches(key, lowered, 3, 0.5))
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def names() -> list[str]:
    """Registered runner names, sorted."""
    return sorted(_REGISTRY)


def default_runner(architecture: str, platform: str | None = None) -> str:
    """The default runner name, ``"v1"`` or ``"v2"``, for a model architecture.

    Args:
        architecture: a Hugging Face architecture name such as ``"DeepseekV4ForCausalLM"``.
        platform: ``"cuda"``, ``"rocm"`` or ``"cpu"``; None detects it
            (:func:`fxsplit.platforms.current_platform`).

    Raises:
        ValueError: ``platform`` is not one of the names above.
    """
    from fxsplit import platforms

    if platform is None:
        platform = platforms.current_platform()
    elif platform not in platforms.PLATFORMS:
        raise ValueError(
            f"unknown platform {platform!r}; expected one of {', '.join(platforms.PLATFORMS)}"
        )
    if platform == "rocm" and architecture in V1_ON_ROCM:
        return "v1"
    return "v2" if architecture in V2_ARCHITECTURES else "v1"
