"""Unit tests of the split passes: ops, op facts, modules, normalise, mark, partition,
materialise."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from torch.fx import Graph, GraphModule

import fxsplit
from fxsplit.facts import op_facts
from fxsplit.facts.op_facts import unsafe
from fxsplit.facts.ops import OpMatcher, op_name, parse_op_name
from fxsplit.passes import normalise as normalise_pass
from fxsplit.passes import split
from fxsplit.passes.mark import Policy
from fxsplit.passes.modules import ModuleMatcher, module_path
from fxsplit.runners import Runner

# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op(
    "fxsplit_test_passes::unsafe_clone", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def unsafe_clone(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@unsafe_clone.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fxsplit_test_passes::two_out", mutates_args=())
def two_out(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x * 2


@two_out.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


# --------------------------------------------------------------------------- helpers


pytestmark = pytest.mark.usefixtures("fresh_capture_state")


class Spy:
    """Backend wrapping a fresh fxsplit.Backend; keeps the graphs it split (normalised in place)."""

    def __init__(self, **options):
        self.backend = fxsplit.Backend(**options)
        self.graphs: list[GraphModule] = []

    def __call__(self, gm, example_inputs, **kwargs):
        fn = self.backend(gm, example_inputs, **kwargs)
        self.graphs.append(gm)
        return fn

    @property
    def plan(self) -> fxsplit.SplitPlan:
        assert len(self.backend.plans) == 1, self.backend.plans
        return self.backend.plans[0]


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def assert_same(got, want):
    """Exact equality of (nested) outputs: tensors with torch.equal, the rest with ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), got
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.requires_grad == want.requires_grad
        assert torch.equal(got, want), (got, want)
    elif isinstance(want, tuple | list):
        assert type(got) is type(want) and len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert got == want and type(got) is type(want), (got, want)


def run(fn, *args, dynamic=False, **options):
    """Compile ``fn`` with fxsplit (fullgraph), call it on ``args``; check it equals eager."""
    spy = Spy(**options)
    compiled = torch.compile(fn, backend=spy, dynamic=dynamic, fullgraph=True)
    want = fn(*(_clone(a) for a in args))
    got = compiled(*args)
    assert_same(got, want)
    return spy, got


def kinds(plan) -> list[str]:
    return [p.kind for p in plan.pieces]


def nodes_by_name(gm: GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def make_node(target, op="call_function"):
    graph = Graph()
    x = graph.placeholder("x")
    return graph.create_node(op, target, (x,))


# --------------------------------------------------------------------------- ops.parse_op_name


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("aten::topk", ("aten", "topk", None)),
        ("aten::topk.default", ("aten", "topk", "default")),
        ("my_lib::attn_2.out", ("my_lib", "attn_2", "out")),
    ],
)
def test_parse_op_name_good(name, want):
    assert parse_op_name(name) == want


@pytest.mark.parametrize(
    "name",
    ["aten.topk", "aten:topk", "::topk", "aten::", "aten::top-k", "aten::a.b.c", " aten::topk", ""],
)
def test_parse_op_name_malformed_shows_expected_form(name):
    with pytest.raises(ValueError, match=r"expected 'namespace::op' or 'namespace::op\.overload'"):
        parse_op_name(name)


def test_parse_op_name_rejects_non_string():
    with pytest.raises(ValueError, match="malformed op name 3"):
        parse_op_name(3)


# --------------------------------------------------------------------------- ops.OpMatcher


def test_op_matcher_bare_name_matches_every_overload_and_packet():
    matcher = OpMatcher(["aten::add"])
    for target in (torch.ops.aten.add.Tensor, torch.ops.aten.add.Scalar, torch.ops.aten.add):
        assert matcher.match(make_node(target)) == "aten::add", target
    assert matcher.match(make_node(torch.ops.aten.sub.Tensor)) is None


def test_op_matcher_overload_name_matches_that_overload_and_packet_only():
    matcher = OpMatcher(["aten::add.Tensor"])
    assert matcher.match(make_node(torch.ops.aten.add.Tensor)) == "aten::add.Tensor"
    assert matcher.match(make_node(torch.ops.aten.add)) == "aten::add.Tensor"
    assert matcher.match(make_node(torch.ops.aten.add.Scalar)) is None


def test_op_matcher_matches_torch_function_and_tensor_method():
    matcher = OpMatcher(["aten::topk"])
    assert matcher.match(make_node(torch.topk)) == "aten::topk"
    assert matcher.match(make_node("topk", op="call_method")) == "aten::topk"
    assert matcher.match(make_node(torch.ops.aten.topk.default)) == "aten::topk"
    assert matcher.match(make_node(torch.sort)) is None
    assert matcher.match(make_node("sort", op="call_method")) is None


def test_op_matcher_records_used_names():
    matcher = OpMatcher(["aten::topk", "aten::sort"])
    assert matcher.names == ["aten::topk", "aten::sort"]
    matcher.match(make_node(torch.topk))
    assert matcher.used == {"aten::topk"}


def test_op_matcher_overload_agnostic_target_marks_every_configured_overload_used():
    matcher = OpMatcher(["aten::topk.default", "aten::topk.values"])
    assert matcher.match(make_node(torch.topk)) is not None
    assert matcher.used == {"aten::topk.default", "aten::topk.values"}


def test_op_matcher_rejects_malformed_name():
    with pytest.raises(ValueError, match="malformed op name 'topk'"):
        OpMatcher(["topk"])


