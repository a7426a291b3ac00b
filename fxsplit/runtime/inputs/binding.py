"""Input binding: what each input of a captured piece is, and whose memory its static buffer is.

A captured graph reads its inputs at the addresses seen at capture (its *static buffers*). The
ownership rule (docs/capture.md, "Whose memory fxsplit writes"):

    fxsplit writes into a tensor the caller handed in only where the model itself writes it. A
    caller's tensor is a static buffer (bound by address, never copied into) only when the caller
    declared it persistent; every other static buffer is fxsplit's own, and a value at another
    address is copied into it.

Declared persistent: parameters and buffers, tensors marked with
``torch._dynamo.mark_static_address`` (both :data:`PARAM`), and runner inputs under
``input_binding="strict"`` (the default of runners with persistent inputs, v2). Values the caller
never handed in (outputs of earlier pieces or graphs, values computed eagerly between two compiled
graphs) are always fxsplit's to copy, never a reason to refuse.

Input kinds (:attr:`InputSpec.kind`), known at split time:

- ``PARAM``: a parameter or buffer (Dynamo's static inputs reached through a module). Never
  copied; its address is checked once per step and a move recaptures.
- ``STATIC``: a ``mark_static_address`` tensor the caller hands in as an argument (a KV cache):
  never copied; its address is part of the capture key, so one function called with each
  layer's cache captures a graph per cache, each bound to its cache's address.
- ``RUNNER``: a tensor the caller hands in each call.
- ``INTERNAL``: a value the caller never handed in: an earlier piece's output, or a tensor
  argument of a frame Dynamo resumed after a graph break other than a parameter or buffer (its
  stack values ``L['___stack<i>']`` and live locals were computed by the model).
- ``HOST``: a Python int/float/bool or SymInt: part of the capture key, frozen by a replay.

How a tensor input is bound (:class:`Bind`) is decided at capture from the kind, the
``input_binding`` option and where the capture-step value came from (:func:`bind`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import torch
from torch.fx import Node

from fxsplit.facts.inputs import is_static_argument, is_static_input

PARAM, STATIC, RUNNER, INTERNAL, HOST = "param", "static", "runner", "internal", "host"

# Dynamo's name for a value on the Python stack at a graph break, handed to the resumed frame.
_STACK_SOURCE = re.compile(r"^L\['___stack\d+'\]$")


class Refused(Exception):
    """This call's inputs cannot be captured with their aliasing kept; run it uncaptured."""


class BindingError(RuntimeError):
    """A runner input of a captured piece moved under ``input_binding="strict"``."""


class Bind(enum.IntEnum):
    """How a captured graph's static buffer relates to the value a call hands in."""

    #: a parameter, buffer or ``mark_static_address`` tensor; the graph runtime checks addresses
    FROZEN = 0
    #: a host value (part of the capture key)
    HOST = 1
    #: fxsplit's own buffer (caller's strides); a value elsewhere is copied in when it changed
    OWN = 2
    #: the caller's persistent tensor itself; elsewhere is a :class:`BindingError`
    ADDRESS = 3
    #: the caller's capture-step tensor, never checked (``input_binding="trust"``: unsafe)
    TRUST = 4
    #: a runner input that is a view of a parameter or buffer (``model(x, self.cache[0])``):
    #: frozen memory, bound by address; elsewhere the call runs uncaptured
    PINNED = 5


@dataclass(frozen=True)
class InputSpec:
    """One input of a captured piece.

    Attributes:
        name: the value's node name.
        source: where it comes from: Dynamo's source for graph inputs (e.g. ``L['positions']``),
            else ``"<piece> output"``.
        kind: ``PARAM``, ``RUNNER``, ``INTERNAL`` or ``HOST``.
        symbolic: a tensor with a symbolic (dynamic) dimension: its shape is part of the key.
        written: the piece writes its data (from :mod:`fxsplit.facts.aliasing`).
        rebound: a parameter or buffer that moved on consecutive calls (the model rebinds it,
            or weights were reloaded twice), now copied like a runner input: its version
            counter is not trusted to tell a change, since weight loaders write through
            ``.data``, which leaves it as it was.
    """

    name: str
    source: str
    kind: str
    symbolic: bool = False
    written: bool = False
    rebound: bool = False


def bind(spec: InputSpec, binding: str, produced: bool) -> Bind:
    """How to bind a tensor input at capture.

    Args:
        spec: the input.
        binding: the ``input_binding`` option: ``"copy"``, ``"strict"`` or ``"trust"``.
        produced: the capture-step value lives in memory fxsplit produced (an output of a
            compiled graph's last call, or one of fxsplit's static buffers), not the caller's.
    """
    if spec.kind == PARAM:
        return Bind.FROZEN
    if spec.kind == STATIC:
        return Bind.ADDRESS
    if spec.kind == HOST:
        return Bind.HOST
    if spec.kind == RUNNER and not produced:
        if binding == "strict":
            return Bind.ADDRESS
        if binding == "trust":
            return Bind.TRUST
    return Bind.OWN


