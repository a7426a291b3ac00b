"""Field failure cases of piecewise capture, each with the right behaviour asserted.

Each test reproduces a way piecewise CUDA-graph capture is known to go wrong in inference engines
and checks that fxsplit either gets it right or fails loudly. Capture runs in the CPU emulator
(``capture="emulate"``), which has CUDA-graph semantics: frozen addresses and host values,
outputs overwritten by the next replay. Tests of capture assert from the counters that the
pieces replayed.
"""

from __future__ import annotations

import logging
import operator
import sys
import warnings

import pytest
import torch

import fxsplit
from fxsplit import counters
from tests.nets import RegionMlp
from tests.replays import assert_replayed
from tests.warned import warned_at

MID = "field_mid"


pytestmark = pytest.mark.usefixtures("fresh_capture_state")


@torch.library.custom_op("fxsplit_field::fresh", mutates_args=())
def fresh(x: torch.Tensor) -> torch.Tensor:
    """An eager splitting op that returns a freshly allocated tensor every call."""
    return torch.cumsum(x, dim=-1) * 0.5


@fresh.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fxsplit_field::pair", mutates_args=())
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An eager splitting op with two outputs."""
    return x.cumsum(-1), x.flip(-1) * 3


@pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


def _compile(fn, dynamic=None, fullgraph=True, **options):
    backend = fxsplit.Backend(capture="emulate", **options)
    return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph), backend


def _data(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _same(expected, got) -> bool:
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    return len(expected) == len(got) and all(
        torch.equal(e, g) if isinstance(e, torch.Tensor) else e == g
        for e, g in zip(expected, got, strict=True)
    )


def _replays(backend, graph="graph_0") -> int:
    return sum(c.get("replays", 0) for keys in backend.stats[graph].values() for c in keys.values())


# ---------------------------------------------------------------------------------------------
# An eager split op returning a fresh tensor consumed by the next captured piece


def test_fresh_tensor_from_eager_split_op_feeds_captured_piece_across_steps():
    def f(x):
        h = x.sin() * 2
        g = torch.ops.fxsplit_field.fresh(h)  # a new tensor, new address, every step
        return g * h + g.sum(-1, keepdim=True)

    model, backend = _compile(f, dynamic=True, splitting_ops=["fxsplit_field::fresh"])
    assert [p.kind for p in backend.plans] == []
    batches = [3, 3, 3, 3, 5, 5, 5, 3, 5]
    with torch.no_grad():
        for step, b in enumerate(batches):
            x = _data((b, 4), step)
            assert torch.equal(model(x), f(x)), step
    assert [p.kind for p in backend.plans[0].pieces] == ["captured", "eager", "captured"]
    stats = backend.stats["graph_0"]["piece_2"]
    # every replay of the consuming piece copied the fresh tensor into its static buffer
    for key, c in stats.items():
        if key != "uncaptured":
            assert c.get("replays", 0) == 0 or c["input_copies"] >= c["replays"], (key, c)
    assert _replays(backend) >= 8


# ---------------------------------------------------------------------------------------------
# Dynamo recompiles after capture because global state changed


SCALE = 1.0  # a global flag Dynamo guards on


class AddsGlobalScale(RegionMlp):
    """:class:`tests.nets.RegionMlp` of width 4 around region MID, seeded weights, whose eager
    region adds the module global ``SCALE``: a value Dynamo guards on, so changing it
    recompiles."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(width=4, region=MID)

    def mid(self, h):
        return torch.relu(h) + SCALE