def test_op_matcher_ignores_non_ops():
    matcher = OpMatcher(["aten::getitem"])
    assert matcher.match(make_node(operator.getitem)) is None


# --------------------------------------------------------------------------- op_facts.unsafe


@pytest.mark.parametrize(
    ("target", "op", "want"),
    [
        (torch.nonzero, "call_function", "aten::nonzero"),
        ("nonzero", "call_method", "aten::nonzero"),
        (torch.ops.aten.nonzero.default, "call_function", "aten::nonzero"),
        ("item", "call_method", "aten::item"),
        ("cpu", "call_method", "aten::cpu"),
        ("tolist", "call_method", "aten::tolist"),
    ],
)
def test_unsafe_data_dependent_and_host_reads(target, op, want):
    assert unsafe(make_node(target, op)) == want


def test_unsafe_custom_op_tagged_cudagraph_unsafe():
    assert unsafe(make_node(torch.ops.fxsplit_test_passes.unsafe_clone.default)) == (
        "fxsplit_test_passes::unsafe_clone"
    )
    assert unsafe(make_node(torch.ops.fxsplit_test_passes.unsafe_clone)) == (
        "fxsplit_test_passes::unsafe_clone"
    )


@pytest.mark.parametrize(
    ("target", "op"),
    [
        (torch.sin, "call_function"),
        (torch.ops.aten.add.Tensor, "call_function"),
        (torch.ops.fxsplit_test_passes.two_out.default, "call_function"),
        ("sin", "call_method"),
        (operator.getitem, "call_function"),
    ],
)
def test_unsafe_safe_ops(target, op):
    assert unsafe(make_node(target, op)) is None


# --------------------------------------------------------------------------- op_facts


def _tagged_overloads(*tags):
    for name in torch._C._dispatch_get_all_op_names():
        ns, _, rest = name.partition("::")
        packet_name, _, overload = rest.partition(".")
        try:
            op = getattr(getattr(getattr(torch.ops, ns), packet_name), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if any(t in op.tags for t in tags):
            yield op


def test_mark_pass_and_emulator_refuse_the_same_tagged_ops():
    """One source of truth: every overload whose tags refuse capture whatever its arguments is
    unsafe for the mark pass and refused by the emulator."""
    tagged = list(
        _tagged_overloads(
            torch.Tag.cudagraph_unsafe,
            torch.Tag.dynamic_output_shape,
            torch.Tag.data_dependent_output,
        )
    )
    assert len(tagged) >= 20
    argument_dependent = {
        torch.ops.aten.index.Tensor,
        torch.ops.aten.repeat_interleave.Tensor,
        torch.ops.aten.one_hot.default,
    }
    for op in tagged:
        if op in argument_dependent:
            assert unsafe(make_node(op)) is None, op
            continue
        assert unsafe(make_node(op)) is not None, op
        assert op_facts.capture_refusal(op, (), {}) is not None, op


@pytest.mark.parametrize(
    "op",
    [
        "slice",
        "unfold",
        "view_as_real",
        "split_with_sizes",
        "view",
        "t",
        "expand",
        "select",
        "unbind",
        "diagonal",
        "as_strided",
        "detach",
        "alias",
        "narrow",
        "movedim",
        "real",
    ],
)
def test_views_come_from_the_schemas_alias_info(op):
    assert op_facts.is_view(make_node(getattr(torch.ops.aten, op)))
    assert op_facts.is_view(make_node(op, "call_method"))


@torch.library.custom_op("fxsplit_test_passes::fill_into", mutates_args=("out",))
def _fill_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


class _Writes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = torch.nn.Buffer(torch.zeros(4, 8))
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, positions, out):
        self.cache.index_copy_(0, positions, x)  # in-place: self
        self.cache[positions] = x  # item assignment: the container
        torch.add(x, 1, out=out)  # out=
        torch.ops.fxsplit_test_passes.fill_into(x, out)  # mutates_args
        return x @ self.w.T + x.float() + x.exp()  # reads only (``w.T`` may stay a getattr)


def test_written_arguments_come_from_the_schemas_alias_info():
    written = {}

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            names = [a.name for a in op_facts.written_arguments(node)]
            if names:
                written[str(node.target)] = names
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_Writes(), backend=backend, fullgraph=True)(
        torch.randn(4, 8), torch.arange(4), torch.empty(4, 8)
    )
    cache = "l_self_buffers_cache_"
    assert written == {
        "index_copy_": [cache],
        str(operator.setitem): [cache],
        str(torch.add): ["l_out_"],
        "fxsplit_test_passes.fill_into": ["l_out_"],  # the packet Dynamo records
    }


@pytest.mark.parametrize("op", ["clone", "add", "zeros", "index", "add_"])
def test_kernels_are_not_views(op):
    assert not op_facts.is_view(make_node(op, "call_method"))


@pytest.mark.parametrize(
    ("target", "op", "writes"),
    [
        ("add_", "call_method", True),
        ("index_put_", "call_method", True),
        (operator.setitem, "call_function", True),
        (torch.ops.aten.add.out, "call_function", True),
        ("add", "call_method", False),
        (torch.arange, "call_function", False),
        (torch.ops.aten.zeros.default, "call_function", False),
        (operator.getitem, "call_function", True),  # no op the dispatcher knows: it may
    ],
)
def test_writes_come_from_the_schemas_out_forms_aside(target, op, writes):
    assert op_facts.may_write(make_node(target, op)) is writes