def moved_error(where: str, name: str, source: str, now: int, was: int, reads: str) -> BindingError:
    """The one :class:`BindingError` message of strict binding, capture on or off.

    Args:
        where: the piece (or graph) and its regions.
        name / source: the input's node name and Dynamo source.
        now / was: the address handed in now and the one fixed at capture.
        reads: what holds the fixed address ("the captured graph reads", ...).
    """
    return BindingError(
        f"{where}: input {name!r} from {source} is at 0x{now:x}, but {reads} 0x{was:x}; with "
        "input_binding='strict' a runner must hand the same tensor every step (use persistent "
        "buffers, or input_binding='copy'). Checked in every capture mode, so a runner bug fails "
        "on the CPU as it would on a GPU."
    )


#: :func:`key_reads`' mark for the address of a ``STATIC`` input.
ADDRESS_READ = -2


def key_reads(specs: list[InputSpec], inputs: list[Node]) -> tuple[tuple[int, int | None], ...]:
    """What a capture key reads: ``(i, None)`` for a host value, ``(i, d)`` for dim ``d`` of
    tensor input ``i``, one per distinct symbolic size expression, ``(i, ADDRESS_READ)`` for
    the address of a ``STATIC`` input (a graph per marked cache).

    Every dynamic dim of every tensor input is one of these expressions, so equal keys mean equal
    input shapes; reading each expression once keeps the key short (usually one int: the token
    count).
    """
    reads: list[tuple[int, int | None]] = []
    seen: set[object] = set()
    for i, (spec, node) in enumerate(zip(specs, inputs, strict=True)):
        if spec.kind == HOST:
            reads.append((i, None))
            continue
        if spec.kind == STATIC:
            reads.append((i, ADDRESS_READ))
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            if spec.symbolic:
                reads.append((i, -1))  # no traced shape: key on the whole shape
            continue
        for d, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if expr not in seen:
                    seen.add(expr)
                    reads.append((i, d))
    return tuple(reads)


def classify(
    inputs: list[Node],
    producer: dict[Node, str],
    written: frozenset[int] = frozenset(),
    volatile: frozenset[str] = frozenset(),
    *,
    resumed: bool = False,
    statics: set[str] | frozenset[str] = frozenset(),
) -> list[InputSpec]:
    """Describe each input of a captured piece.

    Args:
        inputs: the piece's input nodes, in call order.
        producer: for values produced by earlier pieces, that piece's name.
        written: indices of the inputs the piece writes (:attr:`PieceAliasing.written`).
        volatile: names of static-input placeholders the model rebinds every step (``self.t =
            self.t + 1``): fxsplit's to copy, like values the caller never handed in.
        statics: names of the marked caches handed in as arguments
            (:func:`is_static_argument`) and of the views of them earlier captured pieces
            return (``kv[0, 1]``): ``STATIC``, read by address wherever they are.
        resumed: the graph belongs to a frame Dynamo resumed after a graph break, whose tensor
            arguments are the model's live values (stack slots and locals), not the caller's:
            all but its parameters and buffers are fxsplit's to copy (those stay ``PARAM``: a
            copy skipped on an unchanged version counter missed writes through ``.data``).
    """
    specs = []
    for i, node in enumerate(inputs):
        value = node.meta.get("example_value")
        is_tensor = isinstance(value, torch.Tensor)
        symbolic = is_tensor and any(isinstance(d, torch.SymInt) for d in value.shape)
        if node.op == "placeholder":
            grapharg = node.meta.get("grapharg")
            source = str(grapharg.source.name if grapharg is not None else node.target)
            if not is_tensor:
                kind = HOST
            elif node.name in volatile:
                kind = INTERNAL
            elif node.name in statics or is_static_argument(node):
                kind = STATIC
            elif is_static_input(node):  # also on Dynamo's stack at a break (an argument)
                kind = PARAM
            else:
                kind = INTERNAL if resumed or _STACK_SOURCE.match(source) else RUNNER
        elif node in producer:
            source = f"{producer[node]} output"
            kind = INTERNAL if is_tensor or value is None else HOST
            if kind == INTERNAL and node.name in statics:
                kind = STATIC
        else:
            source = "graph input"
            kind = HOST if not is_tensor else RUNNER
        if kind == INTERNAL and value is None:
            # No traced value (a plain torch.fx graph): treat as a tensor and bind at run time.
            symbolic = True
        rebound = node.op == "placeholder" and node.name in volatile
        specs.append(InputSpec(node.name, source, kind, symbolic, i in written, rebound))
    return specs