def test_grad_mode_flip_after_capture_recompiles_and_replays_no_stale_graph():
    net = AddsGlobalScale().requires_grad_(False)
    model, backend = _compile(net, eager_regions=[MID])
    xs = [_data((2, 4), i) for i in range(9)]
    with torch.no_grad():
        for x in xs[:3]:
            assert torch.equal(model(x), net(x))
    assert len(backend.plans) == 1 and _replays(backend, "graph_0") == 2
    first = counters.snapshot()
    for x in xs[3:6]:  # grad enabled: Dynamo's grad-mode guard fails, it recompiles
        assert torch.equal(model(x), net(x))
    assert [p.graph_id for p in backend.plans] == ["graph_0", "graph_1"]
    assert counters.snapshot()["graphs"] == first["graphs"] + 1 == 2
    # graph_0 was not replayed for the grad-enabled calls; graph_1 captured its own pieces
    assert _replays(backend, "graph_0") == 2 and _replays(backend, "graph_1") == 2
    with torch.no_grad():  # back: graph_0 replays again, still right
        for x in xs[6:]:
            assert torch.equal(model(x), net(x))
    assert _replays(backend, "graph_0") == 2 + 2 * 3 and len(backend.plans) == 2


def test_global_flag_change_after_capture_recompiles_and_replays_no_stale_graph(monkeypatch):
    net = AddsGlobalScale().requires_grad_(False)
    model, backend = _compile(net, eager_regions=[MID])
    with torch.no_grad():
        for step in range(8):
            monkeypatch.setattr(sys.modules[__name__], "SCALE", 1.0 if step < 4 else 3.0)
            x = _data((2, 4), step)
            assert torch.equal(model(x), net(x)), step
    assert len(backend.plans) == 2
    assert _replays(backend, "graph_0") == 2 * 2 and _replays(backend, "graph_1") == 2 * 2


# ---------------------------------------------------------------------------------------------
# Two adjacent eager regions with nothing between them


@pytest.mark.parametrize("between", ["nothing", "view", "reshape"])
def test_adjacent_eager_regions_make_no_empty_captured_piece(between):
    def f(x):
        h = x * 2
        with fxsplit.region(fxsplit.ATTN_PREP):
            a = h.cos()
        if between == "view":
            a = a.view(-1, 2).view(-1, 4)
        elif between == "reshape":
            a = a.reshape(h.size())
        with fxsplit.region(fxsplit.SPARSE_INDEXER):
            a = a.softmax(-1)
        with fxsplit.region(fxsplit.ATTENTION):
            a = a + h
        return a * 3

    model, backend = _compile(f, dynamic=True, runner="v1")
    with torch.no_grad():
        for step, b in enumerate([2, 2, 2, 3, 3]):
            x = _data((b, 4), step)
            assert torch.equal(model(x), f(x))
    plan = backend.plans[0]
    assert [p.kind for p in plan.pieces] == ["captured", "eager", "captured"]
    assert all(p.num_ops > 0 for p in plan.captured)
    assert plan.pieces[1].regions == {fxsplit.ATTN_PREP, fxsplit.SPARSE_INDEXER, fxsplit.ATTENTION}
    assert_replayed(backend)


# ---------------------------------------------------------------------------------------------
# A host-side Python branch on per-step metadata inside captured code

TOPK = 4


def indexer(scores, seq_len: int):
    """The sparse indexer's shortcut: a sequence no longer than top-k attends to every token."""
    if seq_len <= TOPK:
        sel = scores[:, :seq_len]
        idx = torch.arange(seq_len).expand(scores.shape[0], seq_len)
    else:
        sel, idx = scores[:, :seq_len].topk(TOPK, dim=-1)
    return (sel * 2).sum(-1) + idx.sum(-1).to(sel.dtype)


@pytest.mark.parametrize("dynamic", [None, True, False])
def test_python_branch_on_per_step_int_never_replays_a_stale_branch(dynamic):
    """The int is guarded by Dynamo (static) or part of the capture key (SymInt): the branch
    flips between steps and every step is right."""
    model, backend = _compile(indexer, dynamic=dynamic, eager_regions=[])
    lens = [3, 3, 3, 6, 6, 6, 2, 4, 5, 3, 6, 7, 7, 2, 3]
    with torch.no_grad():
        for step, seq_len in enumerate(lens):
            scores = _data((2, 8), step)
            assert torch.equal(model(scores, seq_len), indexer(scores, seq_len)), step
    # one graph per branch at least: the branch is a Dynamo guard, never baked into a replay
    assert len(backend.plans) >= 2
    assert counters.snapshot()["replays"] > 0