def test_a_call_handing_an_out_argument_is_never_pure():
    """``torch.add(x, y, out=buf)`` names no overload, and add's functional overloads write
    nothing: the ``out=`` argument alone says the call writes ``buf``."""
    graph = Graph()
    x, y, buf = graph.placeholder("x"), graph.placeholder("y"), graph.placeholder("buf")
    assert op_facts.is_pure(graph.call_function(torch.add, (x, y)))
    assert not op_facts.is_pure(graph.call_function(torch.add, (x, y), {"out": buf}))


def test_allocations_are_the_empty_family_and_fills_are_kernels():
    for op in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"):
        assert op_facts.is_allocation(make_node(getattr(torch.ops.aten, op))), op
    for op in ("zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros"):
        assert not op_facts.is_allocation(make_node(getattr(torch.ops.aten, op))), op
    assert torch.ops.aten.empty.memory_format in op_facts.ALLOCATIONS
    assert torch.ops.aten.zeros.default not in op_facts.ALLOCATIONS


def test_op_name_forms():
    assert op_name(make_node(torch.ops.aten.add.Tensor)) == "aten::add.Tensor"
    assert op_name(make_node(torch.ops.aten.topk.default)) == "aten::topk"
    assert op_name(make_node("topk", op="call_method")) == "aten::topk"
    assert op_name(make_node(operator.getitem)) is None


# --------------------------------------------------------------------------- modules


@pytest.mark.parametrize(
    ("dynamo", "want"),
    [
        ("L['self'].model.layers[0]._modules['attn']", "model.layers.0.attn"),
        ("L['self'].layers.3.proj", "layers.3.proj"),
        ('L["self"].layers["7"].mlp', "layers.7.mlp"),
        ("L['self'].layers[12]", "layers.12"),
        ("L['self']", ""),
        ("model.layers.0", "model.layers.0"),
    ],
)
def test_module_path_normalises(dynamo, want):
    assert module_path(dynamo) == want


def test_module_path_normalises_leading_modules_access():
    assert module_path("L['self']._modules['layers']._modules['3'].proj") == "layers.3.proj"


class FakeAttention:
    pass


class FakeLayer:
    pass


def module_node(*stack):
    node = make_node(torch.sin)
    node.meta["nn_module_stack"] = {f"k{i}": entry for i, entry in enumerate(stack)}
    return node


ATTN_NODE_STACK = (
    ("L['self'].model.layers[3]", FakeLayer),
    ("L['self'].model.layers[3].self_attn", FakeAttention),
)


@pytest.mark.parametrize(
    ("pattern", "hit"),
    [
        ("model.layers.*.self_attn", True),
        ("model.layers.3.self_attn", True),
        ("model.layers.*", True),  # the enclosing layer matches
        ("model.*.self_attn", False),  # '*' is exactly one component
        ("model.**.self_attn", True),
        ("**.self_attn", True),
        ("model.**", True),
        ("**", True),
        ("layers.*.self_attn", False),  # anchored at the root
        ("model.lay*.3.self_*", True),  # globs within one component
        ("model.layers.4.self_attn", False),
        ("model.layers.*.self_attn.**", True),  # '**' matches zero components
        ("FakeAttention", True),
        ("FakeLayer", True),
        ("Attention", False),
    ],
)
def test_module_matcher_globs_and_class_names(pattern, hit):
    matcher = ModuleMatcher([pattern])
    found = matcher.match(module_node(*ATTN_NODE_STACK))
    assert (found == [(pattern, pattern)]) is hit, found
    assert (pattern in matcher.used) is hit


def test_module_matcher_returns_region_values_and_ignores_nodes_without_stack():
    matcher = ModuleMatcher({"FakeAttention": "attention", "model.layers.*": "layer"})
    assert matcher.match(module_node(*ATTN_NODE_STACK)) == [
        ("model.layers.*", "layer"),
        ("FakeAttention", "attention"),
    ]
    assert matcher.match(make_node(torch.sin)) == []
    assert matcher.patterns == ["FakeAttention", "model.layers.*"]


# --------------------------------------------------------------------------- normalise (unit)


def _meta(node, value):
    node.meta["example_value"] = value
    return node


def test_normalise_copies_size_before_each_user():
    g = Graph()
    x = _meta(g.placeholder("x"), torch.empty(3, 4))
    size = _meta(g.call_method("size", (x,)), torch.Size([3, 4]))
    a = _meta(g.call_method("sin", (x,)), torch.empty(3, 4))
    v = _meta(g.call_method("view", (a, size)), torch.empty(3, 4))
    b = _meta(g.call_method("cos", (v,)), torch.empty(3, 4))
    r = _meta(g.call_method("reshape", (b, size)), torch.empty(3, 4))
    g.output(r)

    normalise_pass.normalise(g)

    order = list(g.nodes)
    assert size not in order
    sizes = [n for n in order if n.op == "call_method" and n.target == "size"]
    assert len(sizes) == 2
    for copy in sizes:
        assert list(copy.users) == [copy.next]
        assert copy.args == (x,)
    assert [n.next for n in sizes] == [v, r]
    g.lint()


