"""The split pipeline: normalise -> step sizes -> mark (and the cache work attention reads) ->
partition -> materialise.

Each pass is a module with one job; :func:`split` runs them in order on a Dynamo GraphModule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch.fx import GraphModule

from fxsplit.facts import aliasing, op_facts
from fxsplit.passes import cache_ops, mark, materialise, normalise, partition, step_sizes
from fxsplit.plan import Piece, SplitPlan
from fxsplit.regions import ATTENTION
from fxsplit.split_result import Split, SplitPiece

__all__ = ["Split", "SplitPiece", "split"]


def split(
    gm: GraphModule,
    policy: mark.Policy,
    *,
    graph_id: str = "graph_0",
    runner: str = "v1",
    grad_at_entry: bool = True,
    analyse: bool = False,
    size_input: int | Sequence[int] | None = None,
    model_values: bool = False,
    dynamic: bool = False,
) -> Split:
    """Split ``gm`` (modified in place by the normalise pass) under ``policy``.

    Args:
        gm: a Dynamo GraphModule (nodes carry ``example_value`` meta); plain ``torch.fx``
            graphs work too, without the Size and getitem rules that need it.
        policy: what to run eagerly (:class:`fxsplit.passes.mark.Policy`).
        graph_id: name of the graph in the plan and in generated code's file name.
        runner: runner name recorded in the plan.
        grad_at_entry: grad mode when the graph is called.
        analyse: run the aliasing analysis (:mod:`fxsplit.facts.aliasing`) on every captured
            piece (what capture needs; costs one functionalized fake run of those pieces).
        size_input: index of the placeholder whose sizes are the token count (see
            :func:`fxsplit.size_input.size_input_index`), or several: the first one's
            sizes, and the leading dim of the others, are the token count
            (:func:`~fxsplit.size_input.size_input_indices`); every other size that
            changes per step runs eagerly (:mod:`fxsplit.passes.step_sizes`).
        model_values: the graph's tensor arguments are the model's own values (a frame Dynamo
            resumed after a graph break, or one called by eager model code): only the size
            input's leading dim is the token count there.
        dynamic: ``gm`` was traced under ``torch.compile(dynamic=True)``
            (:func:`fxsplit.passes.step_sizes.find`'s ``every_size``).

    Returns:
        a :class:`Split` with the :class:`~fxsplit.plan.SplitPlan`.
    """
    start = time.perf_counter()
    normalise.normalise(gm.graph)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    indices = (size_input,) if isinstance(size_input, int) else tuple(size_input or ())
    tokens = [placeholders[i] for i in indices]
    steps = step_sizes.find(gm.graph, tokens, leading_only=model_values, every_size=dynamic)
    marks = mark.mark(gm.graph, policy, steps.reasons, grad_at_entry)
    if policy.cache_with_attention and ATTENTION in policy.eager_regions:
        for node, reason in cache_ops.find(gm.graph, marks, ATTENTION).items():
            marks.reasons[node] = (reason,)
    parts = partition.partition(marks)
    done = materialise.materialise(gm, parts, f"<fxsplit {graph_id}>", grad_at_entry, marks.host)
    facts = _aliasing(gm, parts, done) if analyse else [None] * len(parts)
    names = {n.name: n for n in gm.graph.nodes}
    records = tuple(
        Piece(
            name=module.name,
            kind=part.kind,
            regions=part.regions(marks),
            reasons=part.reasons(marks),
            num_ops=part.num_ops(),
            nodes=tuple(n.name for n in part.nodes),
            inputs=module.input_names,
            outputs=module.output_names,
            devices=_devices(part.nodes, (names[n] for n in module.input_names)),
            random=any(op_facts.is_random(n) for n in part.nodes),
            unset=_unset(part.nodes, module.output_names),
            same_as=module.same_as if module.same_as != module.name else None,
            **({} if fact is None else fact.describe(module.input_names, module.output_names)),
        )
        for part, module, fact in zip(parts, done.pieces, facts, strict=True)
    )
    plan = SplitPlan(
        graph_id=graph_id,
        runner=runner,
        eager_regions=policy.eager_regions,
        pieces=records,
        num_nodes=len(gm.graph.nodes),
        split_seconds=time.perf_counter() - start,
    )
    pieces = tuple(
        SplitPiece(*each) for each in zip(records, parts, done.pieces, facts, strict=True)
    )
    return Split(plan, gm, marks, pieces, done.stitched, steps=steps)


def _unset(nodes, outputs: tuple[str, ...]) -> tuple[str, ...]:
    """The outputs a piece allocates (the ``empty`` family), or views of such memory
    (``torch.empty(n).view(4, -1)``), that none of its nodes may write, directly or through a
    view (``out.view(-1).copy_(y)``, ``torch.add(a, b, out=out)``): what they hold when it
    ends is unspecified."""
    inside = set(nodes)
    unset: set[str] = set()
    for node in nodes:
        if op_facts.is_allocation(node):
            aliases = _unwritten_aliases(node, inside)
            unset.update(n.name for n in aliases)
    return tuple(name for name in outputs if name in unset)


def _unwritten_aliases(allocation, inside) -> set:
    """``allocation`` and the nodes of ``inside`` viewing its memory (Dynamo's example values
    say which do; a node without one may alias it), or nothing where one of ``inside`` may
    write that memory."""
    storage = _storage(allocation)
    aliases = {allocation}
    todo = [allocation]
    while todo:
        for user in todo.pop().users:
            if user not in inside or user in aliases:
                continue
            if user.op == "call_module" or op_facts.may_write(user, dispatch=True):
                return set()
            if step_sizes.writes_when_run(user):
                return set()
            value = _storage(user)
            if value is None or value == storage:  # a view (or unknown): its users count too
                aliases.add(user)
                todo.append(user)
    return aliases


def _storage(node) -> int | None:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _devices(nodes, inputs) -> tuple[str, ...]:
    """Devices of the tensors a piece's nodes make and its inputs hold (Dynamo's example
    values)."""
    found = set()
    for node in (*nodes, *inputs):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            found.add(value.device)
    return tuple(sorted(map(str, found)))


def _aliasing(gm: GraphModule, parts, done) -> list[aliasing.PieceAliasing | None]:
    """The analysis of every captured piece, run once per distinct piece: the facts depend only
    on the code and on the inputs' sizes, strides, dtypes and devices."""
    nodes = {n.name: n for n in gm.graph.nodes}
    facts: dict[tuple, aliasing.PieceAliasing] = {}
    result: list[aliasing.PieceAliasing | None] = []
    for part, module in zip(parts, done.pieces, strict=True):
        if part.kind != partition.CAPTURED:
            result.append(None)
            continue
        examples = [_example(gm, nodes[name]) for name in module.input_names]
        key = (module.shared_code, *map(_layout, examples))
        fact = facts.get(key)
        if fact is None:
            fact = facts[key] = aliasing.analyse(module.forward, examples, len(module.output_names))
        result.append(fact)
    return result


def _layout(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (str(value.shape), str(value.stride()), value.dtype, value.device)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return type(value)
    return id(value)


def _example(gm: GraphModule, node: torch.fx.Node) -> object:
    """Dynamo's example value of ``node``; for a ``get_attr`` of a subgraph module (the
    branches of ``cond``, the body of ``wrap``), the module itself."""
    value = node.meta.get("example_value")
    if value is None and node.op == "get_attr":
        return materialise.fetch(gm, node.target)
    return value