def test_python_branch_inside_an_eager_region_flips_correctly():
    def f(x, seq_len: int):
        h = x.sin()
        with fxsplit.region(fxsplit.SPARSE_INDEXER):
            h = indexer(h, seq_len)
        return h * 2

    model, backend = _compile(f, dynamic=True, runner="v1")
    with torch.no_grad():
        for step, seq_len in enumerate([3, 3, 3, 6, 6, 6, 4, 5, 2]):
            x = _data((2, 8), step)
            assert torch.equal(model(x, seq_len), f(x, seq_len)), step
    assert all(fxsplit.SPARSE_INDEXER in p.regions for plan in backend.plans for p in plan.eager)
    assert_replayed(backend)


def test_branch_on_a_tensor_value_graph_breaks_and_stays_correct():
    """A branch on device data (``seq_lens.max() <= topk``) cannot be captured: Dynamo breaks the
    graph there and evaluates the branch in Python every step."""

    def f(x, seq_lens):
        h = x * 2
        if seq_lens.max() <= TOPK:  # noqa: SIM108 - the branch on device data is the point
            h = h + 1
        else:
            h = h.topk(2, dim=-1).values.sum(-1, keepdim=True) + h
        return h.cos()

    model, backend = _compile(f, fullgraph=False, eager_regions=[])
    with torch.no_grad():
        for step in range(10):
            seq_lens = torch.tensor([2, 3 + 2 * (step % 3)])
            x = _data((2, 4), step)
            assert torch.equal(model(x, seq_lens), f(x, seq_lens)), step
    assert len(backend.plans) >= 2
    assert_replayed(backend)


# ---------------------------------------------------------------------------------------------
# Capture sizes that are unreachable, duplicated, zero or negative


@pytest.mark.parametrize(
    ("sizes", "error", "match"),
    [
        ([4, 4], ValueError, "capture_sizes holds 4 twice"),
        ([0], ValueError, "capture_sizes holds 0; every entry must be a positive int"),
        ([8, -2], ValueError, "capture_sizes holds -2; every entry must be a positive int"),
        ([2.0], TypeError, "capture_sizes holds 2.0; every entry must be an int"),
        ([True], TypeError, "capture_sizes holds True"),
        ("8", TypeError, "capture_sizes='8' has type str"),
        (8, TypeError, "capture_sizes=8 has type int"),
    ],
)
def test_bad_capture_sizes_raise_naming_them(sizes, error, match):
    with pytest.raises(error, match=match):
        fxsplit.Backend(capture="emulate", capture_sizes=sizes)


def test_size_outside_capture_sizes_is_logged_and_runs_uncaptured(caplog):
    model, _ = _compile(lambda x: x.sin() * 2, dynamic=True, capture_sizes=[2, 8], eager_regions=[])
    with caplog.at_level(logging.INFO, logger="fxsplit"), torch.no_grad():
        for step in range(4):
            x = _data((4, 3), step)
            assert torch.equal(model(x), x.sin() * 2)
    assert "size 4 is not a capture size" in caplog.text
    assert counters.snapshot()["captures"] == 0


def test_capture_sizes_the_graph_can_never_reach_warn_naming_them():
    model, _ = _compile(
        lambda x: x.sin() * 2, dynamic=False, capture_sizes=[8, 2], eager_regions=[]
    )
    with pytest.warns(fxsplit.FxsplitWarning, match="capture_sizes") as caught, torch.no_grad():
        for step in range(4):
            model(_data((4, 3), step))
    # once per graph, not per call, at the call that compiled it
    assert warned_at(caught) == [("test_field_cases.py", "model(_data((4, 3), step))")]
    message = str(caught[0].message)
    assert "fixed at 4" in message and "capture_sizes=[2, 8]" in message
    assert counters.snapshot()["captures"] == 0