def test_normalise_moves_multi_output_getitems_next_to_producer():
    g = Graph()
    x = _meta(g.placeholder("x"), torch.empty(3, 4))
    topk = _meta(g.call_function(torch.topk, (x, 2)), (torch.empty(3, 2), torch.empty(3, 2)))
    v = _meta(g.call_function(operator.getitem, (topk, 0)), torch.empty(3, 2))
    s = _meta(g.call_method("sin", (v,)), torch.empty(3, 2))
    i = _meta(g.call_function(operator.getitem, (topk, 1)), torch.empty(3, 2))
    out = _meta(g.call_function(operator.add, (s, i)), torch.empty(3, 2))
    g.output(out)

    normalise_pass.normalise(g)

    assert [n.name for n in g.nodes] == [
        "x",
        "topk",
        "getitem",
        "getitem_1",
        "sin",
        "add",
        "output",
    ]
    g.lint()


def test_split_keeps_late_getitem_with_eager_producer():
    """A getitem traced after an eager piece stays with its producer: no cycle, same output."""
    g = Graph()
    x = _meta(g.placeholder("x"), torch.empty(3, 4))
    topk = _meta(g.call_function(torch.topk, (x, 2)), (torch.empty(3, 2), torch.empty(3, 2)))
    v = _meta(g.call_function(operator.getitem, (topk, 0)), torch.empty(3, 2))
    s = _meta(g.call_method("sin", (v,)), torch.empty(3, 2))
    a = _meta(g.call_method("cos", (s,)), torch.empty(3, 2))
    a.meta["custom"] = {"fxsplit.region:attention": True}
    i = _meta(g.call_function(operator.getitem, (topk, 1)), torch.empty(3, 2))
    out = _meta(g.call_function(operator.add, (a, i)), torch.empty(3, 2))
    g.output(out)
    gm = GraphModule(torch.nn.Module(), g)
    x_in = torch.randn(3, 4)
    want = gm(x_in)

    runner = Runner("t", frozenset({"attention"}), persistent_inputs=False)
    result = split(gm, Policy.build(runner, ["aten::topk"]))

    plan = result.plan
    assert kinds(plan) == ["eager", "captured", "eager", "captured"]
    assert plan.pieces[0].nodes == ("topk", "getitem", "getitem_1")
    assert torch.equal(result.stitched(x_in), want)


# --------------------------------------------------------------------------- normalise (compiled)


def test_size_taken_in_eager_region_never_crosses_pieces():
    def f(x):
        with fxsplit.region("attention"):
            s = x.size()
            y = x.sin().reshape(s)
        z = y.cos().view(s)
        return z.reshape(s) * 2

    spy, _ = run(f, torch.randn(3, 4), dynamic=True)
    plan = spy.plan
    assert kinds(plan) == ["eager", "captured"]
    nodes = nodes_by_name(spy.graphs[0])
    crossing = {n for p in plan.pieces for n in (*p.inputs, *p.outputs)}
    assert crossing
    for name in crossing:
        assert not isinstance(nodes[name].meta.get("example_value"), torch.Size), name
    # each Size copy sits right before its only user
    sizes = [n for n in nodes.values() if isinstance(n.meta.get("example_value"), torch.Size)]
    assert len(sizes) >= 3
    for node in sizes:
        assert list(node.users) == [node.next]


def test_topk_getitems_stay_with_eager_producer():
    def f(x):
        v, i = torch.topk(x, 2)
        a = v.sin()
        with fxsplit.region("attention"):
            b = a * 2
        return b + i

    spy, _ = run(f, torch.randn(3, 4), splitting_ops=["aten::topk"])
    plan = spy.plan
    assert kinds(plan) == ["eager", "captured", "eager", "captured"]
    first = plan.pieces[0]
    assert first.reasons == ("op:aten::topk",)
    assert len(first.nodes) == 3 and len(first.outputs) == 2
    assert set(first.outputs) <= set(plan.pieces[1].inputs) | set(plan.pieces[3].inputs)


def test_custom_two_output_splitting_op_getitems_used_in_later_pieces():
    def f(x):
        out = torch.ops.fxsplit_test_passes.two_out(x)
        a = out[0].sin()
        with fxsplit.region("attention"):
            b = a * 2
        return b + out[1]

    spy, _ = run(f, torch.randn(3, 4), splitting_ops=["fxsplit_test_passes::two_out"])
    plan = spy.plan
    assert kinds(plan) == ["eager", "captured", "eager", "captured"]
    assert plan.pieces[0].reasons == ("op:fxsplit_test_passes::two_out",)
    assert plan.pieces[0].outputs[1] in plan.pieces[3].inputs


# --------------------------------------------------------------------------- mark


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).relu()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.mlp = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.mlp(self.attn(x) + x)


class TwoBlocks(torch.nn.Module):
    """Two Blocks (``layers.0``, ``layers.1``; each ``mlp(attn(x) + x)``, both Linear(4, 4)),
    each output halved; seeded weights, input ``[rows, 4]``, no region marked: the module
    names and class names that ``eager_modules`` and ``module_regions`` select."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * 0.5
        return x


class RegionNet(torch.nn.Module):
    """Parameters first used inside an eager region."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        with fxsplit.region("attention"):
            y = self.inner(x)
        return y.sin()


def test_placeholders_never_region_members():
    spy, _ = run(RegionNet(), torch.randn(2, 4))
    plan = spy.plan
    placeholders = {n.name for n in spy.graphs[0].graph.find_nodes(op="placeholder")}
    assert len(placeholders) == 3  # x, weight, bias: all lifted, all annotated by the region
    for piece in plan.pieces:
        assert not placeholders & set(piece.nodes), piece
    eager = plan.eager[0]
    assert placeholders <= set(eager.inputs)
    assert eager.num_ops == len(eager.nodes) == 1


