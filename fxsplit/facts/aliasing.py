"""Aliasing pass: what each piece writes and which of its outputs alias its inputs.

The facts come from PyTorch's own analysis, not from lists of op names: every piece is run once,
on fresh fake tensors shaped like its inputs, through AOTAutograd's metadata collection
(``run_functionalized_fw_and_collect_metadata``, the pass Inductor's cudagraph trees read
their ``mutates_data`` / ``OutputAliasInfo`` facts from). Functionalization sees every write form:
in-place methods, ``out=``, writes through any view (``swapaxes``, ``.T``, ``unfold``, ``diagonal``,
``as_strided``, ``index_put_`` on a slice, ...), custom ops with ``mutates_args`` whether Dynamo
recorded the packet or the overload, and the running statistics of ``batch_norm`` /
``instance_norm`` whose schemas do not declare the write.

The runtime reads the result as plain data (:class:`PieceAliasing`); nothing at run time looks at
FX nodes again. The collection is a private torch API: a piece it cannot analyse gets
``PieceAliasing.error`` and runs uncaptured with that reason (never captured on a guess).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PieceAliasing", "analyse"]


@dataclass(frozen=True)
class PieceAliasing:
    """What one piece does to its inputs, by input and output position.

    Attributes:
        written: indices of the inputs whose data the piece writes (directly or through a view).
        metadata_written: indices of the inputs whose size, stride or offset the piece changes in
            place (``unsqueeze_``, ``t_``, ``as_strided_``, ...).
        output_bases: per output of the piece, the index of the input it is a view of (or is),
            else None.
        error: why the analysis could not run (then the other fields are empty and the piece is
            never captured); None when it ran.
        deferred: an input's size is data-dependent (an unbacked symbol from ``.item()`` or
            ``nonzero``), unknown until the piece runs: the analysis runs at the piece's first
            capture, on the real inputs' sizes (then the other fields are empty).
    """

    written: frozenset[int] = frozenset()
    metadata_written: frozenset[int] = frozenset()
    output_bases: tuple[int | None, ...] = ()
    error: str | None = None
    deferred: bool = False

    def describe(self, inputs: Sequence[str], outputs: Sequence[str]) -> dict[str, tuple]:
        """Names instead of positions: ``{"writes": (...), "metadata_writes": (...),
        "aliases": ("out -> in", ...)}`` (the fields of :class:`fxsplit.plan.Piece`)."""
        return {
            "writes": tuple(inputs[i] for i in sorted(self.written)),
            "metadata_writes": tuple(inputs[i] for i in sorted(self.metadata_written)),
            "aliases": tuple(
                f"{outputs[j]} -> {inputs[i]}"
                for j, i in enumerate(self.output_bases)
                if i is not None and j < len(outputs)
            ),
        }


def _collector() -> Callable:
    from torch._functorch._aot_autograd.collect_metadata_analysis import (
        run_functionalized_fw_and_collect_metadata,
    )

    return run_functionalized_fw_and_collect_metadata


_TRACED = (torch.Tensor, int, float, bool, complex, torch.SymInt, torch.SymFloat, torch.SymBool)


def _hint(value: object) -> object:
    """A symbolic int/float/bool as the concrete value Dynamo traced it with."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = value.node.hint
        if hint is None:
            raise ValueError(f"no concrete value for {value} (a data-dependent size)")
        return hint
    return value


