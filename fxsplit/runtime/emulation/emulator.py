"""CPU capture emulator: a stand-in for ``torch.cuda.CUDAGraph`` with CUDA-graph semantics.

CPU CI has no CUDA graphs, so capture bugs (host syncs, data-dependent shapes, stale reads of
inputs that were replaced instead of refilled, outputs assumed to survive the next replay) would
only show up on a GPU. :class:`EmulatedGraph` reproduces them on CPU:

* ``capture(fn, *args)`` runs ``fn`` once, eagerly, under a ``TorchDispatchMode`` that records
  every aten op with the exact tensor objects involved, and a ``TorchFunctionMode`` that rejects
  host reads (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``, ``if t:``,
  ``int(t)``, printing a tensor, ...) which on CPU tensors never reach the dispatcher.
* ``replay()`` re-runs the record on the same tensors (frozen addresses): data written in place
  into the recorded inputs is seen, a different tensor object is not, Python values seen at capture
  stay frozen, and results are written into the recorded output tensors (the next replay
  overwrites them). A custom op replays by calling its kernel again, checked to touch the same
  tensors outside its arguments as at capture (:class:`StateMovedError`).

Everything else about devices is out of reach of a CPU emulator; see :class:`EmulatedGraph` for the
caveats.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from fxsplit.collectives import holds_until_wait, is_collective
from fxsplit.facts import op_facts
from fxsplit.facts.ops import dispatched_op_name
from fxsplit.runtime.emulation.emulated_pool import EmulatedPool
from fxsplit.runtime.memory.storage import storage_ptr

__all__ = [
    "LEFT_CAPTURING",
    "CaptureError",
    "EmulatedGraph",
    "HostValueChangedError",
    "MovedMemoryError",
    "StateMovedError",
    "call_opaque",
    "close_capture_state",
    "is_host_handle",
]

aten = torch.ops.aten


class CaptureError(RuntimeError):
    """An operation that CUDA graph capture rejects ran while an :class:`EmulatedGraph` captured,
    or one whose replay would silently differ from its eager run (a custom op's kernel keeping
    its argument: CUDA captures it, and the emulator refuses to).

    Attributes:
        op: what ran, e.g. ``"aten::_local_scalar_dense (.item())"`` or ``"aten::nonzero"``.
        reason: why capture rejects it (host sync, data-dependent shape, ...).
    """

    def __init__(self, op: str, reason: str) -> None:
        self.op = op
        self.reason = reason
        if reason is KEEPS:
            super().__init__(f"{op} cannot be captured: {reason}")
            return
        # ends with CUDA's own words (cudaErrorStreamCaptureUnsupported), as a GPU reports it
        super().__init__(
            f"{op} is illegal during CUDA graph capture: {reason} (CUDA: operation not "
            "permitted when stream is capturing)"
        )


class MovedMemoryError(RuntimeError):
    """A replay of an :class:`EmulatedGraph` found memory its record uses at another address
    than at capture (a storage's data moved: ``UntypedStorage._swap_data_ptr_``, which fxsplit
    uses to give a held output memory of its own). The emulator's record would follow the
    storage; a CUDA graph replays kernels on the captured addresses and would read and write
    the old memory, silently: the emulator refuses to differ."""


class HostValueChangedError(RuntimeError):
    """A replay of an :class:`EmulatedGraph` found a host handle (see :func:`is_host_handle`)
    holding another value, or at another address, than the custom op kernel read at capture.
    A CUDA graph keeps the value its kernel was launched with: replaying would silently use the
    old one, so the emulator refuses to."""


class StateMovedError(MovedMemoryError):
    """A replay of an :class:`EmulatedGraph` found a custom op touching a tensor outside its
    arguments (a forward context's metadata, a module attribute, a global) that is another
    tensor, or at another address, than at capture: the emulator calls the op's kernel again,
    which reads the current state, where a CUDA graph replays the kernels recorded at capture
    on the memory they touched then (stale, silently). The emulator refuses to differ."""


# --------------------------------------------------------------------------------------------
# What capture rejects
# --------------------------------------------------------------------------------------------

# What capture rejects, and which ops only allocate, is one set of facts for the mark pass and
# the emulator: fxsplit.facts.op_facts.
_illegal_op = op_facts.capture_refusal
_ALLOC_OPS = op_facts.ALLOCATIONS
_op_name = dispatched_op_name

# ``torch.tensor(data)`` reaches dispatch as lift_fresh of a constant made outside it. Replay
# restores the constant (its value is frozen at capture, like any host value).
_CONSTANT_OPS = frozenset({aten.lift_fresh.default})


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------

# Replay step kinds.
_RUN = 0  # re-run (mutating / side-effecting op); results alias its arguments
_COPY1 = 1  # re-run, copy the single fresh tensor result into the recorded output
_COPYN = 2  # re-run, copy selected entries of a flat tuple/list result
_COPYTREE = 3  # re-run, copy selected leaves of a nested result
_RESTORE = 4  # copy a constant captured at capture time back into the recorded tensor
_COLLECTIVE = 5  # re-issue a collective, wait for it, copy its fresh results (as _COPYTREE)

_ACTION_NAMES = {
    _RUN: "run",
    _COPY1: "run+copy",
    _COPYN: "run+copy",
    _COPYTREE: "run+copy",
    _RESTORE: "restore",
    _COLLECTIVE: "run+wait",
}
_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
# Tensor types the recorder aliases and moves into the pool; subclasses are recorded as they are.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _wait_tensor(t: torch.Tensor) -> None:
    # Resolved per call: the op exists only where torch.distributed is built in, and a record
    # holds collectives only there.
    torch.ops._c10d_functional.wait_tensor(t)


def _freeze_sym(value: Any) -> Any:
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    return value


def _callable(func: Any) -> Callable:
    # OpOverload.__call__ is ``self._op(*args, **kwargs)``; calling _op saves a frame per step.
    if type(func) is torch._ops.OpOverload:
        return func._op
    return func


_tls = threading.local()
_USE_COUNT = torch._C._storage_Use_Count  # tensors (and the storage object) over one storage
# what a kernel's aten ops are called with besides tensors, frozen in a CUDA graph's launches
_HOST_VALUES = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout)
_left_capturing: TorchDispatchMode | None = None  # see _LeftCapturing


def close_capture_state() -> None:
    """Close the capture state a failed capture left the default generator in
    (:class:`_LeftCapturing`), so that draws outside a capture work again: what a completed
    capture does, and what fxsplit's recovery does on CUDA with an empty capture. A no-op where
    nothing was left."""
    global _left_capturing
    if _left_capturing is None:
        return
    depth = torch._C._len_torch_dispatch_stack()
    stack = [torch._C._pop_torch_dispatch_stack(None) for _ in range(depth)]
    for mode in reversed(stack):
        if mode is not _left_capturing:
            torch._C._push_on_torch_dispatch_stack(mode)
    _left_capturing = None


_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
_SCALAR_READS = frozenset({aten.item.default, aten._local_scalar_dense.default})


def is_host_handle(value: Any, pool: EmulatedPool) -> bool:
    """Whether a custom op's tensor argument is a host handle rather than a stand-in for a
    device tensor: the emulator's one rule for telling them apart on the CPU, where every
    tensor is a CPU tensor.

    A host handle is a 0-dim integer tensor on the CPU that the capture did not make (it is in
    no block of ``pool``), handed to a custom op as an argument: an engine's host-side value
    such as the pointer vLLM's CPU linear ``_C::onednn_mm(out, x, bias, handler)`` reads with
    ``handler.item()``, which stays on the host on a GPU machine too. Its ``.item()`` inside
    the kernel is read once at capture and checked at every replay
    (:class:`HostValueChangedError`). Every other tensor stands in for a device tensor, and its
    ``.item()`` is refused as a device-to-host sync.
    """
    return (
        isinstance(value, torch.Tensor)
        and type(value) in _PLAIN
        and value.dim() == 0
        and value.device.type == "cpu"
        and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        and pool.block_of(value) is None
    )


def _run_checked(
    graph: EmulatedGraph, func: Any, args: tuple, kwargs: dict, parent: _Checker | None = None
) -> tuple[Any, tuple[_Touched, ...]]:
    """Run ``func``; for a non-aten (custom) op, check the aten ops its kernel runs and find the
    tensors it touches outside its arguments (``parent``: the checker of an enclosing custom
    op's kernel, which hears of them too).

    A custom op records and replays as one unit, but its kernel may sync (``.item()`` on a
    length, ...) and may read or write tensors that are not among its arguments (an engine's
    attention reads its metadata from a forward context; any kernel may read a global). Python
    kernels run with torch-function modes off and with the calling dispatch mode popped, so the
    kernel is entered by redispatching below the Python key while a checking mode is pushed:
    every aten op it runs is then checked (not recorded), and the storages it touches noted.

    Returns:
        ``(result, touched, values)``: ``touched`` holds each storage the kernel read or wrote
        that is neither an argument's nor one the kernel made; ``values``, the host values the
        kernel's aten ops were called with, in order (a Python float it read: a CUDA graph
        replays the value of the capture). Both empty for an aten op.
    """
    if getattr(func, "namespace", "aten") == "aten" or not hasattr(func, "redispatch"):
        return func(*args, **kwargs), (), ()
    keys = None
    leaves = tree_leaves((args, kwargs))
    for a in leaves:
        if isinstance(a, FakeTensor):  # a legality check on fake tensors: the fake kernel runs
            return func(*args, **kwargs), (), ()
        if isinstance(a, torch.Tensor):
            k = torch._C._dispatch_keys(a)
            keys = k if keys is None else keys | k
    if keys is None:
        return func(*args, **kwargs), (), ()
    handles = {a.untyped_storage()._cdata for a in leaves if is_host_handle(a, graph.pool)}
    checker = _Checker(graph, _storages(leaves), handles)
    keeping = graph._recorder is not None and not holds_until_wait(func)
    held = _references(leaves, handles) if keeping else None
    with checker:
        out = func.redispatch(keys & _BELOW_PYTHON, *args, **kwargs)
    if held is not None and _references(leaves, handles) != held:
        graph._fail(_op_name(func), KEEPS)
    touched = tuple(checker.touched.values())
    kept = graph._made_by_kernels
    for cdata, ref in checker._made.items():  # alive after the kernel: kept (a global, a result)
        if not ref.expired():
            kept[cdata] = ref
    # a collective's kernel numbers its work (sequence numbers): no value of the model's
    values = () if holds_until_wait(func) else tuple(checker.values)
    if parent is not None:
        parent.heard(touched, values)
    return out, touched, values


KEEPS = (
    "its kernel keeps an argument past the call (a reference to the tensor, a view of it or its "
    "storage outlives the call: a cache filled by reference); a replay runs no Python, so what "
    "it kept would be the capture's tensor, which every replay rewrites. Run the op eagerly "
    "(splitting_ops=['ns::op'])"
)


def _references(leaves, handles) -> list[tuple[int, int, int]]:
    """Per tensor argument but the host handles (``handles``: their storages, which the emulator
    keeps itself): references to the tensor object, to its storage's Python object, and to its
    storage (tensors over it). A custom op's kernel that keeps its argument raises one."""
    found = []
    for leaf in leaves:
        if type(leaf) in _PLAIN and leaf.layout == torch.strided:
            storage = leaf.untyped_storage()
            if storage._cdata in handles:
                continue
            found.append(
                (sys.getrefcount(leaf), sys.getrefcount(storage), _USE_COUNT(storage._cdata))
            )
    return found


def _keeps(graph: EmulatedGraph, before: set[int], out: Any) -> bool:
    """Whether the custom op that just ran kept memory its kernel made beyond its results
    (registered since ``before``): a later op of the record may read it outside its arguments,
    and every replay must register the memory it makes anew (:class:`_ReadsState`)."""
    results = _storages(tree_leaves(out))
    return any(c not in before and c not in results for c in graph._made_by_kernels)


class _Touched:
    """A storage a custom op's kernel touched outside its arguments: the storage (weakly), its
    address, and what touched it (the tensor's dtype and shape, the aten op) for messages."""

    __slots__ = ("made", "ptr", "ref", "views", "what")

    def __init__(self, storage: torch.UntypedStorage, what: str, made: bool = False):
        self.ref = StorageWeakRef(storage)
        self.ptr = storage.data_ptr()
        self.what = what
        # the address, sizes and strides of each view of it the kernel's ops took: a CUDA
        # kernel reads the view it was launched on (``window[step:step + 4]`` at capture's step)
        self.views: set[tuple] = set()
        # made by another custom op's kernel earlier in the same capture or replay (a stash
        # in a forward context): a CUDA graph replays that kernel into the same memory
        self.made = made


def _storages(leaves) -> set[int]:
    return {
        leaf.untyped_storage()._cdata
        for leaf in leaves
        if type(leaf) in _PLAIN and leaf.layout == torch.strided
    }


class _Checker(TorchDispatchMode):
    """Rejects illegal ops without recording them (for the inside of custom op kernels); with
    ``theirs`` (the storages of the custom op's arguments), notes every other storage the ops
    touch that the kernel did not make itself; ``handles``: storages of the kernel's host
    handles (see :func:`is_host_handle`), whose ``.item()`` is read once and frozen instead."""

    def __init__(
        self,
        graph: EmulatedGraph,
        theirs: set[int] | None = None,
        handles: frozenset[int] | set[int] = frozenset(),
    ) -> None:
        super().__init__()
        self.graph = graph
        self.theirs = theirs
        self.handles = handles
        self.touched: dict[int, _Touched] = {}
        self._made: dict[int, StorageWeakRef] = {}
        self.values: list = []  # the host values the kernel's aten ops were called with

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return _run_hop(self.graph, func, args, kwargs, self)[0]
        if func in _SCALAR_READS and args[0].untyped_storage()._cdata in self.handles:
            return self.graph._freeze_handle(args[0])
        bad = _illegal_op(func, args, kwargs)
        if bad is not None:
            self.graph._fail(*bad)
        if self.theirs is not None and self.graph._undo is not None:
            self._save_outside_writes(func, args, kwargs)
        if self.theirs is not None and getattr(func, "namespace", None) == "aten":
            self.values.append(
                (func, *(a for a in tree_leaves((args, kwargs)) if isinstance(a, _HOST_VALUES)))
            )
        out, _, _ = _run_checked(self.graph, func, args, kwargs, self)
        if self.theirs is not None:
            self._note(func, tree_leaves((args, kwargs)), tree_leaves(out))
        return out

    def _save_outside_writes(self, func, args: tuple, kwargs: dict) -> None:
        """Before an op of the kernel writes a tensor outside the custom op's arguments (a
        global, a forward context's cache), keep its values for a failed capture to put back
        (:meth:`EmulatedGraph.capture_piece`)."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        named = dict(zip((a.name for a in schema.arguments), args, strict=False))
        named.update(kwargs)
        for argument in schema.arguments:
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            for leaf in tree_leaves(named.get(argument.name)):
                if type(leaf) not in _PLAIN or leaf.layout != torch.strided:
                    continue
                cdata = leaf.untyped_storage()._cdata
                if cdata not in self.theirs and cdata not in self._made:
                    self.graph._save_before_write(leaf)

    def _note(self, func, inputs: list, outputs: list) -> None:
        seen = _storages(inputs)
        for leaf in outputs:  # a fresh result is the kernel's own memory
            if type(leaf) in _PLAIN and leaf.layout == torch.strided:
                storage = leaf.untyped_storage()
                if storage._cdata not in seen:
                    self._made[storage._cdata] = StorageWeakRef(storage)
        for leaf in inputs:
            if type(leaf) not in _PLAIN or leaf.layout != torch.strided:
                continue
            storage = leaf.untyped_storage()
            cdata = storage._cdata
            if cdata in self.theirs or cdata in self._made:
                continue
            found = self.touched.get(cdata)
            if found is None:
                what = (
                    f"a {leaf.dtype} tensor of shape {tuple(leaf.shape)} (read by {_op_name(func)})"
                )
                maker = self.graph._made_by_kernels.get(cdata)
                made = maker is not None and not maker.expired()
                found = self.touched[cdata] = _Touched(storage, what, made)
            found.views.add((leaf.data_ptr(), tuple(leaf.shape), leaf.stride()))

    def heard(self, touched: tuple[_Touched, ...], values=()) -> None:
        """A custom op called inside this kernel touched these outside its own arguments, and
        its aten ops were called with ``values``."""
        if self.theirs is None:  # a checker that notes nothing (a legality check)
            return
        self.values.extend(values)
        for found in touched:
            cdata = found.ref.cdata
            if cdata not in self.theirs and cdata not in self._made:
                self.touched.setdefault(cdata, found).views.update(found.views)


class _ReadsState:
    """Replays a custom op whose kernel read what its arguments do not hold: tensors outside its
    arguments, or host values its aten ops were called with (``values``: a Python float the
    kernel read from a module or a global). Each replay runs it checked and raises
    :class:`StateMovedError` where it touches a storage that is another one, or at another
    address, than at capture, and :class:`HostValueChangedError` where its aten ops are called
    with other host values (a CUDA graph replays the capture's kernels, with the capture's
    values, silently)."""

    __slots__ = ("func", "graph", "name", "touched", "values")

    def __init__(
        self, graph: EmulatedGraph, func: Any, touched: tuple[_Touched, ...], values: tuple = ()
    ):
        self.graph = graph
        self.func = func
        self.name = _op_name(func)
        self.touched = {t.ref.cdata: t for t in touched}
        self.values = values

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.func, torch._ops.HigherOrderOperator):
            out, now = _run_hop(self.graph, self.func, args, kwargs)
        else:
            out, now, values = _run_checked(self.graph, self.func, args, kwargs)
            if self.values and repr(values) != repr(self.values):
                op = self.name.split(".")[0]
                raise HostValueChangedError(
                    f"{self.name}'s kernel read other host values than at capture ("
                    f"{_first_change(self.values, values)}): a Python value it reads outside its "
                    "arguments changed, and a CUDA graph replays the capture's kernels with the "
                    "capture's values, silently. Pass the value as an argument or keep it in a "
                    f"tensor, or run the op eagerly (splitting_ops=[{op!r}])"
                )
        made = any(t.made for t in self.touched.values())
        for found in now:
            was = self.touched.get(found.ref.cdata)
            if found.made and made:
                continue  # memory an earlier kernel of this replay made, as at capture
            if was is None or was.ref.expired():
                how = "another tensor than the one it touched"
            elif was.ptr != found.ptr:
                how = "the tensor it touched, but at another address than"
            elif not found.views <= was.views:
                how = "the tensor it touched, but another view of it (offset, sizes, strides) than"
            else:
                continue
            op = self.name.split(".")[0]
            raise StateMovedError(
                f"{self.name} touched {found.what} outside its arguments, {how} at capture; a "
                "CUDA graph replays the capture's kernels on the capture's memory and would "
                "read and write that instead, silently. Keep such state in a persistent buffer "
                f"updated in place, or run the op eagerly (splitting_ops=[{op!r}])"
            )
        return out


def _first_change(before: tuple, after: tuple) -> str:
    """The first aten call of a kernel whose host values differ, as ``op: was -> now``."""
    for was, now in zip(before, after, strict=False):
        if repr(was) != repr(now):
            return f"{_op_name(was[0])}: {list(was[1:])} -> {list(now[1:])}"
    return f"{len(before)} calls at capture, {len(after)} now"


def _run_hop(
    graph: EmulatedGraph, func: Any, args: tuple, kwargs: dict, parent: _Checker | None = None
) -> tuple[Any, tuple[_Touched, ...]]:
    """Run a higher-order op (``cond``, ``while_loop``, ``invoke_subgraph``, ``wrap``,
    ``auto_functionalized``, ...) once, checking every aten op its subgraphs run.

    A HOP's dense kernel asserts that no dispatch mode is active when it starts, so the op runs
    with the modes off and each subgraph module it calls pushes a checking mode while it runs.
    Python branching on a tensor (``cond`` on a tensor predicate, ``while_loop``'s condition)
    still meets the host-read guard, as a CUDA capture meets the sync.

    Returns:
        ``(result, touched)``: the storages the subgraphs' ops (a custom op's kernel in a
        branch) touched outside the HOP's arguments and what its subgraphs made, as
        :func:`_run_checked` finds them for a custom op.
    """
    flat, spec = tree_flatten((args, kwargs))
    # one checker for every subgraph run of this call: a loop's carried values, made by the
    # body's previous run, are the subgraphs' own memory
    checker = _Checker(graph, _storages(flat))

    def checked(module: torch.nn.Module) -> Callable:
        def run(*a: Any, **kw: Any) -> Any:
            with checker:
                return module(*a, **kw)

        return run

    wrapped = [checked(a) if isinstance(a, torch.nn.Module) else a for a in flat]
    run_args, run_kwargs = tree_unflatten(wrapped, spec)
    out = func(*run_args, **run_kwargs)
    touched = tuple(checker.touched.values())
    if parent is not None:
        parent.heard(touched)
    return out, touched


class _Recorder(TorchDispatchMode):
    """Records every op of a capture as a replay step.

    The record never holds the program's tensor objects: each tensor an op reads or writes is
    recorded as an *alias* made when the op ran (same memory, that moment's size, stride and
    offset), because a CUDA graph replays kernels on fixed addresses and layouts, so an in-place
    metadata change made later (``t_()``, ``unsqueeze_()``, ``as_strided_()``) must not reach
    steps recorded before it. Every tensor an op makes is moved into the graph's
    :class:`~fxsplit.runtime.emulation.emulated_pool.EmulatedPool` (its memory reused as a CUDA
    pool's
    is), except collectives' results, which their ``wait_tensor`` finds by identity, and tensors
    that require grad (the capture refuses those outputs).
    """

    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self.graph = graph
        self.pool = graph.pool
        self.steps: list[tuple] = []
        self.actions: list[tuple[str, str]] = []
        self._aliases: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # A higher-order op records and replays as one unit, like a custom op: replay re-runs it on
    # the recorded tensors, with the host values (a ``cond`` predicate on a size) frozen.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            out, touched = _run_hop(self.graph, func, args, kwargs)
            if touched:
                return self._record(func, args, kwargs, out, _ReadsState(self.graph, func, touched))
        else:
            bad = _illegal_op(func, args, kwargs) or _unregistered_generator(
                self.graph, func, args, kwargs
            )
            if bad is not None:
                self.graph._fail(*bad)
            before = set(self.graph._made_by_kernels)
            out, touched, values = _run_checked(self.graph, func, args, kwargs)
            # (a kernel whose aten ops take no host value replays unchecked)
            if touched or any(len(v) > 1 for v in values) or _keeps(self.graph, before, out):
                call = _ReadsState(self.graph, func, touched, values)
                return self._record(func, args, kwargs, out, call)
        return self._record(func, args, kwargs, out)

    def _alias(self, value: Any) -> Any:
        """The record's stand-in for a tensor the program holds (see the class docstring)."""
        if not isinstance(value, torch.Tensor) or type(value) not in _PLAIN:
            return value
        layout = (
            value.untyped_storage()._cdata,
            value.shape,
            value.stride(),
            value.storage_offset(),
        )
        hit = self._aliases.get(value)
        if hit is not None and hit[1] == layout:
            return hit[0]
        alias = self.pool.record_view(value)
        if alias is None:
            with torch.no_grad():
                alias = value.as_strided(value.shape, value.stride(), value.storage_offset())
        self._aliases[value] = (alias, layout)
        return alias

    def _adopt(self, value: Any, copy: bool = True) -> Any:
        if (
            isinstance(value, torch.Tensor)
            and type(value) in _PLAIN
            and value.layout == torch.strided
            and not value.requires_grad
            and value.device == self.pool.device
        ):
            return self.pool.adopt(value, copy)
        return value

    def _adopt_leaves(self, leaves: list, fresh: list[bool]) -> list:
        """The results of one call moved into the pool (those ``fresh`` says are new), one
        block per storage: results that view one another (a compiled piece returning both
        halves of a split) still do, as they do in a CUDA graph's memory."""
        from fxsplit.runtime.memory.storage import view_over

        blocks: dict[int, torch.UntypedStorage] = {}
        out = []
        for leaf, new in zip(leaves, fresh, strict=True):
            ptr = storage_ptr(leaf) if new else None
            if ptr in blocks:
                out.append(view_over(blocks[ptr], leaf))
                continue
            adopted = self._adopt(leaf) if new else leaf
            if new and adopted is not leaf:
                blocks[ptr] = adopted.untyped_storage()
            out.append(adopted)
        return out

    def _record(
        self, func: Any, args: tuple, kwargs: dict, out: Any, call: Callable | None = None
    ) -> Any:
        """Record ``func``'s call (replayed through ``call``, else ``func`` itself); returns
        ``out`` as the program gets it (moved into the pool)."""
        name = _op_name(func)
        if func in _ALLOC_OPS:
            self.actions.append((name, "skip:alloc"))
            return self._adopt(out, copy=False)
        if torch.Tag.inplace_view in getattr(func, "tags", ()):
            # unsqueeze_, t_, as_strided_, ...: a CUDA graph replays kernels, never the metadata
            # change, which happened once, at capture, on the program's tensor.
            self.actions.append((name, "skip:metadata"))
            return out
        if func in _CONSTANT_OPS and isinstance(out, torch.Tensor):
            self.steps.append((_RESTORE, None, out.clone(), None, self._alias(out)))
            self.actions.append((name, "restore"))
            return out
        flat_in, spec = tree_flatten((args, kwargs))
        in_ptrs = {storage_ptr(a) for a in flat_in if isinstance(a, torch.Tensor)} - {None}
        flat_in = [self._alias(_freeze_sym(a)) for a in flat_in]
        args, kwargs = tree_unflatten(flat_in, spec)

        def fresh(t: Any) -> bool:
            # A result sharing storage with an argument is a view / alias (or the mutated
            # argument itself): the recorded tensor already sees the storage, nothing to copy.
            return isinstance(t, torch.Tensor) and storage_ptr(t) not in in_ptrs

        schema = getattr(func, "_schema", None)
        mutable = schema is None or schema.is_mutable
        call = _callable(func) if call is None else call
        if is_collective(func):
            # Its result is not ready until the program's wait_tensor, which records as a view
            # (skipped). The replay waits right after issuing instead, then copies, so every
            # rank issues its collectives in the recorded order and reads only finished results.
            leaves = tree_leaves(out)
            copies = tuple((i, self._alias(t)) for i, t in enumerate(leaves) if fresh(t))
            self.steps.append((_COLLECTIVE, call, args, kwargs, copies))
            self.actions.append((name, _ACTION_NAMES[_COLLECTIVE]))
            return out
        if isinstance(out, torch.Tensor):
            if fresh(out):
                out = self._adopt(out)
                step = (_COPY1, call, args, kwargs, self._alias(out))
            elif mutable:
                step = (_RUN, call, args, kwargs, None)
            else:
                step = None
        elif out is None or isinstance(out, (bool, int, float, complex, str)):
            # No tensor result: keep it only for its side effects (mutation, asserts, custom ops).
            step = (_RUN, call, args, kwargs, None)
        else:
            flat = isinstance(out, (tuple, list)) and not any(
                isinstance(o, (tuple, list, dict)) for o in out
            )
            leaves, out_spec = (list(out), None) if flat else tree_flatten(out)
            flags = [fresh(t) for t in leaves]
            if any(flags):
                leaves = self._adopt_leaves(leaves, flags)
                out = type(out)(leaves) if flat else tree_unflatten(leaves, out_spec)
            copies = tuple(
                (i, self._alias(t)) for i, (t, f) in enumerate(zip(leaves, flags, strict=True)) if f
            )
            if copies:
                step = (_COPYN if flat else _COPYTREE, call, args, kwargs, copies)
            elif mutable or not any(isinstance(t, torch.Tensor) for t in leaves):
                step = (_RUN, call, args, kwargs, None)
            else:
                step = None
        if step is None:
            self.actions.append((name, "skip:view"))
            return out
        self.steps.append(step)
        self.actions.append((name, _ACTION_NAMES[step[0]]))
        return out


def _addresses(steps: tuple[tuple, ...]) -> tuple[tuple[torch.UntypedStorage, int], ...]:
    """Each distinct storage the record reads or writes, with its address at capture."""
    found: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for _, _, args, kwargs, dst in steps:
        for leaf in tree_leaves((args, kwargs, dst)):
            if type(leaf) in _PLAIN and leaf.layout == torch.strided:
                storage = leaf.untyped_storage()
                found.setdefault(storage._cdata, (storage, storage.data_ptr()))
    return tuple(found.values())


def _opaque(fn: Callable, *args: Any) -> Any:
    return call_opaque(fn, args)


def call_opaque(fn: Callable, args: tuple) -> Any:
    """``fn(*args)``; inside an emulated capture on this thread, recorded as one unit.

    For code whose kernels do not pass through the aten dispatcher (Inductor's CPU kernels): the
    dispatch-level recording would see only part of it. Replay calls ``fn`` again on the
    recorded tensors and copies its fresh results into the recorded outputs, as for any op.
    Whether ``fn`` is legal under capture is not checked here (check its uncompiled form).
    """
    graph = getattr(_tls, "active", None)
    if graph is None or graph._recorder is None:
        return fn(*args)
    # Recorded with the recorder off, as from its own __torch_dispatch__: moving the results
    # into the pool allocates (a new segment's torch.empty, the copy), and with the recorder on
    # those became ops of the capture, the segment's memory a block of the pool itself.
    with torch.utils._python_dispatch._disable_current_modes():
        out = fn(*args)
        return graph._recorder._record(fn, args, {}, out)


class _HostReadGuard(TorchFunctionMode):
    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            # A HOP's kernel branches on tensors in Python (``cond``'s predicate,
            # ``while_loop``'s condition): keep guarding inside it, then dispatch as its
            # ``__call__`` would after the torch-function check.
            with self:
                keys = torch._ops._compute_keyset(args, kwargs, func.non_fallthrough_keys)
                return func.dispatch(keys.highestPriorityTypeId(), *args, **kwargs)
        hit = op_facts.host_read(func, args, kwargs)
        if hit is not None:
            self.graph._fail(*hit)
        if func is F.one_hot:
            try:
                return _one_hot(*args, **kwargs)
            except CaptureError as err:
                self.graph._fail(err.op, err.reason)
        return func(*args, **kwargs)


def _one_hot(t: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """``F.one_hot`` as the CUDA kernel runs it: no host range check when num_classes is given.

    The CPU kernel reads min/max on the host (``.item()``) even with ``num_classes`` given; CUDA
    does not, so the emulator must not report that sync.
    """
    if num_classes < 0:
        raise CaptureError("aten::one_hot (num_classes=-1)", op_facts.DYNAMIC_SHAPE)
    out = torch.zeros(*t.shape, num_classes, dtype=torch.long, device=t.device)
    return out.scatter_(-1, t.unsqueeze(-1).long(), 1)


_patch_lock = threading.Lock()
_patch_depth = 0
_patch_saved: list[tuple[Any, str, bool, Any]] = []


def _refusing(original: Callable, label: str) -> Callable:
    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        graph = getattr(_tls, "active", None)
        if graph is None:  # another thread, or no capture: behave as before
            return original(*args, **kwargs)
        graph._fail(label, op_facts.STREAM_SYNC)

    return refuse


@contextlib.contextmanager
def _patched_syncs() -> Iterator[None]:
    """Make the synchronize entry points raise CaptureError on a capturing thread.

    They are not torch functions, so no mode sees them. Patched once for all concurrent captures
    (reference counted) and restored exactly (own attribute put back, inherited one deleted).
    """
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            for obj, attr, label in op_facts.sync_entry_points():
                own = attr in vars(obj)
                _patch_saved.append((obj, attr, own, vars(obj).get(attr)))
                setattr(obj, attr, _refusing(getattr(obj, attr), label))
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for obj, attr, own, original in reversed(_patch_saved):
                    if own:
                        setattr(obj, attr, original)
                    else:
                        delattr(obj, attr)
                _patch_saved.clear()


# --------------------------------------------------------------------------------------------
# Generators under capture
# --------------------------------------------------------------------------------------------

LEFT_CAPTURING = "Offset increment outside graph capture encountered unexpectedly."


def _generator_of(func: Any, args: tuple, kwargs: dict) -> torch.Generator | None:
    """The generator a random op draws from, or None for the default one."""
    generator = kwargs.get("generator")
    if generator is None:
        generator = next((a for a in args if isinstance(a, torch.Generator)), None)
    # the dispatcher hands a new Python object over the same generator: compare the generators
    if generator is None or generator._cdata == torch.default_generator._cdata:
        return None
    return generator


def _unregistered_generator(graph: EmulatedGraph, func: Any, args: tuple, kwargs: dict):
    """``(op, reason)`` where a random op draws from a generator other than the default one
    that the graph was not given (:class:`EmulatedGraph`'s ``generators``), as CUDA capture
    refuses it; else None."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return None
    generator = _generator_of(func, args, kwargs)
    if generator is None or any(generator._cdata == g._cdata for g in graph.generators):
        return None
    return (
        _op_name(func),
        "it draws from a generator other than the default one that is not registered with "
        "the graph (CUDAGraph.register_generator_state); a replay would not advance it",
    )


class _LeftCapturing(TorchDispatchMode):
    """The default generator as a failed capture leaves it on torch 2.11's CUDA: its
    ``capture_end`` raised before the generator's capture epilogue ran, so the generator still
    counts itself as capturing, and every later draw from it outside a capture raises
    (:data:`LEFT_CAPTURING`) until a capture completes or its capture state is closed
    (:func:`close_capture_state`, what fxsplit does after every failed capture; on CUDA an
    empty capture completing does it)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
            and getattr(_tls, "active", None) is None  # a draw inside a capture is one
            and _generator_of(func, args, kwargs) is None
        ):
            raise RuntimeError(LEFT_CAPTURING)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# The graph
# --------------------------------------------------------------------------------------------


class EmulatedGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph`` that reproduces CUDA-graph semantics.

    Usage mirrors a static-buffer CUDA graph runner::

        g = EmulatedGraph()
        static_out = g.capture(fn, static_x)   # runs fn once, records it
        static_x.copy_(new_x)                  # refill the recorded input in place
        g.replay()                             # static_out now holds fn(new_x)

    Semantics reproduced:

    * Frozen addresses and layouts: replay uses the memory and the size, stride and offset each
      op saw at capture. Data copied into a recorded input in place is seen; passing a different
      tensor object is not (stale read); a later in-place metadata change of a tensor
      (``t_()``) does not reach ops recorded before it.
    * Frozen host values: Python scalars, shapes and ints (SymInts are specialised) seen at
      capture are baked into the record.
    * One memory pool (:class:`~fxsplit.runtime.emulation.emulated_pool.EmulatedPool`, ``pool``; a
      private one by default): every tensor an op makes during capture lives in the pool, and a
      block freed during one capture (scratch) is handed to later allocations of this or another
      capture into the same pool, as the caching allocator does. Replaying a graph rewrites its
      scratch, so replays out of capture order overwrite later graphs' outputs, as on CUDA.
    * Outputs are the recorded tensors, overwritten in place by every replay; replay never
      allocates new outputs. Pure allocations (``empty*``, ``new_empty*``) are not replayed, so
      such memory keeps whatever it held before, as on CUDA.
    * Mutating ops (schema ``is_mutable``: in-place, ``out=``, custom ops with ``mutates_args``)
      re-run on the recorded arguments; out-of-place ops re-run and their fresh results are
      copied into the recorded outputs; ops whose results alias their inputs (views) are skipped,
      and so are in-place metadata changes (``unsqueeze_``, ``t_``, ``as_strided_``: ops tagged
      ``inplace_view``), which a CUDA graph does not replay either. Random ops draw fresh
      numbers on every replay (CUDA graphs advance the RNG offset).
    * Functional collectives (``_c10d_functional`` ops, e.g. gloo's ``all_reduce``) are
      re-issued on the recorded tensors, in recorded order, and waited for right there; their
      results are then copied into the recorded outputs (the program's own ``wait_tensor``
      records as a view). Every rank must replay the same records in the same order, as with
      NCCL collectives captured in CUDA graphs.
    * Capture raises :class:`CaptureError` for what CUDA capture rejects: ``.item()`` and other
      host reads (``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``, ``int(t)``,
      ``if t:``, printing), data-dependent output shapes (``nonzero``, ``unique``,
      ``masked_select``, ``x[mask]``, ...), ``synchronize`` calls, pinned allocations, ops tagged
      ``cudagraph_unsafe`` and nested capture. The graph then holds no record, even if ``fn``
      caught the error (CUDA invalidates the capture in that case too).
    * Higher-order ops (``cond``, ``while_loop``, ``invoke_subgraph``, ``wrap``,
      ``auto_functionalized``) record and replay as one unit, with every aten op of their
      subgraphs checked: ``cond`` on a host predicate (a size) replays the branch frozen at
      capture; a predicate or loop condition read from a tensor is a host read, rejected.
    * Replaying another ``EmulatedGraph`` during a capture records its ops into this one (the
      way a graph launch inside capture becomes a child graph).

    Args:
        pool: the memory pool captures allocate from; a private one when None.

    Caveats (what a CPU emulator cannot see):

    * Every tensor is a CPU tensor. One rule (:func:`is_host_handle`) tells host tensors from
      stand-ins for device tensors: a 0-dim integer tensor the capture did not make, handed to a
      custom op whose kernel reads it with ``.item()``, is a host handle (read once at capture,
      checked at each replay: :class:`HostValueChangedError` where its value or address
      changed). Every other tensor stands in for a device tensor: its ops are replayed and its
      ``.item()`` is rejected, also for host tensors that would legitimately stay on the CPU on
      a GPU machine.
    * Only ``.to("cpu")`` with a *string* device counts as device-to-host; ``.to(torch.device(
      "cpu"))`` and ``copy_`` into a host tensor are not detected. Host-to-device copies and
      capture on the default stream are not detected either.
    * ``synchronize`` is caught by patching ``torch.cuda`` / ``torch.cpu`` / ``torch.accelerator``
      and the CUDA ``Stream``/``Event`` classes during capture; a reference bound before capture
      (``from torch.cuda import synchronize``) escapes it.
    * Custom ops record and replay as one unit: a replay calls the op's kernel again, where a
      CUDA graph replays the kernels it launched at capture. The aten ops the kernel runs are
      checked (an ``.item()`` or ``nonzero`` inside is caught), and the tensors it reads or
      writes outside its arguments (a forward context's metadata, a module attribute, a
      global) are noted at capture: every replay checks it touches the same ones at the same
      addresses and raises :class:`StateMovedError` otherwise (a CUDA graph would touch the
      capture's memory, silently). Memory a kernel made and kept (stashed in a forward context
      for a later op of the same graph) is made anew by every replay, as a CUDA graph rewrites
      the capture's: a later op touching such memory, as at capture, is no moved state. The
      host values the kernel's aten ops are called with are noted too (a Python float it reads
      from a module, a step counter choosing which ops run): a replay that calls them with
      others raises :class:`HostValueChangedError` (a CUDA graph froze the capture's). A
      kernel that keeps an argument past the call (a reference outlives it: a cache filled by
      reference) fails the capture (:data:`KEEPS`): a replay runs no Python, so it would keep
      the capture's tensor, which every replay rewrites; CUDA captures it silently. Not seen:
      host reads that never reach the dispatcher on CPU (``.tolist()``, ``.numpy()``) inside a
      kernel (torch-function modes are off inside dispatcher kernels); Python values a kernel
      uses without passing them to an aten op (a C++ kernel reading a global, a value it only
      stores); memory a kernel reaches through a raw pointer rather than a tensor.
    * Collectives' results stay outside the pool (their ``wait_tensor`` finds them by identity),
      and so do tensors that require grad.
    * Replay runs without autograd (under ``inference_mode``, which may write the inference
      tensors a piece made inside its own inference_mode block) and with autocast disabled (the
      record already holds the autocast casts).
    * A failed capture leaves the default generator capturing as torch 2.11's CUDA does
      (:class:`_LeftCapturing`: draws outside a capture raise until a capture completes or
      :meth:`close_capture_state`), whatever this torch is: later torches keep generator state
      per capture and leave nothing, and modelling the worse case makes a missing recovery
      fail on every torch. A generator other than the default one must be registered
      (``generators``) or the capture fails, as on CUDA.
    * What stays different, and why it cannot be modelled on a CPU: warm-up runs and uncaptured
      runs go to the current stream, where CUDA captures on a side stream (a CPU has no streams;
      fxsplit captures on one stream per device, so only the emulator's ordering is simpler);
      errors are :class:`CaptureError` where CUDA raises ``torch.AcceleratorError`` (the message
      ends with CUDA's "operation not permitted when stream is capturing"); a failed capture's
      blocks return to this pool, where CUDA ends the allocator's recording and fxsplit moves to
      a fresh pool (the emulated pool has no recording state to leave behind); a kernel's
      launch configuration and the cuBLAS algorithm a replay picks (the emulator re-runs the
      same CPU kernels, so it replays bit for bit where CUDA may differ in the last bits); and
      Python values a custom op's kernel reads (see the custom-op caveat above).
    """

    def __init__(self, pool: EmulatedPool | None = None, generators=()) -> None:
        self.pool = pool if pool is not None else EmulatedPool()
        self.generators = tuple(generators)
        self.label: str | None = None  # what it captures, in leak reports (Block.made_by)
        self._steps: tuple[tuple, ...] | None = None
        self._actions: tuple[tuple[str, str], ...] = ()
        self._addresses: tuple[tuple[torch.UntypedStorage, int], ...] = ()
        # host handles the record's kernels read: storage -> (tensor, address, value at capture)
        self._handles: dict[int, tuple[torch.Tensor, int, int | bool]] = {}
        self._error: CaptureError | None = None
        self._recorder: _Recorder | None = None
        # storages custom ops' kernels made and kept during the capture or replay under way
        self._made_by_kernels: dict[int, StorageWeakRef] = {}
        # during capture_piece: (tensor, its values before) for a failed capture to put back
        self._undo: list | None = None
        self._undo_seen: set[tuple] = set()

    # -- public API ---------------------------------------------------------------------------

    def capture(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once, eagerly, recording every aten op it runs.

        Returns ``fn``'s result; its tensors are the recorded outputs that :meth:`replay`
        overwrites in place. Tensors passed here, and any other tensors ``fn`` reads (weights,
        buffers), are recorded by identity: later replays read whatever they hold then.

        Raises:
            CaptureError: ``fn`` ran an op CUDA capture rejects (see the class docstring), or this
                is a nested capture. No partial record is kept.
            RuntimeError: the graph already holds a record (call :meth:`reset` first).
            Exception: anything ``fn`` raises propagates; no record is kept.
        """
        outer = getattr(_tls, "active", None)
        if outer is not None:  # poisons the outer capture too, as CUDA would
            outer._fail(
                "EmulatedGraph.capture (nested capture)",
                "another capture is already running on this thread; CUDA graphs cannot nest",
            )
        if self._steps is not None:
            raise RuntimeError("EmulatedGraph already holds a capture; call reset() first")
        self._error = None
        self._made_by_kernels = {}
        self._handles = {}
        recorder = self._recorder = _Recorder(self)
        _tls.active = self
        self.pool.capture_begin(self.label)
        try:
            with _patched_syncs(), _HostReadGuard(self), recorder:
                result = fn(*args, **kwargs)
        except BaseException as exc:
            self._leave_capturing()
            if self._error is not None and exc is not self._error:
                err, self._error = self._error, None
                try:
                    raise err from exc
                finally:  # err's traceback holds this frame: no cycle keeping fn's tensors
                    del err
            self._error = None
            raise
        finally:
            _tls.active = None
            self._recorder = None
            self.pool.capture_end()
        if self._error is not None:
            self._leave_capturing()
            err, self._error = self._error, None
            raise CaptureError(
                err.op,
                f"{err.reason} (the error was caught inside the captured function, but "
                "CUDA invalidates the capture anyway)",
            ) from err
        close_capture_state()  # a completed capture ends the generator's capture
        self._steps = tuple(recorder.steps)
        self._actions = tuple(recorder.actions)
        self._addresses = _addresses(self._steps)
        return result

    def capture_piece(
        self,
        fn: Callable[..., Any],
        statics: list,
        written: list[int],
        uncompiled: Callable[..., Any] | None = None,
        validate: Callable[[Any], None] | None = None,
    ) -> Any:
        """:meth:`capture` of a piece, ``fn(*statics)``, then ``validate(outputs)``; where
        either fails, what the piece writes (``statics[i]`` for ``i`` in ``written``) and the
        CPU generator are left as they were before. A CUDA capture executes nothing, so the
        run that falls back to eager must find them so; an opaque op (no tag says it draws)
        may draw random numbers before the capture fails.

        ``uncompiled``: ``fn``'s generated Python, where ``fn`` is a compiled piece whose
        kernels bypass the dispatcher (Inductor's CPU kernels): its legality is checked on fake
        tensors (:meth:`check`; nothing runs for real) and ``fn`` is recorded as one unit
        (:func:`call_opaque`).

        Raises:
            CaptureError: an op illegal under capture (see :meth:`capture`).
            fxsplit.runtime.inputs.binding.Refused: the legality check could not run on fake
            tensors.
            Exception: what ``fn`` or ``validate`` raised.
        """
        kept = [statics[i] for i in written if isinstance(statics[i], torch.Tensor)]
        saved = [(static, static.clone()) for static in kept]
        rng = torch.get_rng_state()
        self._undo = saved  # custom ops' kernels add what they write outside their arguments
        self._undo_seen = set()
        try:
            run = fn
            if uncompiled is not None:
                self._check_on_fakes(uncompiled, statics)
                run = functools.partial(_opaque, fn)
            outputs = self.capture(run, *statics)
            if validate is not None:
                validate(outputs)
        except BaseException:
            for static, copy in reversed(saved):
                static.copy_(copy)
            torch.set_rng_state(rng)  # the fallback run draws what eager draws
            raise
        finally:
            self._undo = None
        return outputs

    def _leave_capturing(self) -> None:
        """A capture failed: the default generator stays capturing, as on CUDA
        (:class:`_LeftCapturing`)."""
        global _left_capturing
        if _left_capturing is None:
            _left_capturing = _LeftCapturing()
            torch._C._push_on_torch_dispatch_stack(_left_capturing)

    def close_capture_state(self) -> None:
        """After a failed capture: :func:`close_capture_state`."""
        close_capture_state()

    def _save_before_write(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s values (a view a custom op's kernel is about to write outside its
        arguments) for :meth:`capture_piece` to put back if the capture fails."""
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
        if key in self._undo_seen:
            return
        self._undo_seen.add(key)
        with torch.utils._python_dispatch._disable_current_modes():
            self._undo.append((tensor, tensor.clone()))

    def _check_on_fakes(self, fn: Callable[..., Any], statics: list) -> None:
        """:meth:`check` of ``fn`` on fake copies of ``statics``: what CUDA capture would
        reject raises, and nothing runs for real (no random number drawn, no collective
        issued, no input written).

        Raises:
            CaptureError: an op illegal under capture.
            fxsplit.runtime.inputs.binding.Refused: the check itself could not run on fake tensors.
        """
        from torch._subclasses.fake_tensor import FakeTensorMode

        from fxsplit.runtime.inputs.binding import Refused

        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in statics]
                self.check(fn, *fakes)
        except CaptureError:
            raise
        except Exception as error:
            raise Refused(
                "its capture legality could not be checked on fake tensors "
                f"({type(error).__name__}: {error})"
            ) from error

    def check(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` under capture's checks without recording it (call it with fake
        tensors to check an opaque piece's legality without running it for real).

        Raises:
            CaptureError: ``fn`` ran an op CUDA capture rejects, or a capture is under way.
            Exception: anything ``fn`` raises.
        """
        if getattr(_tls, "active", None) is not None:
            _tls.active._fail(
                "EmulatedGraph.check (nested capture)",
                "another capture is already running on this thread; CUDA graphs cannot nest",
            )
        self._error = None
        _tls.active = self
        try:
            with _patched_syncs(), _HostReadGuard(self), _Checker(self):
                fn(*args)
        except BaseException as exc:
            err, self._error = self._error, None
            if err is not None and exc is not err:
                raise err from exc
            raise
        finally:
            _tls.active = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def replay(self) -> None:
        """Re-run the record on the recorded tensors, writing into the recorded outputs in place.

        Takes no arguments on purpose: new data must be copied into the recorded input tensors
        beforehand. Outputs returned by :meth:`capture` (and any references to them) are
        overwritten.

        Raises:
            RuntimeError: nothing has been captured (or the graph was reset).
            MovedMemoryError: memory the record uses moved since capture (see there).
            HostValueChangedError: a host handle a kernel read at capture changed (see there).
        """
        steps = self._steps
        if steps is None:
            raise RuntimeError("EmulatedGraph.replay() before a successful capture()")
        for storage, address in self._addresses:
            if storage.data_ptr() != address:
                raise MovedMemoryError(
                    f"{self!r}: a storage of {storage.nbytes()} bytes it recorded at capture has "
                    "moved to other memory since; a CUDA graph would read and write its old "
                    "address"
                )
        self._made_by_kernels = {}
        for handle, address, value in self._handles.values():
            if handle.data_ptr() != address or handle.item() != value:
                raise HostValueChangedError(
                    f"{self!r}: a custom op's host handle read as {value} at capture (a 0-dim "
                    f"{handle.dtype} CPU tensor) now holds {handle.item()} at "
                    f"{'another' if handle.data_ptr() != address else 'the same'} address; a "
                    "CUDA graph would replay with the old value. Capture again after changing it."
                )
        # Inference mode: a captured piece may have made inference tensors (an inference_mode
        # block inside it), which only inference mode may write; a kernel has no grad mode.
        with torch.inference_mode(), torch._C._DisableAutocast():
            for kind, call, args, kwargs, dst in steps:
                if kind == _COPY1:
                    dst.copy_(call(*args, **kwargs))
                elif kind == _RUN:
                    call(*args, **kwargs)
                elif kind == _COPYN:
                    res = call(*args, **kwargs)
                    for i, d in dst:
                        d.copy_(res[i])
                elif kind == _COPYTREE:
                    leaves = tree_leaves(call(*args, **kwargs))
                    for i, d in dst:
                        d.copy_(leaves[i])
                elif kind == _COLLECTIVE:
                    leaves = tree_leaves(call(*args, **kwargs))
                    for leaf in leaves:
                        if isinstance(leaf, torch.Tensor):
                            _wait_tensor(leaf)
                    for i, d in dst:
                        d.copy_(leaves[i])
                else:  # _RESTORE: args holds the constant captured at capture time
                    dst.copy_(args)

    def reset(self) -> None:
        """Drop the record and the references it holds to tensors (so they can be freed)."""
        self._steps = None
        self._actions = ()
        self._addresses = ()
        self._handles = {}

    @property
    def num_ops(self) -> int:
        """Number of aten ops recorded at capture (skipped ones included); 0 when empty."""
        return len(self._actions)

    @property
    def num_replayed_ops(self) -> int:
        """Number of recorded ops a replay actually runs (views and allocations are skipped)."""
        return len(self._steps) if self._steps is not None else 0

    @property
    def actions(self) -> tuple[tuple[str, str], ...]:
        """``(op name, action)`` per recorded op, in order; action is one of ``"run+copy"``,
        ``"run"``, ``"restore"``, ``"skip:view"``, ``"skip:alloc"``, ``"skip:metadata"``."""
        return self._actions

    @property
    def empty(self) -> bool:
        """True when the record holds no kernel (views, allocations and metadata changes
        only): CUDA warns "The CUDA Graph is empty" for such a capture."""
        return self._steps is not None and not self._steps

    @property
    def captured(self) -> bool:
        """True when the graph holds a record that :meth:`replay` can run."""
        return self._steps is not None

    # -- internals ----------------------------------------------------------------------------

    def _freeze_handle(self, handle: torch.Tensor) -> int | bool:
        """Read a host handle (see :func:`is_host_handle`) once, keeping its value and address
        for :meth:`replay` to check."""
        with torch.utils._python_dispatch._disable_current_modes():
            value = handle.item()
        self._handles.setdefault(
            handle.untyped_storage()._cdata, (handle, handle.data_ptr(), value)
        )
        return value

    def _fail(self, op: str, reason: str) -> None:
        err = CaptureError(op, reason)
        if self._error is None:
            self._error = err
        try:
            raise err
        finally:  # err's traceback holds this frame: no cycle keeping the caller's tensors
            del err

    def __repr__(self) -> str:
        state = f"{self.num_ops} ops" if self.captured else "empty"
        return f"EmulatedGraph({state})"