def test_reason_region():
    def f(x):
        a = x + 1
        with fxsplit.region("sparse_indexer"):
            b = a.sin()
        return b * 2

    spy, _ = run(f, torch.randn(3))
    eager = spy.plan.eager
    assert len(eager) == 1
    assert eager[0].reasons == ("region:sparse_indexer",)
    assert eager[0].regions == frozenset({"sparse_indexer"})


def test_reason_op():
    def f(x):
        a = x + 1
        b = torch.sort(a).values
        return b * 2

    spy, _ = run(f, torch.randn(5), splitting_ops=["aten::sort"])
    assert [p.reasons for p in spy.plan.pieces] == [(), ("op:aten::sort",), ()]


def test_reason_unsafe_custom_op():
    def f(x):
        a = x + 1
        b = torch.ops.fxsplit_test_passes.unsafe_clone(a)
        return b * 2

    spy, _ = run(f, torch.randn(3))
    assert [p.reasons for p in spy.plan.pieces] == [
        (),
        ("unsafe:fxsplit_test_passes::unsafe_clone",),
        (),
    ]


def test_reason_unsafe_nonzero():
    def f(x):
        a = x * 2
        i = torch.nonzero(a > 0)
        return a.sum() + i.sum()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        spy, _ = run(f, torch.randn(6))
    assert [p.reasons for p in spy.plan.eager] == [("unsafe:aten::nonzero",)]


def test_reason_module_from_eager_modules():
    spy, _ = run(TwoBlocks(), torch.randn(2, 4), eager_modules=["layers.1.attn"])
    plan = spy.plan
    assert kinds(plan) == ["captured", "eager", "captured"]
    assert plan.eager[0].reasons == ("module:layers.1.attn",)


def test_module_regions_by_class_name_eager_region():
    spy, _ = run(TwoBlocks(), torch.randn(2, 4), module_regions={"Attn": "attention"})
    plan = spy.plan
    assert kinds(plan) == ["eager", "captured", "eager", "captured"]
    for piece in plan.eager:
        assert piece.reasons == ("module:Attn", "region:attention")
        assert piece.regions == frozenset({"attention"})


def test_module_regions_by_path_glob():
    spy, _ = run(TwoBlocks(), torch.randn(2, 4), module_regions={"layers.*.mlp": "attention"})
    plan = spy.plan
    assert kinds(plan) == ["captured", "eager", "captured", "eager", "captured"]
    assert {r for p in plan.eager for r in p.reasons} == {"module:layers.*.mlp", "region:attention"}


def test_module_regions_non_eager_region_is_recorded_but_captured():
    spy, _ = run(TwoBlocks(), torch.randn(2, 4), module_regions={"Attn": "my_region"})
    plan = spy.plan
    assert kinds(plan) == ["captured"]
    assert plan.pieces[0].regions == frozenset({"my_region"})


def test_unknown_region_name_is_captured():
    def f(x):
        a = x + 1
        with fxsplit.region("not_a_runner_region"):
            b = a.sin()
        return b * 2

    spy, _ = run(f, torch.randn(3))
    plan = spy.plan
    assert kinds(plan) == ["captured"]
    assert plan.pieces[0].regions == frozenset({"not_a_runner_region"})
    assert plan.pieces[0].reasons == ()


def test_eager_regions_option_overrides_runner():
    def f(x):
        a = x + 1
        with fxsplit.region("attention"):
            b = a.sin()
        c = b * 2
        with fxsplit.region("mine"):
            d = c.cos()
        return d - 1

    spy, _ = run(f, torch.randn(3), eager_regions=["mine"])
    plan = spy.plan
    assert plan.eager_regions == frozenset({"mine"})
    assert kinds(plan) == ["captured", "eager", "captured"]
    assert plan.eager[0].reasons == ("region:mine",)
    assert "attention" in plan.pieces[0].regions


def test_v2_captures_attn_prep():
    def f(x):
        with fxsplit.region("attn_prep"):
            a = x + 1
        with fxsplit.region("attention"):
            b = a.sin()
        return b * 2

    spy, _ = run(f, torch.randn(3), runner="v2")
    plan = spy.plan
    assert plan.runner == "v2"
    assert kinds(plan) == ["captured", "eager", "captured"]
    assert plan.pieces[0].regions == frozenset({"attn_prep"})


def test_nested_regions_fold_into_one_eager_piece():
    def f(x):
        a = x + 1
        with fxsplit.region("attention"):
            b = a.sin()
            with fxsplit.region("inner"):
                c = b.cos()
                with fxsplit.region("sparse_indexer"):
                    d = c * 3
            e = d.exp()
        return e * 2

    spy, _ = run(f, torch.randn(3))
    plan = spy.plan
    assert kinds(plan) == ["captured", "eager", "captured"]
    eager = plan.eager[0]
    assert eager.num_ops == 4
    assert eager.regions == frozenset({"attention", "inner", "sparse_indexer"})
    assert eager.reasons == ("region:attention", "region:sparse_indexer")


# --------------------------------------------------------------------------- partition


def test_adjacent_eager_regions_give_one_eager_piece():
    def f(x):
        a = x + 1
        with fxsplit.region("attn_prep"):
            b = a.sin()
        with fxsplit.region("attention"):
            c = b.cos()
        return c * 2

    spy, _ = run(f, torch.randn(3))
    plan = spy.plan
    assert kinds(plan) == ["captured", "eager", "captured"]
    assert all(p.nodes for p in plan.pieces)
    assert plan.eager[0].reasons == ("region:attention", "region:attn_prep")