def _data_dependent(value: object) -> bool:
    """Whether a traced value's size holds a symbol with no concrete value (unbacked)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if isinstance(value, torch.Tensor):
        return bool(free_unbacked_symbols((*value.shape, *value.stride())))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return bool(free_unbacked_symbols(value))
    return False


def _fresh(value: object) -> object:
    """A new fake tensor with ``value``'s size, stride, dtype and device at their traced
    concrete values (own storage, so inputs never alias one another in the analysis); other
    values as they are, symbols made concrete."""
    if not isinstance(value, torch.Tensor):
        return _hint(value)
    shape = [_hint(n) for n in value.shape]
    stride = [_hint(s) for s in value.stride()]
    fresh = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
    if value.is_conj():
        fresh = fresh.conj()
    if value.is_neg():
        fresh = torch._neg_view(fresh)
    return fresh


def analyse(fn: Callable, example_inputs: Sequence[object], num_outputs: int) -> PieceAliasing:
    """Run ``fn`` (a piece's uncaptured code) on fake copies of ``example_inputs`` through
    functionalization and return what it writes and aliases.

    Args:
        fn: the piece function; returns one value, a tuple of ``num_outputs`` values, or None.
        example_inputs: Dynamo's fake example values of the piece's inputs (FakeTensors with
            symbolic sizes, SymInts, Python scalars), or the object itself for a ``get_attr``
            input that is not a tensor (the subgraph modules of ``cond``, ``while_loop``,
            ``wrap``, ...: passed through, not traced); None where a value has no example.
        num_outputs: how many values the piece returns.

    Returns:
        a :class:`PieceAliasing`; its ``error`` says why when the analysis could not run (no fake
        example values, an op without a fake kernel, a torch without the metadata collector).
    """
    import torch._guards
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if any(v is None for v in example_inputs):
        return PieceAliasing(error="an input has no traced example value")
    if any(_data_dependent(v) for v in example_inputs):
        return PieceAliasing(deferred=True)

    # Only tensors and scalars are the analysis's inputs; subgraph modules are closed over.
    traced = [i for i, v in enumerate(example_inputs) if isinstance(v, _TRACED)]
    full = list(example_inputs)

    def flat_fn(*args):
        for i, arg in zip(traced, args, strict=True):
            full[i] = arg
        out = fn(*full)
        return out if isinstance(out, tuple) and num_outputs != 1 else (out,)

    try:
        collect = _collector()
        # Its own fake mode on the traced concrete sizes: no guard reaches Dynamo's shape
        # environment, and ops run the kernels eager runs (the Python dispatcher's
        # decompositions can differ in aliasing: eval-mode dropout returns its input, its
        # decomposition a clone).
        # A shape environment of its own lets HOPs whose fake kernels make unbacked sizes
        # (``while_loop``) run; the inputs' sizes stay concrete.
        # Outside Dynamo's tracing context: torch 2.11's HOPs (cond, wrap, invoke_subgraph, ...)
        # take that context's fake mode over this one's and fail ("Mixing fake modes NYI").
        with (
            torch._guards.tracing(None),
            FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()),
        ):
            inputs = [_fresh(example_inputs[i]) for i in traced]
            meta = _run(collect, flat_fn, inputs)
    except Exception as error:  # any failure: the piece is not captured on a guess
        return PieceAliasing(error=f"aliasing analysis failed: {type(error).__name__}: {error}")
    return _facts(meta, num_outputs, traced)


def _run(collect: Callable, fn: Callable, inputs: list) -> object:
    params = inspect.signature(collect).parameters
    kwargs: dict[str, object] = {"keep_input_mutations": False}
    if "flat_args_descs" in params:  # torch >= 2.12 names every input
        from torch._functorch._aot_autograd.descriptors import PlainAOTInput

        kwargs["flat_args_descs"] = [PlainAOTInput(i) for i in range(len(inputs))]
    with torch.no_grad():
        return collect(fn, **kwargs)(*inputs)


def _facts(meta, num_outputs: int, traced: Sequence[int]) -> PieceAliasing:
    """The collected metadata by piece input position (``traced[i]`` is the piece input the
    analysis's input ``i`` stands for)."""
    from torch._functorch._aot_autograd.schemas import OutputType

    to_input = (OutputType.alias_of_input, OutputType.is_input)
    infos_in = meta.input_info
    written = frozenset(traced[i] for i, info in enumerate(infos_in) if info.mutates_data)
    metadata = frozenset(traced[i] for i, info in enumerate(infos_in) if info.mutates_metadata)
    infos = meta.output_info
    if len(infos) != num_outputs:
        # A piece output that is itself a container flattens into several entries: its leaves'
        # aliasing cannot be mapped back to one value, so it must not alias an input.
        if any(info.output_type in to_input for info in infos):
            return PieceAliasing(
                error="an output holding several tensors aliases an input of the piece"
            )
        return PieceAliasing(written, metadata, (None,) * num_outputs)
    bases = tuple(traced[info.base_idx] if info.output_type in to_input else None for info in infos)
    return PieceAliasing(written, metadata, bases)
