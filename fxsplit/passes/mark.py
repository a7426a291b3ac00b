"""Mark pass: decide for every node whether it must run eagerly, and record why.

Reasons are strings: ``"region:<name>"`` (inside a region the runner runs eagerly),
``"op:<ns::op>"`` (a configured splitting op), ``"module:<pattern>"`` (inside a module matched by
``eager_modules``, or by a ``module_regions`` pattern whose region is eager),
``"preset:<name>"`` (matched by a built-in or configured region preset, see
:mod:`fxsplit.presets`, in a region the runner runs eagerly), ``"unsafe:<ns::op>"`` (an op that
can never be captured) and ``"state:<setter>"`` (governed by a global setter that cannot be
re-entered per piece, see :func:`fxsplit.passes.global_state.setter_spans`). Placeholders and
``get_attr`` nodes are never marked: Dynamo creates placeholders at their first use, so they
inherit the annotations of whatever region first touched them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from fxsplit.facts import keeping, op_facts
from fxsplit.facts.ops import OpMatcher, op_name
from fxsplit.passes import global_state
from fxsplit.passes.modules import ModuleMatcher
from fxsplit.passes.normalise import is_multi_output_getitem, waited_collective
from fxsplit.passes.preset_match import PresetMatcher
from fxsplit.presets import Preset
from fxsplit.regions import node_regions
from fxsplit.runners import Runner

_HOST_VALUES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool, torch.Size)


@dataclass
class Policy:
    """What the mark pass looks for, built from a :class:`~fxsplit.config.Config`.

    Raises:
        ValueError: a malformed ``splitting_ops`` name.
    """

    eager_regions: frozenset[str]
    splitting_ops: OpMatcher
    module_regions: ModuleMatcher
    eager_modules: ModuleMatcher
    presets: PresetMatcher = field(default_factory=lambda: PresetMatcher(()))
    # the runner hands fresh inputs each step: a cache it writes runs with attention
    # (fxsplit.passes.cache_ops)
    cache_with_attention: bool = False

    @classmethod
    def build(
        cls,
        runner: Runner,
        splitting_ops=(),
        module_regions=None,
        eager_modules=(),
        presets: tuple[Preset, ...] = (),
    ):
        return cls(
            frozenset(runner.eager_regions),
            OpMatcher(splitting_ops),
            ModuleMatcher(dict(module_regions or {})),
            ModuleMatcher(list(eager_modules)),
            PresetMatcher(presets),
            not runner.persistent_inputs,
        )

    def set_root(self, cls: type | None) -> None:
        """The compiled module's class, for every module matcher (see
        :meth:`ModuleMatcher.set_root`)."""
        self.module_regions.set_root(cls)
        self.eager_modules.set_root(cls)
        self.presets.set_root(cls)

    def unused_patterns(self) -> list[str]:
        """Configured splitting ops and module patterns that matched no node so far."""
        return [
            *(n for n in self.splitting_ops.names if n not in self.splitting_ops.used),
            *(p for p in self.module_regions.patterns if p not in self.module_regions.used),
            *(p for p in self.eager_modules.patterns if p not in self.eager_modules.used),
        ]


@dataclass
class Marks:
    """Result of the mark pass.

    Attributes:
        nodes: the nodes to partition, in graph order (no placeholder, get_attr or output).
        reasons: eager nodes -> sorted reason strings.
        regions: nodes inside any region -> region names (marked and module-matched).
        follows: nodes that take another node's kind: a multi-output getitem its producer's,
            a collective's ``wait_tensor`` its collective's, a Size value its (single, next)
            user's.
        trivial: nodes that launch no kernel (host values, allocations, views).
        host: nodes that only turn a graph input into a host value; they run in the stitched
            module before any piece, like placeholders (see :func:`is_host_input`).
    """

    nodes: list[Node] = field(default_factory=list)
    reasons: dict[Node, tuple[str, ...]] = field(default_factory=dict)
    regions: dict[Node, tuple[str, ...]] = field(default_factory=dict)
    follows: dict[Node, Node] = field(default_factory=dict)
    trivial: set[Node] = field(default_factory=set)
    host: list[Node] = field(default_factory=list)


def is_host_input(node: Node) -> bool:
    """``.item()`` of a Python float Dynamo passed in as a 0-dim tensor (``dynamic=True`` lifts
    float attributes such as ``eps`` this way). It reads host memory, never device memory, so it
    is no sync; it runs before the pieces and its value reaches them as an input.
    """
    if node.op != "call_method" or node.target != "item" or len(node.args) != 1:
        return False
    source = node.args[0]
    return (
        isinstance(source, Node)
        and source.op == "placeholder"
        and getattr(source.meta.get("grapharg"), "pass_arg_as_tensor", False)
    )


def _trivial_target(node: Node) -> bool:
    """Whether the node's target launches no kernel whatever its values (state switches,
    allocations of the ``empty`` family); decided per target and cached by :func:`mark`. Views
    are decided per node (:func:`fxsplit.facts.op_facts.is_view`)."""
    return global_state.is_state_node(node) or op_facts.is_allocation(node)


_SKIPPED = frozenset({"placeholder", "get_attr", "output"})


def mark(
    graph: Graph,
    policy: Policy,
    dynamic: dict[Node, tuple[str, ...]] | None = None,
    grad_at_entry: bool = True,
) -> Marks:
    """Mark every node of ``graph`` (normalised, see :mod:`fxsplit.passes.normalise`).

    ``dynamic``: nodes that read or make a size changing every step, with their
    ``dynamic:<what>`` reasons (:func:`fxsplit.passes.step_sizes.find`). ``grad_at_entry``:
    grad mode when the graph is called; entered without grad, a node whose result autograd
    tracks (an ``enable_grad`` block, a forward-mode dual) is capture-unsafe: a replay would
    return the capture step's autograd graph, and what it saves must be lent, not pool memory
    (:mod:`fxsplit.facts.keeping`). Entered with grad, the runtime refuses to capture where an
    input or an output requires grad."""
    marks = Marks()
    eager_regions = policy.eager_regions
    splitting_ops = policy.splitting_ops or None
    module_regions = policy.module_regions or None
    eager_modules = policy.eager_modules or None
    presets = policy.presets or None
    if presets is not None:
        presets.prepare(graph)
    by_target: dict[object, tuple[str | None, bool]] = {}
    on_accelerator = any(
        isinstance(v := n.meta.get("example_value"), torch.Tensor) and v.device.type != "cpu"
        for n in graph.find_nodes(op="placeholder")
    )
    getitem = operator.getitem
    governed = global_state.setter_spans([n for n in graph.nodes if n.op not in _SKIPPED])
    for node in graph.nodes:
        op = node.op
        if op in _SKIPPED:
            continue
        target = node.target
        if op == "call_method" and target == "item" and is_host_input(node):
            marks.host.append(node)
            continue
        marks.nodes.append(node)
        meta = node.meta
        value = meta.get("example_value")
        if target is getitem and is_multi_output_getitem(node):
            marks.follows[node] = node.args[0]
            marks.trivial.add(node)
            continue
        if waited_collective(node) is not None:
            # Placed right after its collective by normalise; one piece holds both.
            marks.follows[node] = node.args[0]
            marks.trivial.add(node)
            continue
        if type(value) is torch.Size:
            # A Size copy is bookkeeping placed by normalise: it takes its user's kind and adds
            # no region of its own.
            marks.follows[node] = next(iter(node.users))
            marks.trivial.add(node)
            continue
        custom = meta.get("custom")
        regions = node_regions(custom) if custom else ()
        reasons = [f"region:{r}" for r in regions if r in eager_regions] if regions else []
        module_hits = module_regions.match(node) if module_regions is not None else ()
        for pattern, name in module_hits:
            if name not in regions:
                regions += (name,)
            if name in eager_regions:
                reasons += (f"region:{name}", f"module:{pattern}")
        if eager_modules is not None:
            reasons += (f"module:{p}" for p, _ in eager_modules.match(node))
        op_hit = splitting_ops.match(node) if splitting_ops is not None else None
        if op_hit is not None:
            reasons.append(f"op:{op_hit}")
        if presets is not None:
            # The user's own marks come first: a node they matched by op (or by module) is not
            # matched against op (or module) presets, and a preset adds nothing to a region the
            # node is in already.
            for preset in presets.match(node, ops=op_hit is None, modules=not module_hits):
                if preset.region in regions:
                    continue
                regions += (preset.region,)
                if preset.region in eager_regions:
                    reasons += (f"region:{preset.region}", f"preset:{preset.name}")
        if governed and node in governed:
            reasons.append(f"state:{governed[node]}")
        if dynamic and node in dynamic:
            reasons += dynamic[node]
        key = (op, target)
        try:
            if getattr(target, "__module__", None) == "_operator":
                raise TypeError  # named per argument kinds (ops.operator_op), not per target
            unsafe, trivial = by_target[key]
        except KeyError:
            unsafe, trivial = by_target[key] = (op_facts.unsafe(node), _trivial_target(node))
        except TypeError:  # an unhashable target, or a Python operator
            unsafe, trivial = op_facts.unsafe(node), _trivial_target(node)
        if unsafe is None and meta.get("unbacked_bindings"):
            unsafe = op_name(node) or str(target)
        if unsafe is None and on_accelerator and _host_work(node, value):
            unsafe = f"{op_name(node) or getattr(target, '__name__', target)} (host tensor)"
        if unsafe is None and _autograd_tracked(value, grad_at_entry):
            unsafe = f"{op_name(node) or getattr(target, '__name__', target)} (autograd tracks it)"
        if unsafe is not None:
            reasons.append(f"unsafe:{unsafe}")
        if regions:
            marks.regions[node] = regions
        if reasons:
            marks.reasons[node] = tuple(sorted(set(reasons)))
        if (
            trivial
            or isinstance(value, _HOST_VALUES)
            or op_facts.is_view(node)
            or (target is getitem and not isinstance(value, torch.Tensor))
        ):
            marks.trivial.add(node)
    return marks


def _autograd_tracked(value: object, grad_at_entry: bool) -> bool:
    """A tensor result autograd tracks where the graph's callers do not: one an autograd node
    made (it may save what it read) under a graph entered without grad, or one with a
    forward-mode tangent. A parameter and its views require grad without a node (no_grad keeps
    ``requires_grad`` on views of a leaf); a value torch gives no answer for is not marked (the
    runtime refuses a capture whose output requires grad)."""
    if not isinstance(value, torch.Tensor):
        return False
    if value.requires_grad:
        return not grad_at_entry and value.grad_fn is not None
    return keeping.tracked(value, unknown=False)


def _host_work(node: Node, value: object) -> bool:
    """In a graph on an accelerator, whether ``node`` makes or reads a CPU tensor: a
    device-to-host copy (a sync), a host-to-device copy (illegal under capture), or CPU work
    that a captured graph would run once at capture and freeze (a CPU scalar tensor read by a
    device kernel is read on the host at launch). Such nodes run eagerly."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return True
    return any(
        isinstance(v := a.meta.get("example_value"), torch.Tensor) and v.device.type == "cpu"
        for a in node.all_input_nodes
    )