def test_dynamic_graph_with_reachable_capture_sizes_does_not_warn():
    model, _ = _compile(lambda x: x.sin() * 2, dynamic=True, capture_sizes=[2, 8], eager_regions=[])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for step in range(3):
            model(_data((8, 3), step))
    assert not warned_at(caught)
    assert counters.snapshot()["captures"] == 1


def test_empty_capture_sizes_is_rejected():
    with pytest.raises(ValueError, match=r"capture_sizes=\[\] would capture nothing"):
        fxsplit.Backend(capture="emulate", capture_sizes=[])


# ---------------------------------------------------------------------------------------------
# A torch.Size produced on one side of a boundary and used on the other


def _size_inputs(backend) -> list[str]:
    """Piece inputs or outputs whose traced value is a torch.Size (must be none)."""
    split = backend.compiled[0]
    nodes = {n.name: n for n in split.graph_module.graph.nodes}
    names = [name for p in split.plan.pieces for name in (*p.inputs, *p.outputs) if name in nodes]
    return [n for n in names if isinstance(nodes[n].meta.get("example_value"), torch.Size)]


@pytest.mark.parametrize("made_in", ["eager", "captured"])
def test_torch_size_crossing_a_boundary(made_in):
    def f(x, y):
        if made_in == "eager":
            with fxsplit.region(MID):
                s = x.size()
                h = x.cos()
            out = y.reshape(s) * 2 + h.new_ones(s) + s[0]
        else:
            s = x.size()
            h = x.cos() * s[0]
            with fxsplit.region(MID):
                out = torch.zeros(s) + y.reshape(s) + h.expand(s)
        return out.sum(-1)

    model, backend = _compile(f, dynamic=True, eager_regions=[MID])
    with torch.no_grad():
        for step, b in enumerate([2, 2, 2, 3, 3, 3, 5, 2]):
            x, y = _data((b, 4), step), _data((b * 4,), 100 + step)
            assert torch.equal(model(x, y), f(x, y)), step
    assert len(backend.plans[0].pieces) >= 2
    assert _size_inputs(backend) == []
    assert counters.snapshot()["replays"] > 0


# ---------------------------------------------------------------------------------------------
# A splitting op with several outputs whose getitems are used in later pieces


@pytest.mark.parametrize("op", ["fxsplit_field::pair", "aten::topk", "aten::split"])
def test_multi_output_splitting_op_getitems_used_in_later_pieces(op):
    def f(x):
        h = x.sin()
        if op == "fxsplit_field::pair":
            a, b = torch.ops.fxsplit_field.pair(h)
        elif op == "aten::topk":
            a, b = h.topk(4, dim=-1)
            b = b.float()
        else:
            a, b = h.split(2, dim=-1)
            a, b = a.repeat(1, 2), b.repeat(1, 2)
        c = a * 2  # captured piece after the op
        with fxsplit.region(MID):
            d = c.cos()  # an eager piece in between
        return d + b  # a later captured piece reads the op's second output

    model, backend = _compile(f, dynamic=True, splitting_ops=[op], eager_regions=[MID])
    with torch.no_grad():
        for step, n in enumerate([2, 2, 2, 3, 3, 3, 2]):
            x = _data((n, 4), step)
            assert torch.equal(model(x), f(x)), step
    plan = backend.plans[0]
    assert [p.kind for p in plan.pieces] == ["captured", "eager", "captured", "eager", "captured"]
    # every getitem sits in its producer's piece (so no piece reads a later piece: no cycle)
    split = backend.compiled[0]
    owner = {name: i for i, p in enumerate(plan.pieces) for name in p.nodes}
    for node in split.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            assert owner[node.name] == owner[node.args[0].name], node
    for i, piece in enumerate(plan.pieces):
        assert all(owner.get(name, -1) < i for name in piece.inputs), piece
    assert counters.snapshot()["replays"] > 0


# ---------------------------------------------------------------------------------------------
# Two compiled models in one process, then torch._dynamo.reset()