def test_graph_starting_and_ending_in_eager_region_has_no_empty_piece():
    def f(x):
        with fxsplit.region("attention"):
            return x.sin().cos()

    spy, _ = run(f, torch.randn(3))
    assert kinds(spy.plan) == ["eager"]


def test_trivial_run_between_eager_regions_is_merged():
    def f(x):
        with fxsplit.region("attention"):
            b = x.sin()
        v = b.view(-1, 1).t()[:, 1:].unfold(1, 1, 1)
        z = torch.empty(3)
        n = x.shape[0] * 2
        with fxsplit.region("attn_prep"):
            c = v.cos() + z.fill_(1) + n
        return c + 1

    spy, _ = run(f, torch.randn(3), dynamic=True)
    plan = spy.plan
    assert kinds(plan) == ["eager", "captured"]
    assert plan.pieces[1].num_ops == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.zeros(3),
        lambda x: torch.ones_like(x),
        lambda x: x.new_full((3,), 2.0),
        lambda x: x.t().reshape(-1),  # reshape of a transposed tensor copies
        lambda x: x.to(torch.float64),
    ],
    ids=["zeros", "ones_like", "new_full", "reshape-copy", "to-dtype"],
)
def test_fill_and_copy_between_eager_regions_are_kernels_and_captured(make):
    def f(x):
        with fxsplit.region("attention"):
            b = x.sin()
        z = make(b)
        with fxsplit.region("attn_prep"):
            c = b.cos().sum() + z.sum()
        return c + 1

    spy, _ = run(f, torch.randn(3, 3))
    assert kinds(spy.plan) == ["eager", "captured", "eager", "captured"]


def test_leading_trivial_run_joins_eager_piece():
    def f(x):
        v = x.view(-1, 1)
        with fxsplit.region("attention"):
            b = v.sin()
        return b + 1

    spy, _ = run(f, torch.randn(3))
    assert kinds(spy.plan) == ["eager", "captured"]


def test_trivial_graph_without_eager_is_one_captured_piece():
    def f(x):
        return x.view(-1, 1).t()

    spy, _ = run(f, torch.randn(3))
    assert kinds(spy.plan) == ["captured"]


def test_grad_mode_switch_between_eager_regions_not_captured_alone():
    def f(x):
        a = x * 2
        with fxsplit.region("attention"):
            b = a.sin()
        with torch.no_grad(), fxsplit.region("attention"):
            c = b.cos()
        return c + 1

    spy, _ = run(f, torch.randn(3, requires_grad=True))
    assert kinds(spy.plan) == ["captured", "eager", "captured"]


def test_autocast_switch_between_eager_regions_not_captured_alone():
    def f(x):
        a = x * 2
        with fxsplit.region("attention"):
            b = a.sin()
        with torch.autocast("cpu", dtype=torch.bfloat16), fxsplit.region("attention"):
            c = b @ b.t()
        return c.float() + 1

    spy, _ = run(f, torch.randn(3, 3))
    assert kinds(spy.plan) == ["captured", "eager", "captured"]


def test_consecutive_splitting_ops_fold():
    def f(x):
        a = x + 1
        v, i = torch.topk(a, 3)
        s = torch.sort(v).values
        return s * 2 + i

    spy, _ = run(f, torch.randn(6), splitting_ops=["aten::topk", "aten::sort"])
    plan = spy.plan
    assert kinds(plan) == ["captured", "eager", "captured"]
    assert plan.eager[0].reasons == ("op:aten::sort", "op:aten::topk")


def test_splitting_op_as_tensor_method():
    def f(x):
        a = x + 1
        v = a.topk(2).values
        return v * 2

    spy, _ = run(f, torch.randn(6), splitting_ops=["aten::topk"])
    assert [p.reasons for p in spy.plan.pieces] == [(), ("op:aten::topk",), ()]


# --------------------------------------------------------------------------- materialise


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.eps = 0.25

    def forward(self, x):
        with fxsplit.region("attention"):
            y = x.sin()
        return y / (y.abs().sum() + self.eps)


def test_float_attribute_item_runs_before_pieces():
    """dynamic=True passes a float attribute as a 0-dim tensor and reads it with .item(): that
    reads host memory, so it is no unsafe op and runs in the stitched module before the pieces."""
    spy, _ = run(Scaled(), torch.randn(4), dynamic=True)
    plan = spy.plan
    assert kinds(plan) == ["eager", "captured"]
    assert all("unsafe" not in r for p in plan.pieces for r in p.reasons)
    items = [n for n in spy.graphs[0].graph.nodes if n.op == "call_method" and n.target == "item"]
    assert len(items) == 1
    assert items[0].name not in {name for p in plan.pieces for name in p.nodes}
    assert items[0].name in plan.pieces[1].inputs


def _writes_a_buffer_attention_reads(x, buf):
    buf.add_(1)
    a = x * 2
    with fxsplit.region("attention"):
        y = a + buf
    buf.mul_(2)
    return y + buf


