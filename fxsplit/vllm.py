"""fxsplit inside vLLM: a compile backend whose runner, eager ops and token count come from vLLM.

A vLLM user names the backend object in the compilation config::

    LLM(model=..., compilation_config={"mode": 2, "backend": "fxsplit.vllm.backend"})

(mode 2 is vLLM's DYNAMO_TRACE_ONCE: one Dynamo trace of the model's ``forward``, handed to
the backend). With options, make an object of your own and name it the same way:
``my_backend = fxsplit.vllm.VllmBackend(capture_sizes=[1, 2, 4, 8])`` in ``mymodule``, then
``"backend": "mymodule.my_backend"``.

At each compile the backend reads vLLM's config (:func:`vllm_options`): the runner
(:func:`runner_for`), the token-count inputs from the model's dynamic-dims declaration
(:func:`size_inputs`), the capture sizes vLLM pads batches to (:func:`capture_sizes`) and its
warm-up count, and vLLM's own ops that must stay eager, put into fxsplit's regions
(:func:`eager_op_presets`).
Options given to :class:`VllmBackend` win over what is read from vLLM.

vLLM is never imported by ``import fxsplit``; this module imports it at compile time only, and
only to ask what the config it was handed does not say (the current config where the compiled
module holds none; the platform where it decides the runner).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

import torch

from fxsplit import presets
from fxsplit.backend import Backend
from fxsplit.presets import Preset
from fxsplit.regions import ATTENTION, ATTN_PREP, SPARSE_INDEXER
from fxsplit.runners import V1_ON_ROCM

__all__ = [
    "VllmBackend",
    "backend",
    "capture_sizes",
    "eager_op_presets",
    "region_of",
    "runner_for",
    "size_inputs",
    "vllm_options",
]

log = logging.getLogger("fxsplit")


class VllmBackend(Backend):
    """A :class:`fxsplit.Backend` that takes its runner, size inputs, capture sizes and eager
    ops from vLLM's config at compile time (see the module docstring).

    Args:
        **options: fxsplit options (:class:`fxsplit.config.Config`); each one given here
            replaces what would be read from vLLM.

    Raises:
        ValueError / TypeError: bad options, as :class:`fxsplit.Backend`.
    """

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.explicit = dict(options)

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self.explicit.items())
        return f"fxsplit.vllm.VllmBackend({given})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, *, options=None, **kwargs):
        """Compile ``gm`` with the options read from vLLM's config, then the given ones (see
        :class:`fxsplit.Backend`).

        Raises:
            RuntimeError: no vLLM config is found (not compiled by vLLM).
        """
        module = _compiled_module()
        # vLLM compiles on the model's first call, outside its config context: the compiled
        # module (``@support_torch_compile``) holds the config it was built with.
        vllm_config = getattr(module, "vllm_config", None) or _current_vllm_config()
        if vllm_config is None:
            raise RuntimeError(
                "fxsplit.vllm: no vLLM config to read: the compiled module has no vllm_config "
                "and none is current; use fxsplit.vllm's backend from vLLM's compilation_config "
                "(mode 2), or fxsplit.Backend outside vLLM"
            )
        read = vllm_options(vllm_config, gm, module)
        merged = {**read, **self.explicit, **(options or {})}
        eager_ops = sum(o.startswith("vllm::") for p in read["presets"] for o in p.ops)
        log.info(
            "fxsplit.vllm: runner %r, size_input %r, capture_sizes %r, %d eager ops from vLLM%s",
            merged["runner"],
            merged["size_input"],
            merged["capture_sizes"],
            eager_ops,
            f" (given here: {', '.join(sorted(self.explicit))})" if self.explicit else "",
        )
        return super().__call__(gm, example_inputs, options=merged, **kwargs)


def vllm_options(vllm_config, gm: torch.fx.GraphModule | None = None, module=None) -> dict:
    """The fxsplit options vLLM's config stands for.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (``vllm.config.get_current_vllm_config()``).
        gm: the graph Dynamo traced (its placeholders give each argument's rank), or None.
        module: the ``nn.Module`` whose ``forward`` vLLM compiles (its ``_dynamic_arg_dims``,
            set by ``@support_torch_compile``), or None.

    Returns:
        ``{"runner", "size_input", "capture_sizes", "warmup_runs", "presets"}`` for
        :meth:`fxsplit.config.Config.from_options`; ``warmup_runs`` is vLLM's
        ``cudagraph_num_of_warmups`` (the uncaptured runs of a size before its capture).
    """
    compilation = vllm_config.compilation_config
    return {
        "runner": runner_for(vllm_config),
        "size_input": size_inputs(getattr(module, "_dynamic_arg_dims", None), gm) or None,
        "capture_sizes": capture_sizes(compilation),
        "warmup_runs": getattr(compilation, "cudagraph_num_of_warmups", 1),
        "presets": eager_op_presets(compilation),
    }


def runner_for(vllm_config, platform: str | None = None) -> str:
    """fxsplit's runner for vLLM's model runner: ``"v2"`` where vLLM runs its V2 model runner
    (``VllmConfig.use_v2_model_runner``, which follows ``VLLM_USE_V2_MODEL_RUNNER`` and falls
    back to V1 where V2 cannot run, e.g. without Triton), else ``"v1"``; on ROCm, DeepSeek-V4
    keeps ``"v1"`` as vLLM keeps it there (:func:`fxsplit.runners.default_runner`).

    Args:
        vllm_config: vLLM's ``VllmConfig`` (or any object with ``use_v2_model_runner`` and
            ``model_config.architecture``).
        platform: ``"cuda"``, ``"rocm"`` or ``"cpu"``; None asks vLLM's ``current_platform``
            (only for an architecture the platform decides, :data:`fxsplit.runners.V1_ON_ROCM`).
    """
    if not vllm_config.use_v2_model_runner:
        return "v1"
    architecture = getattr(getattr(vllm_config, "model_config", None), "architecture", None)
    if architecture not in V1_ON_ROCM:  # the platform decides nothing: vLLM is not asked
        return "v2"
    if platform is None:
        from vllm.platforms import current_platform

        platform = "rocm" if current_platform.is_rocm() else "other"
    return "v1" if platform == "rocm" else "v2"


def size_inputs(
    dynamic_arg_dims: Mapping[str, object] | None, gm: torch.fx.GraphModule | None = None
) -> tuple[str, ...]:
    """The arguments whose leading dim vLLM declares dynamic (``@support_torch_compile``'s
    ``dynamic_arg_dims``: ``{"input_ids": 0, "positions": -1, "inputs_embeds": -2, ...}``), in
    declared order: the token count, each with its own symbol in Dynamo's graph
    (``size_input``).

    A dim is an int, a list of them, or a dict keyed by them (vLLM's shape ids as values). A
    negative dim counts from the end of the graph's tensor for that argument, as vLLM
    normalises it before marking the dim dynamic (``ndim + dim``, in
    ``vllm/compilation/decorators.py``): ``-1`` of 1-D ``positions`` and ``-2`` of 2-D
    ``inputs_embeds`` are their leading dims, ``-1`` of the ``[3, tokens]`` positions of
    multimodal rotary is not. Without ``gm``, or for an argument the graph holds no tensor of
    (``intermediate_tensors``, whose tensors Dynamo lifts one by one), only dims declared 0
    count.

    Args:
        dynamic_arg_dims: the declaration, argument name to dims; None or empty for none.
        gm: the graph Dynamo traced, whose placeholders give each argument's rank.
    """
    if not dynamic_arg_dims:
        return ()
    ranks = _argument_ranks(gm) if gm is not None else {}
    names = []
    for name, dims in dynamic_arg_dims.items():
        if isinstance(dims, Mapping):
            dims = tuple(dims)
        elif isinstance(dims, int):
            dims = (dims,)
        if any(_normalised(d, ranks.get(name)) == 0 for d in dims):
            names.append(name)
    return tuple(names)


def _normalised(dim: int, rank: int | None) -> int | None:
    """A declared dim as vLLM marks it: a negative one counted from the end of ``rank`` dims;
    None where it is negative and the rank unknown, or out of the rank's range."""
    if dim < 0:
        dim = rank + dim if rank is not None else -1
    if dim < 0 or (rank is not None and dim >= rank):
        return None
    return dim


def capture_sizes(compilation_config) -> tuple[int, ...] | None:
    """The batch sizes vLLM pads to (``cudagraph_capture_sizes``), where it pads; None where
    it pads nothing (vLLM on the CPU empties the list): fxsplit then captures every size seen,
    up to ``max_captured_keys``."""
    sizes = getattr(compilation_config, "cudagraph_capture_sizes", None) or ()
    mode = getattr(compilation_config, "cudagraph_mode", None)
    if not sizes or (mode is not None and getattr(mode, "name", "") == "NONE"):
        return None
    return tuple(sorted(set(sizes)))


def region_of(op: str) -> str:
    """fxsplit's region for one of vLLM's eager ops. vLLM declares these ops by name only, so
    the region is read from the name (the documented exception to reading op facts from
    schemas): a KV-cache write (``*kv_cache_update``) is attention input preparation (it
    writes at the step's slot mapping: eager under v1, captured under v2), a sparse indexer
    (``*sparse_attn_indexer``) is the sparse indexer, every other op is attention (eager under
    every runner: these ops read per-step metadata from vLLM's forward context)."""
    name = op.partition("::")[2]
    if name.endswith("kv_cache_update"):
        return ATTN_PREP
    if name.endswith("sparse_attn_indexer"):
        return SPARSE_INDEXER
    return ATTENTION


def eager_op_presets(compilation_config) -> tuple[Preset, ...]:
    """vLLM's eager ops as fxsplit presets, one per region, named as the built-in presets they
    replace (``engine_attention``, ``engine_kv_cache_update``, ``engine_sparse_indexer``).

    The ops are vLLM's ``splitting_ops`` where the user set any, else vLLM's default list
    (``CompilationConfig._attention_ops``), plus the KV-cache writes vLLM adds to its default
    in code (:data:`fxsplit.presets.VLLM_KV_CACHE_UPDATE_OPS`). Other engines' names of the
    built-in ``engine_attention`` preset stay.
    """
    ops = list(getattr(compilation_config, "splitting_ops", None) or ())
    if not ops:
        ops = [*type(compilation_config)._attention_ops, *presets.VLLM_KV_CACHE_UPDATE_OPS]
    by_region: dict[str, list[str]] = {ATTENTION: [], ATTN_PREP: [], SPARSE_INDEXER: []}
    for op in dict.fromkeys(ops):
        by_region[region_of(op)].append(op)
    others = tuple(o for o in presets.ENGINE_OPS if not o.startswith("vllm::"))
    return (
        Preset("engine_attention", ATTENTION, ops=(*by_region[ATTENTION], *others)),
        Preset("engine_kv_cache_update", ATTN_PREP, ops=tuple(by_region[ATTN_PREP])),
        Preset("engine_sparse_indexer", SPARSE_INDEXER, ops=tuple(by_region[SPARSE_INDEXER])),
    )


def _argument_ranks(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Each frame argument's tensor rank, from the graph's placeholders (``L['positions']``)."""
    from fxsplit.size_input import argument_name as _argument

    ranks = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        name = _argument(node)
        if name is not None and isinstance(value, torch.Tensor):
            ranks[name] = value.dim()
    return ranks


def _current_vllm_config():
    """vLLM's current config, or None (vLLM is imported here, at compile time only)."""
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def _compiled_module() -> torch.nn.Module | None:
    """The module whose ``forward`` Dynamo is tracing (the frame's ``self``), or the one
    ``aot_compile`` compiles a bound method of; None where neither is found."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        receiver = InstructionTranslator.current_tx().f_locals.get("self")
    except Exception:  # not under Dynamo's tracer: aot_compile hands the graph over after it
        receiver = None
    if isinstance(receiver, torch.nn.Module):
        return receiver
    frame = sys._getframe(1)
    while frame is not None:
        model = frame.f_locals.get("model") if frame.f_code.co_name.startswith("aot_") else None
        owner = getattr(model, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return owner
        frame = frame.f_back
    return None


# The object vLLM resolves by ``"backend": "fxsplit.vllm.backend"``.
backend = VllmBackend()