def test_two_backends_share_no_graphs_pools_or_stats_and_reset_clears_both():
    net_a, net_b = AddsGlobalScale().requires_grad_(False), AddsGlobalScale().requires_grad_(False)
    with torch.no_grad():
        net_b.a.weight.mul_(-1)
    model_a, backend_a = _compile(net_a, eager_regions=[MID])
    model_b, backend_b = _compile(net_b, eager_regions=[MID])
    with torch.no_grad():
        for step in range(4):
            x = _data((2, 4), step)
            assert torch.equal(model_a(x), net_a(x))
        for step in range(6):
            x = _data((3, 4), step)
            assert torch.equal(model_b(x), net_b(x))
    # separate plans, runtimes, captured graphs, static buffers and stats
    assert (
        [p.graph_id for p in backend_a.plans]
        == ["graph_0"]
        == [p.graph_id for p in backend_b.plans]
    )
    rt_a, rt_b = backend_a.runtimes[0], backend_b.runtimes[0]
    graphs_a = {id(e.graph) for p in rt_a.pieces for e in p.entries.values()}
    graphs_b = {id(e.graph) for p in rt_b.pieces for e in p.entries.values()}
    assert graphs_a and graphs_b and not graphs_a & graphs_b
    assert not {t.data_ptr() for t in rt_a.context.static_outputs.values()} & {
        t.data_ptr() for t in rt_b.context.static_outputs.values()
    }
    assert backend_a._session.pools is not backend_b._session.pools
    assert rt_a.session is not rt_b.session
    assert _replays(backend_a) == 2 * 2 and _replays(backend_b) == 2 * 4
    assert counters.snapshot()["replays"] == 2 * 2 + 2 * 4  # the process-wide sum
    assert fxsplit.plans() == []  # the string backend saw nothing

    torch._dynamo.reset()
    for backend in (backend_a, backend_b):
        assert backend.plans == [] and backend.runtimes == [] and backend.stats == {}
        assert backend._session.pools == {}
    assert all(not p.entries for rt in (rt_a, rt_b) for p in rt.pieces)
    # recompiling starts from scratch: graph_0 again, warm-up and capture again, no replay of
    # anything captured before the reset
    counters.reset()
    with torch.no_grad():
        for step in range(3):
            x = _data((2, 4), step)
            assert torch.equal(model_a(x), net_a(x))
    assert [p.graph_id for p in backend_a.plans] == ["graph_0"] and backend_b.plans == []
    snap = counters.snapshot()
    assert snap["graphs"] == 1 and snap["captures"] == 2 and snap["replays"] == 2


# ---------------------------------------------------------------------------------------------
# The output of a replay held by the caller across the next step


def test_clone_outputs_keeps_the_held_output():
    net = AddsGlobalScale().requires_grad_(False)
    model, _ = _compile(net, eager_regions=[MID], clone_outputs=True)
    with torch.no_grad():
        model(_data((2, 4), 0))
        held = model(_data((2, 4), 1))
        new = model(_data((2, 4), 2))
    assert counters.snapshot()["replays"] == 2  # two captured pieces, replayed on the 3rd call
    assert new.data_ptr() != held.data_ptr()
    assert torch.equal(held, net(_data((2, 4), 1)))
    assert torch.equal(new, net(_data((2, 4), 2)))


def test_held_output_handed_back_as_next_input_is_read_before_it_is_overwritten():
    """Where fxsplit can see the read (the held output comes back as an input), it copies it
    first, and verify mode agrees. A read by the caller itself after the next step happens outside
    fxsplit: no hook on tensor reads exists, so neither verify nor anything else can detect it."""

    def f(x, prev):
        a = x * 2
        with fxsplit.region(MID):
            b = prev.cos()
        return a + b

    model, _ = _compile(f, eager_regions=[MID], verify=True)
    prev_e = prev_c = torch.zeros(3)
    with torch.no_grad():
        for step in range(6):
            x = _data((3,), step)
            prev_e, prev_c = f(x, prev_e), model(x, prev_c)
            assert torch.equal(prev_c, prev_e), step
    assert counters.snapshot()["replays"] > 0


_INNER = {}