@pytest.mark.parametrize(
    ("runner", "want_kinds"),
    [
        # every op on buf (a runner tensor the step writes, which attention reads) runs
        # eagerly (fxsplit.passes.cache_ops)
        ("v1", ["eager", "captured", "eager"]),
        ("v2", ["captured", "eager", "captured"]),
    ],
)
def test_inplace_buffer_mutations_keep_order_across_pieces(runner, want_kinds):
    x, buf = torch.randn(4), torch.randn(4)
    want_buf = buf.clone()
    want = _writes_a_buffer_attention_reads(x, want_buf)
    spy = Spy(runner=runner, input_binding="copy")
    got = torch.compile(_writes_a_buffer_attention_reads, backend=spy, fullgraph=True)(x, buf)
    assert kinds(spy.plan) == want_kinds
    assert torch.equal(got, want)
    assert torch.equal(buf, want_buf)


class _KvLayer(torch.nn.Module):
    """A decode layer: the new token's key written into a cache at ``pos``, repeated and read by
    attention. The cache is the caller's (``kv``, an argument) or the model's (``self.kv``)."""

    def __init__(self, own_cache: bool):
        super().__init__()
        self.k = torch.nn.Linear(4, 4)
        self.own = own_cache
        self.register_buffer("kv", torch.zeros(6, 4))

    def forward(self, x, pos, kv):
        kv = self.kv if self.own else kv
        kv.index_copy_(0, pos, self.k(x))
        keys = kv.unsqueeze(0).expand(2, 6, 4).reshape(12, 4)
        with fxsplit.region("attention"):
            att = (x @ keys.T).softmax(-1) @ keys
        return att * 2


@pytest.mark.parametrize(
    ("own_cache", "runner", "cache_work_eager"),
    [(False, "v1", True), (False, "v2", False), (True, "v1", False)],
    ids=["callers_cache_v1", "callers_cache_v2", "models_buffer_v1"],
)
def test_cache_work_runs_with_attention_where_the_runner_keeps_no_inputs(
    own_cache, runner, cache_work_eager
):
    """Under v1 a cache handed in that the step writes in place, and every op from it to the
    attention that reads it (the write, the view, repeat's expand and reshape), run eagerly
    with that attention: no captured piece copies the cache in and back. Under v2 (persistent
    inputs, bound by address), and for the model's own buffer, the cache work stays captured."""
    layer = _KvLayer(own_cache)
    x, pos = torch.randn(1, 4), torch.tensor([2])
    spy, _ = run(layer, x, pos, torch.zeros(6, 4), runner=runner, input_binding="copy")
    plan = spy.plan
    reasons = {r for p in plan.eager for r in p.reasons}
    assert ("cache:kv" in reasons) == cache_work_eager, plan.format()
    assert kinds(plan) == ["captured", "eager", "captured"]
    # attention's 4 ops, and the write, unsqueeze, expand and reshape of the cache with them
    assert [p.num_ops for p in plan.eager] == [8 if cache_work_eager else 4], plan.format()


def test_value_mutated_in_later_piece_is_shared():
    def f(x):
        a = x * 2
        with fxsplit.region("attention"):
            a.add_(1)
        return a * 3, a

    spy, _ = run(f, torch.randn(3))
    plan = spy.plan
    assert kinds(plan) == ["captured", "eager", "captured"]
    assert plan.pieces[0].outputs == ("a",)
    assert "a" in plan.pieces[1].inputs and "a" in plan.pieces[2].inputs


def test_mutation_only_graph_without_outputs():
    def f(x, buf):
        with fxsplit.region("attention"):
            buf.add_(x)

    x, buf = torch.randn(3), torch.randn(3)
    want = buf + x
    spy = Spy()
    assert torch.compile(f, backend=spy, fullgraph=True)(x, buf) is None
    assert torch.equal(buf, want)
    assert kinds(spy.plan) == ["eager"]
    assert spy.plan.pieces[0].outputs == ()


def test_piece_without_inputs():
    def f(x):
        z = torch.ones(3) * 2
        with fxsplit.region("attention"):
            y = x.sin()
        return y + z

    spy, _ = run(f, torch.randn(3))
    plan = spy.plan
    assert kinds(plan) == ["captured", "eager", "captured"]
    assert plan.pieces[0].inputs == ()


def test_graph_break_outside_regions_gives_one_plan_per_graph():
    def f(x):
        with fxsplit.region("attention"):
            a = x.sin()
        print("graph break")
        with fxsplit.region("attention"):
            b = a.cos()
        return b + 1

    spy = Spy()
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert torch.equal(torch.compile(f, backend=spy)(x), f(x))
    assert not [w for w in record if "fxsplit" in str(w.message)]
    plans = spy.backend.plans
    assert [p.graph_id for p in plans] == ["graph_0", "graph_1"]
    assert [kinds(p) for p in plans] == [["eager"], ["eager", "captured"]]


def test_symint_threaded_to_later_piece():
    def f(x):
        a = x.sin()
        n = x.shape[0] + 1
        with fxsplit.region("attention"):
            b = a * 2
        return b.sum(0) * n

    spy, _ = run(f, torch.randn(5, 2), dynamic=True)
    plan = spy.plan
    assert kinds(plan) == ["captured", "eager", "captured"]
    nodes = nodes_by_name(spy.graphs[0])
    sym = [
        name
        for name in plan.pieces[2].inputs
        if isinstance(nodes[name].meta.get("example_value"), torch.SymInt)
    ]
    assert sym and set(sym) <= set(plan.pieces[0].outputs)
    # and a second size works without recompiling the split
    x = torch.randn(7, 2)
    compiled = torch.compile(f, backend=spy, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(x), f(x))
    assert len(spy.backend.plans) == 1