@torch.library.custom_op("fxsplit_field::inner", mutates_args=())
def _inner(x: torch.Tensor, calls: int) -> torch.Tensor:
    """An eager splitting op that runs another compiled model (``_INNER["fn"]``) ``calls``
    times."""
    for _ in range(calls):
        x = _INNER["fn"](x).clone()
    return x


@_inner.register_fake
def _(x, calls):
    return torch.empty_like(x)


class _Inner(torch.nn.Module):
    def forward(self, x):
        y = (x * 2).sin()
        return ((y * 3).cos() + y).tanh() + 1


class _Outer(torch.nn.Module):
    """Linear and sin, the inner model through ``fxsplit_field::inner``, Linear: the first
    piece's outputs are live while the inner model runs."""

    def __init__(self, calls):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.calls = calls
        self.requires_grad_(False)

    def forward(self, x):
        h = self.a(x).sin()
        u = (h * 1.5).exp()
        return self.b(h) + torch.ops.fxsplit_field.inner(u, self.calls) + u


@pytest.mark.filterwarnings("ignore:fxsplit. splitting_ops pattern:fxsplit.FxsplitWarning")
@pytest.mark.parametrize("calls", [1, 2])
def test_a_model_called_inside_another_models_eager_piece_on_one_backend_keeps_capture_order(
    calls,
):
    """Found by a hunt: the inner model, captured first (lower capture order), called inside
    the outer model's eager piece on the same backend, started a new step, so its replay went
    out of capture order over the outer first piece's live outputs (wrong by 2.1, no warning).
    A call inside another is part of its step."""
    backend = fxsplit.Backend(
        capture="emulate", splitting_ops=["fxsplit_field::inner"], eager_regions=[]
    )
    inner = torch.compile(_Inner(), backend=backend)
    outer = torch.compile(_Outer(calls), backend=backend)
    with torch.no_grad():
        _INNER["fn"] = inner
        for step in range(3):  # the inner model captures first
            torch.ops.fxsplit_field.inner(_data((8, 16), step), 1)
        eager = _Outer(calls)
        for step in range(6):
            x = _data((8, 16), 10 + step)
            _INNER["fn"] = _Inner()
            want = eager(x)
            _INNER["fn"] = inner
            assert torch.equal(outer(x), want), step
    assert_replayed(backend)