def test_multiple_outputs_with_symint_int_and_none():
    def f(x):
        a = x.sin()
        n = x.shape[0] + 1
        with fxsplit.region("attention"):
            b = a * 2
        return b.sum() * n, n, None, 3, b, a

    _, got = run(f, torch.randn(5), dynamic=True)
    assert got[1:4] == (6, None, 3)


def test_graph_output_is_input_and_duplicate():
    def f(x, y):
        with fxsplit.region("attention"):
            a = x.sin()
        return a, y, a, x

    x, y = torch.randn(3), torch.randn(2)
    _, got = run(f, x, y)
    assert got[1] is y and got[3] is x  # the caller's own tensors, as eager returns them
    assert got[0] is got[2]


def _no_grad_around_a_region(x):
    """``x * 2``, then a no_grad block holding ``sin``, an attention region (``* 3``) and
    ``cos``, then ``+ x * 2``: a no_grad block that two piece boundaries cross (captured,
    eager, captured), the first and last pieces each starting or ending inside it."""
    a = x * 2
    with torch.no_grad():
        b = a.sin()
        with fxsplit.region("attention"):
            c = b * 3
        d = c.cos()
    return d + a


def test_no_grad_block_crossing_piece_boundary():
    """Grad mode is eager's across the pieces a no_grad block spans: the output requires grad
    and its gradient equals eager's, and grad mode is on again after the call."""
    x = torch.randn(3, requires_grad=True)
    spy, got = run(_no_grad_around_a_region, x)
    assert kinds(spy.plan) == ["captured", "eager", "captured"]
    assert torch.is_grad_enabled()
    want = _no_grad_around_a_region(x)
    assert got.requires_grad == want.requires_grad
    got.sum().backward()
    grad, x.grad = x.grad.clone(), None
    want.sum().backward()
    assert torch.equal(grad, x.grad)


def _state_after_each_piece(spy, *args):
    """Grad mode and CPU autocast state seen right after each piece of the call ``args``."""
    stitched = spy.backend.compiled[0].stitched
    seen = []
    hooks = [
        stitched.get_submodule(p.name).register_forward_hook(
            lambda *_: seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        )
        for p in spy.plan.pieces
    ]
    try:
        stitched(*args)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_pieces_restore_grad_mode_at_their_end():
    """A piece ending inside a no_grad block leaves grad mode as at graph entry (a replayed piece
    runs none of its Python, so the next piece must not rely on it)."""
    x = torch.randn(3, requires_grad=True)
    spy, _ = run(_no_grad_around_a_region, x)
    assert _state_after_each_piece(spy, x) == [(True, False)] * 3


def test_enable_grad_block_inside_no_grad_call():
    def f(x):
        a = x * 2
        with torch.enable_grad():
            with fxsplit.region("attention"):
                b = x.sin()
            c = b * 3
        return c + a, c

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        spy, got = run(f, x)
        assert not torch.is_grad_enabled()
    assert got[1].requires_grad and not got[0].requires_grad
    assert torch.is_grad_enabled()
    assert kinds(spy.plan) == ["captured", "eager", "captured"]


def test_autocast_block_crossing_piece_boundary():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ w
            with fxsplit.region("attention"):
                b = a @ w
            c = b @ w
        return c.float() + 1, a.dtype, b.dtype, c.dtype

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    spy, got = run(f, x, w)
    assert kinds(spy.plan) == ["captured", "eager", "captured"]
    assert got[1:] == (torch.bfloat16,) * 3
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before
    assert _state_after_each_piece(spy, x, w) == [(True, False)] * 3


def test_grad_mode_unchanged_after_calls():
    def f(x):
        with torch.no_grad():
            with fxsplit.region("attention"):
                a = x.sin()
            b = a + 1
        return b * x

    x = torch.randn(3, requires_grad=True)
    spy = Spy()
    compiled = torch.compile(f, backend=spy, fullgraph=True)
    for _ in range(2):
        assert torch.equal(compiled(x), f(x))
        assert torch.is_grad_enabled()
    with torch.no_grad():
        assert torch.equal(compiled(x), f(x))
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


def test_stitched_module_calls_pieces_in_order():
    def f(x):
        a = x + 1
        with fxsplit.region("attention"):
            b = a.sin()
        c = b * 2
        with fxsplit.region("attn_prep"):
            d = c.cos()
        return d - 1

    spy, _ = run(f, torch.randn(3))
    stitched = spy.backend.compiled[0].stitched
    assert isinstance(stitched, torch.fx.GraphModule)
    calls = [n for n in stitched.graph.nodes if n.op == "call_module"]
    names = [f"piece_{i}" for i in range(len(spy.plan.pieces))]
    assert [n.target for n in calls] == names == [p.name for p in spy.plan.pieces]
    assert len(names) == 5
    assert [type(stitched.get_submodule(n)).__name__ for n in names] == ["PieceModule"] * 5
    assert [stitched.get_submodule(n).kind for n in names] == kinds(spy.plan)
    assert all(
        n.op in ("placeholder", "call_module", "call_function", "output")
        for n in stitched.graph.nodes
    )


def test_plan_counts_every_node():
    def f(x):
        a = x + 1
        with fxsplit.region("attention"):
            b = a.sin()
        return b * 2

    spy, _ = run(f, torch.randn(3))
    plan = spy.plan
    graph = spy.graphs[0].graph
    assert plan.num_nodes == len(graph.nodes)
    computed = [n.name for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    assert [name for p in plan.pieces for name in p.nodes] == computed