class _Relayouts(torch.nn.Module):
    """A captured piece's output ``h`` (square, not symmetric), its layout changed in place
    (``h.t_()``) inside the ATTENTION region or outside any, then read by a captured piece."""

    def __init__(self, in_region: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.in_region = in_region
        self.requires_grad_(False)

    def forward(self, x):
        h = self.a(x).relu() + torch.arange(8)
        with fxsplit.region(fxsplit.ATTENTION):
            g = h.softmax(-1)
            if self.in_region:
                h.t_()
        if not self.in_region:
            h.t_()
        return self.b(h) + g


@pytest.mark.parametrize("in_region", [True, False], ids=["in_eager_region", "outside"])
def test_a_captured_output_whose_layout_an_op_changes_in_place_reads_as_in_eager(in_region):
    """Found by a hunt: the layout change reached only the alias an eager piece was lent (in a
    region), or flipped the captured graph's own output object at every step (outside): wrong
    by 4.8, no warning. An in-place layout change runs eagerly (a replay runs kernels, never a
    size or stride change), and later pieces read what it returned."""
    eager = _Relayouts(in_region)
    model, backend = _compile(_Relayouts(in_region))
    with torch.no_grad():
        for step in range(6):
            x = _data((8, 8), step)
            assert torch.equal(model(x), eager(x)), step
    assert_replayed(backend)


class _RelayoutsAView(torch.nn.Module):
    def forward(self, x):
        a = x.expand_as(x)  # a view of the caller's tensor, in its layout
        torch._dynamo.graph_break()
        a.as_strided_((a.shape[0], 4), (1, a.shape[0]))
        return a.relu()


def test_a_returned_view_in_its_inputs_layout_is_a_tensor_of_its_own():
    """Found by the long profile: a captured output that views an input in the input's own
    layout was rebuilt as the caller's tensor itself, so an in-place layout change of it after
    a graph break changed the caller's tensor too (and the output read it the other way)."""
    model, backend = _compile(_RelayoutsAView(), fullgraph=False, warmup_runs=0, eager_regions=[])
    with torch.no_grad():
        for step in range(4):
            x, xe = _data((4, 4), step), _data((4, 4), step)
            assert torch.equal(model(x), _RelayoutsAView()(xe)), step
            assert x.stride() == xe.stride() == (4, 1), step
    assert_replayed(backend)


# ---------------------------------------------------------------------------------------------
# A caller's staging tensor refilled where the version counter does not see it


@pytest.mark.parametrize("refill", ["numpy", "data"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_staging_tensor_refilled_through_numpy_or_data_is_copied_again(refill, mode):
    """Found by a hunt: an engine keeps one CPU staging tensor and refills it every step through
    NumPy (``buf.numpy()[:] = ...``) or ``buf.data.copy_``; neither bumps ``buf``'s version
    counter. fxsplit took "same tensor, same address, same version" for "unchanged since the last
    copy" and replayed the previous step's input from step 2 on (wrong by 0.07, no warning). A
    buffer's copy now counts only within the call that made it."""
    torch.manual_seed(0)
    eager = RegionMlp(16)
    torch.manual_seed(0)
    model, backend = _compile(RegionMlp(16), eager_regions=[eager.region])
    buf = torch.zeros(8, 16)
    with mode():
        for step in range(6):
            new = _data((8, 16), step)
            if refill == "numpy":
                buf.numpy()[:] = new.numpy()
            else:
                buf.data.copy_(new)
            assert torch.equal(model(buf), eager(buf)), step
    assert_replayed(backend, at_least=3)


_STAGE = torch.zeros(4, 6)  # an engine's staging tensor, which an eager op refills


@torch.library.custom_op("fxsplit_field::refill_stage", mutates_args=())
def _refill_stage(h: torch.Tensor, how: str) -> torch.Tensor:
    if how == "numpy":
        _STAGE.numpy()[:] = (h * 3).numpy()
    else:
        _STAGE.data.copy_(h * 3)
    return h.clone()


@_refill_stage.register_fake
def _(h, how):
    return torch.empty_like(h)


@torch.library.custom_op("fxsplit_field::write_into", mutates_args=("buf",))
def _write_into(buf: torch.Tensor, h: torch.Tensor) -> None:
    buf.copy_(h * 3)


@_write_into.register_fake
def _(buf, h):
    return None


class _ReadsAcrossAnEagerWrite(torch.nn.Module):
    """Two captured pieces read ``b``; the eager op between them writes its memory (the global
    staging tensor, unseen by its version counter, or ``a``, another tensor over ``b``'s
    memory with a version counter of its own), or the first piece writes ``a`` itself."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.l, self.m = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x, a, b):
        if self.how in ("numpy", "data"):
            h = self.l(x) + _STAGE
            h = torch.ops.fxsplit_field.refill_stage(h, self.how)
            return self.m(h) + _STAGE
        h = self.l(x) + b
        if self.how.startswith("captured"):
            a.add_(h)  # the captured piece writes a, copied back after its replay
            with fxsplit.region(fxsplit.ATTENTION):
                h = h.sin()
        else:
            torch.ops.fxsplit_field.write_into(a, h)
        return self.m(h) + b


def _over_the_same_memory(a: torch.Tensor, how: str) -> torch.Tensor:
    if how.endswith("from_numpy"):
        return torch.from_numpy(a.numpy())
    return torch.empty(0).set_(a.untyped_storage(), 0, a.shape, a.stride())


@pytest.mark.parametrize("how", ["numpy", "data", "from_numpy", "set_", "captured_set_"])
def test_a_piece_after_an_eager_op_that_wrote_an_input_unseen_copies_it_again(how):
    """Found by a hunt: a caller's tensor two captured pieces read was copied once a call, and
    the second piece skipped the copy while the tensor was the same object at the same address
    with the same version. The eager op between them wrote its memory where its version counter
    does not see it: a global staging tensor refilled through NumPy or ``.data``, or ``a``, a
    tensor over ``b``'s memory with a counter of its own (``torch.from_numpy(a.numpy())``, a
    storage ``set_``). The second piece replayed the old values (wrong by 8.6, no warning). A
    copy now counts only until an eager piece that may write or an uncaptured run; a captured
    piece's write-back of ``a`` forgets the copies of every tensor over its memory."""
    op = "refill_stage" if how in ("numpy", "data") else "write_into"
    ops = [] if how.startswith("captured") else [f"fxsplit_field::{op}"]
    model, backend = _compile(_ReadsAcrossAnEagerWrite(how), fullgraph=False, splitting_ops=ops)
    eager = _ReadsAcrossAnEagerWrite(how)
    a_c, a_e = torch.zeros(4, 6), torch.zeros(4, 6)
    b_c, b_e = _over_the_same_memory(a_c, how), _over_the_same_memory(a_e, how)
    with torch.no_grad():
        for step in range(6):
            x, stage = _data((4, 6), step), _data((4, 6), 100 + step)
            _STAGE.copy_(stage)
            a_c.copy_(stage)
            got = model(x, a_c, b_c)
            _STAGE.copy_(stage)
            a_e.copy_(stage)
            assert torch.equal(got, eager(x, a_e, b_e)), step
            assert torch.equal(a_c, a_e), step
    assert_replayed(backend, at_least=3)


def test_a_cache_the_model_writes_and_the_caller_refills_through_numpy_is_read():
    """Found by a second hunt: a cache handed in every call, written in place by a captured
    piece (``index_copy_``), which the caller also refills through NumPy between calls. Trusting
    its version counter across calls replayed the old values (wrong by 41, no warning)."""

    def f(x, cache):
        cache.index_copy_(0, torch.tensor([0]), x[:1])
        h = cache.sum(0) * 2.0
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        return h + x

    model, backend = _compile(f, dynamic=False)
    cache_c, cache_e = torch.zeros(4, 8), torch.zeros(4, 8)
    with torch.no_grad():
        for step in range(6):
            x = _data((2, 8), step)
            for cache in (cache_c, cache_e):
                cache.numpy()[:] = step + 1.0
            assert torch.equal(model(x, cache_c), f(x, cache_e)), step
            assert torch.equal(cache_c, cache_e), step
    assert_replayed(backend, at_least=3)


# ---------------------------------------------------------------------------------------------
# A custom op inside a captured piece reading a Python value outside its arguments


class _Scaler:
    """What an engine's op may read outside its arguments: a float attribute it changes."""

    scale = 1.0


@torch.library.custom_op("fxsplit_field::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    """Multiplies by ``_Scaler.scale``, read in the kernel, not passed as an argument."""
    return x * _Scaler.scale


@scaled.register_fake
def _(x):
    return torch.empty_like(x)


class _ScaledMlp(RegionMlp):
    def forward(self, x):
        h = torch.ops.fxsplit_field.scaled(self.a(x))
        with fxsplit.region(self.region):
            h = self.mid(h)
        return self.b(h)


def test_a_python_value_a_custom_op_reads_that_changes_after_capture_is_loud():
    """Found by a hunt: the scale changes 1.0 -> 2.0 after capture. A CUDA graph replays 1.0
    silently; the emulator re-called the kernel and followed the change, so the CPU passed
    where the GPU is stale. The replay now raises naming the op, both values and the fix."""
    torch.manual_seed(0)
    model, _ = _compile(_ScaledMlp(16, MID), eager_regions=[MID])
    _Scaler.scale = 1.0
    try:
        with torch.no_grad():
            for step in range(3):
                model(_data((2, 16), step))
            assert counters.snapshot()["replays"] > 0
            _Scaler.scale = 2.0
            with pytest.raises(fxsplit.HostValueChangedError, match=r"scaled.*splitting_ops"):
                model(_data((2, 16), 3))
    finally:
        _Scaler.scale = 1.0
