"""The capture runtime on CPU with the capture emulator (``capture="emulate"``).

Covers the field's runner-v1 bug and its fix on the DeepSeek-V4 model, counters, input binding,
capture-failure fallback, output lifetime, grad mode, reset, ``Backend.capture`` and
``capture="cuda"`` without a device, plus adversarial small graphs (in-place ops on inputs, views,
aliasing outputs, SymInt / float / None / int values). Every test of a capture feature asserts
from the counters (``fxsplit.counters``, ``Backend.stats``) that its pieces captured and
replayed, or that they ran uncaptured where that is the point.

Speed: ``gc.collect`` is stubbed out (counted) in every test. The capture session collects
garbage before capturing, which costs ~0.3 s per call with torch loaded and changes nothing an
emulated capture computes; tests that care about memory call the real collector.
"""

from __future__ import annotations

import gc
import logging
import re
import warnings
import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import fxsplit
from fxsplit import counters
from fxsplit.models import deepseek_v4 as ds
from fxsplit.runtime.emulation.emulator import CaptureError
from fxsplit.runtime.inputs.binding import RUNNER, BindingError
from fxsplit.runtime.memory import provenance
from fxsplit.runtime.piece.verify import VerifyError
from tests.nets import RegionMlp
from tests.replays import assert_replayed
from tests.versions import needs_swap
from tests.warned import warned_at

_real_collect = gc.collect

METADATA = ("positions", "slot_mapping", "block_table", "seq_lens")
# The field's bug: attention input preparation left inside a captured piece.
PREP_CAPTURED = {"eager_regions": [fxsplit.SPARSE_INDEXER, fxsplit.ATTENTION]}
CFG = ds.DeepseekV4Config()
MID = "eager_mid"
COUNTED = (
    "graphs",
    "pieces",
    "captured_pieces",
    "eager_pieces",
    "captures",
    "replays",
    "uncaptured_runs",
    "recaptures",
)


@pytest.fixture(autouse=True)
def gc_calls(fresh_capture_state, monkeypatch):
    """conftest's ``fresh_capture_state`` (Dynamo and counters reset, ``gc.collect`` stubbed),
    with a ``gc.collect`` stub in its place that counts: the fixture value lists the calls."""
    calls = []

    def collect(generation=2):
        calls.append(generation)
        return 0

    monkeypatch.setattr(gc, "collect", collect)
    return calls


# ---------------------------------------------------------------------------------------------
# Helpers


def _backend(**options) -> fxsplit.Backend:
    # The tests' models mark no region but MID, which they name in eager_regions when they do.
    options.setdefault("eager_regions", [])
    return fxsplit.Backend(capture="emulate", **options)


def _compile(fn, dynamic=None, **options):
    backend = _backend(**options)
    return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True), backend


def _piece_totals(backend: fxsplit.Backend, graph: str = "graph_0") -> dict[str, Counter]:
    """``{piece: counters summed over every capture key}`` of one graph."""
    return {
        piece: sum((Counter(c) for c in keys.values()), Counter())
        for piece, keys in backend.stats[graph].items()
    }


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _net(seed: int = 0, grad: bool = False) -> RegionMlp:
    """:class:`tests.nets.RegionMlp` (width 8, region MID), weights from ``seed``."""
    torch.manual_seed(seed)
    return RegionMlp(region=MID).eval().requires_grad_(grad)


def _x(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


# DeepSeek-V4 helpers


def _ds_compiled(**options):
    backend = fxsplit.Backend(capture="emulate", **options)  # the runner's own regions
    return torch.compile(ds.build(CFG), backend=backend, dynamic=True, fullgraph=True), backend


def _ds_eager(batches, persistent=False):
    with torch.no_grad():
        return ds.run_decode(
            ds.build(CFG), ds.DecodeRunner(CFG, max(batches), persistent=persistent), batches
        )


def _ds_run(model, batches, persistent=False):
    with torch.no_grad():
        return ds.run_decode(
            model, ds.DecodeRunner(CFG, max(batches), persistent=persistent), batches
        )


def _prep_pieces(backend) -> list[str]:
    """Captured pieces holding attention input preparation."""
    return [p.name for p in backend.plans[0].captured if fxsplit.ATTN_PREP in p.regions]


def _metadata_inputs(piece) -> list[str]:
    return [s.name for s in piece.specs if s.kind == RUNNER and any(m in s.name for m in METADATA)]


# ---------------------------------------------------------------------------------------------
# 1. The field's runner-v1 bug and its fix (DeepSeek-V4, dynamic=True)


@pytest.mark.slow  # tens of seconds
def test_v1_prep_captured_with_trust_gives_wrong_output():
    batches = [2] * 6
    expected = _ds_eager(batches)
    model, backend = _ds_compiled(**PREP_CAPTURED, input_binding="trust")
    got = _ds_run(model, batches)
    assert _prep_pieces(backend), backend.plans[0].format()
    # Warmup and capture run on this step's tensors; every replay reads step 2's metadata.
    assert _equal(got[:2], expected[:2])
    assert [torch.equal(a, b) for a, b in zip(got[2:], expected[2:], strict=True)] == [False] * 4
    assert counters.snapshot()["replays"] > 0


def test_v1_prep_captured_verify_names_piece_and_moved_metadata():
    model, backend = _ds_compiled(**PREP_CAPTURED, input_binding="trust", verify=True)
    runner = ds.DecodeRunner(CFG, 2)
    with torch.no_grad(), pytest.raises(VerifyError) as info:
        for _ in range(4):
            model(*runner.step(2))
    message = str(info.value)
    first = _prep_pieces(backend)[0]
    assert re.search(rf"\b{first}\b", message), message
    assert fxsplit.ATTN_PREP in message
    assert any(m in message for m in METADATA), message
    assert counters.snapshot()["replays"] == 1  # raised on the first replay


def test_v1_prep_captured_strict_refuses_fresh_metadata():
    model, backend = _ds_compiled(**PREP_CAPTURED, input_binding="strict")
    runner = ds.DecodeRunner(CFG, 2)
    with torch.no_grad():
        model(*runner.step(2))  # warmup
        model(*runner.step(2))  # capture
        step = runner.step(2)
        with pytest.raises(BindingError) as info:
            model(*step)
    message = str(info.value)
    pieces = {p.name: p for p in backend.runtimes[0].pieces}
    named = [n for n in pieces if re.search(rf"\b{n}\b", message)]
    assert named and named[0] in _prep_pieces(backend), message
    runner_inputs = [s for s in pieces[named[0]].specs if s.kind == RUNNER]
    spec = next(s for s in runner_inputs if s.name in message)
    assert spec.source in message  # e.g. L['input_ids']
    addresses = set(re.findall(r"0x[0-9a-f]+", message))
    assert len(addresses) == 2, message
    assert {f"0x{t.data_ptr():x}" for t in step} & addresses
    assert counters.snapshot()["replays"] == 0


def test_v1_default_plan_equals_eager_over_20_steps_with_changing_sizes():
    batches = [2, 2, 4, 4, 3, 2, 5, 4, 2, 3, 4, 4, 5, 2, 2, 3, 4, 2, 5, 4]
    expected = _ds_eager(batches)
    model, backend = _ds_compiled(capture_sizes=[2, 4])
    got = _ds_run(model, batches)
    assert backend.config.binding == "copy"
    assert not _prep_pieces(backend)
    assert _equal(got, expected)
    captured = len(backend.plans[0].captured)
    sizes = Counter(batches)
    replays = sizes[2] - 2 + sizes[4] - 2  # per size: one warmup, one capture
    uncaptured = sizes[3] + sizes[5] + 2
    for piece, total in _piece_totals(backend).items():
        assert total["captures"] == 2, piece
        assert total["replays"] == replays, piece
        assert total["uncaptured_runs"] == uncaptured, piece
    snap = counters.snapshot()
    assert snap["captures"] == 2 * captured and snap["replays"] == replays * captured


def test_v1_narrow_plan_copies_metadata_every_step_wide_plan_copies_none():
    batches = [2] * 6
    expected = _ds_eager(batches)
    wide, wide_backend = _ds_compiled()
    assert _equal(_ds_run(wide, batches), expected)
    for piece in wide_backend.runtimes[0].pieces:
        assert not _metadata_inputs(piece), piece.name
        assert not any(m in n for n in piece.stats.copies_by_input for m in METADATA)

    torch._dynamo.reset()
    narrow, narrow_backend = _ds_compiled(**PREP_CAPTURED, verify=True)  # default "copy"
    assert _equal(_ds_run(narrow, batches), expected)
    prep = _prep_pieces(narrow_backend)
    copies: Counter = Counter()  # pieces reading one input share one static buffer
    for piece in narrow_backend.runtimes[0].pieces:
        if piece.name not in prep:
            continue
        replays = sum(
            c.get("replays", 0) for c in narrow_backend.stats["graph_0"][piece.name].values()
        )
        assert replays == len(batches) - 2
        for name in _metadata_inputs(piece):
            copies[name] += piece.stats.copies_by_input[name]
    assert len(copies) >= len(METADATA)
    # every replayed step copies each metadata input once (its fresh tensor changed)
    assert set(copies.values()) == {len(batches) - 2}, copies


def test_v2_persistent_buffers_prep_captured_equals_eager_under_strict():
    batches = [2, 3, 4, 2, 3, 4, 4, 2, 3]
    expected = _ds_eager(batches, persistent=True)
    model, backend = _ds_compiled(runner="v2")
    assert backend.config.binding == "strict"
    got = _ds_run(model, batches, persistent=True)
    assert _prep_pieces(backend), backend.plans[0].format()
    assert _equal(got, expected)
    for piece in backend.runtimes[0].pieces:
        runner_inputs = {s.name for s in piece.specs if s.kind == RUNNER}
        assert not runner_inputs & set(piece.stats.copies_by_input), piece.name
    snap = counters.snapshot()
    assert snap["captures"] == 3 * len(backend.plans[0].captured)
    assert snap["replays"] == 3 * len(backend.plans[0].captured)


# ---------------------------------------------------------------------------------------------
# 2. Counters


def test_one_capture_per_piece_per_size_then_replays():
    net = _net()
    model, backend = _compile(net, dynamic=True, eager_regions=[MID])
    sizes = [2, 2, 2, 3, 3, 3, 2, 3]
    with torch.no_grad():
        for i, n in enumerate(sizes):
            x = _x(n, i)
            assert torch.equal(model(x), net(x))
    plan = backend.plans[0]
    assert [p.kind for p in plan.pieces] == ["captured", "eager", "captured"]
    stats = backend.stats
    assert set(stats) == {"graph_0"}
    assert set(stats["graph_0"]) == {p.name for p in plan.captured}
    for piece, keys in stats["graph_0"].items():
        captured_keys = [c for c in keys.values() if c.get("captures")]
        assert len(captured_keys) == 2, piece
        for c in captured_keys:
            assert c["captures"] == 1 and c["replays"] == 2 and c["uncaptured_runs"] == 1
    snap = counters.snapshot()
    assert {k: snap[k] for k in COUNTED} == {
        "graphs": 1,
        "pieces": 3,
        "captured_pieces": 2,
        "eager_pieces": 1,
        "captures": 4,
        "replays": 8,
        "uncaptured_runs": 4,
        "recaptures": 0,
    }
    assert counters.snapshot()["input_copies"] > 0


@pytest.mark.parametrize("warmup", [0, 1, 2])
def test_warmup_runs_per_key(warmup):
    net = _net()
    model, _ = _compile(net, eager_regions=[MID], warmup_runs=warmup)
    with torch.no_grad():
        for call in range(1, warmup + 3):
            x = _x(2, call)
            assert torch.equal(model(x), net(x))
            snap = counters.snapshot()
            assert snap["captures"] == (0 if call <= warmup else 2), call
            assert snap["uncaptured_runs"] == 2 * min(call, warmup), call
            assert snap["replays"] == (2 if call == warmup + 2 else 0), call


def test_capture_sizes_leave_other_sizes_uncaptured(caplog):
    net = _net()
    model, backend = _compile(net, dynamic=True, eager_regions=[MID], capture_sizes=[2])
    logged = []
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="fxsplit"):
        model(_x(2, 0))
        for i, n in enumerate([3, 2, 3, 2, 3]):
            caplog.clear()
            x = _x(n, i + 1)
            assert torch.equal(model(x), net(x))
            if n == 3:
                logged.append([r.getMessage() for r in caplog.records if r.name == "fxsplit"])
    # Logged once per uncaptured size.
    assert len(logged[0]) == 1 and "3" in logged[0][0]
    assert logged[1:] == [[], []]
    for piece, total in _piece_totals(backend).items():
        assert (total["captures"], total["replays"], total["uncaptured_runs"]) == (1, 1, 4), piece


def test_max_captured_keys_warns_once_then_runs_uncaptured():
    net = _net()
    model, backend = _compile(net, dynamic=True, eager_regions=[MID], max_captured_keys=1)
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitWarning, match="max_captured_keys") as seen:
        for i, n in enumerate([2, 2, 3, 3, 5, 5, 2, 2]):
            x = _x(n, i)
            assert torch.equal(model(x), net(x))
    # once per piece, at the user's line
    assert warned_at(seen) == [("test_runtime.py", "assert torch.equal(model(x), net(x))")] * 2
    for piece in backend.runtimes[0].pieces:
        assert len(piece.entries) == 1, piece.name
    for piece, total in _piece_totals(backend).items():
        assert (total["captures"], total["replays"], total["uncaptured_runs"]) == (1, 2, 5), piece


def test_dynamic_false_one_graph_per_size_each_captured():
    net = _net()
    model, backend = _compile(net, dynamic=False, eager_regions=[MID], capture_sizes=[3, 4])
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitWarning, match="fixed at 2") as seen:
        for i, n in enumerate([2, 3, 4] * 3):
            x = _x(n, i)
            assert torch.equal(model(x), net(x))
    # at compile time, pointing at the call that compiled the graph
    assert warned_at(seen) == [("test_runtime.py", "assert torch.equal(model(x), net(x))")]
    assert [rt.graph_id for rt in backend.runtimes] == ["graph_0", "graph_1", "graph_2"]
    captures = [
        sum(t["captures"] for t in _piece_totals(backend, g).values()) for g in backend.stats
    ]
    assert captures == [0, 2, 2]  # size 2 is not a capture size


def test_automatic_dynamic_shapes_capture_and_replay():
    net = _net()
    model, backend = _compile(net, eager_regions=[MID])  # dynamic=None: static, then dynamic
    with torch.no_grad():
        for i, n in enumerate([2, 3, 4, 3, 4, 3, 4, 2, 2]):
            x = _x(n, i)
            assert torch.equal(model(x), net(x))
    assert len(backend.runtimes) == 2
    assert counters.snapshot()["captures"] == 2 * 3  # size 2 in graph_0, 3 and 4 in graph_1
    assert counters.snapshot()["replays"] > 0


# ---------------------------------------------------------------------------------------------
# 3. Binding


def test_eager_fresh_tensor_feeding_captured_piece_is_copied_each_replay():
    net = _net()
    model, backend = _compile(net, eager_regions=[MID])
    with torch.no_grad():
        for i in range(6):
            x = _x(2, i)
            assert torch.equal(model(x), net(x)), i
    last = backend.runtimes[0].pieces[-1]
    internal = [s.name for s in last.specs if s.kind == "internal"]
    assert len(internal) == 1
    assert last.stats.copies_by_input[internal[0]] == 4  # every replay


def test_eager_inplace_write_into_static_output_needs_no_copy():
    def f(x):
        a = x * 2
        with fxsplit.region(MID):
            a.add_(1)
        return a * 3, a

    model, backend = _compile(f, eager_regions=[MID])
    with torch.no_grad():
        for i in range(5):
            x = torch.full((4,), float(i))
            assert _equal(model(x), f(x)), i
    last = backend.runtimes[0].pieces[-1]
    assert not last.stats.copies_by_input
    assert _piece_totals(backend)[last.name]["replays"] == 3


def test_persistent_runner_input_bound_without_copy_and_fresh_tensor_refused():
    net = _net()
    model, backend = _compile(net, dynamic=True, runner="v2", eager_regions=[MID])
    buffer = torch.zeros(4, 8)
    with torch.no_grad():
        for i, n in enumerate([2, 2, 2, 4, 4, 4, 2]):
            view = buffer[:n]
            view.copy_(_x(n, i))
            assert torch.equal(model(view), net(view)), i
        first = backend.runtimes[0].pieces[0]
        assert not first.stats.copies_by_input
        assert counters.snapshot()["replays"] == 2 * 3
        other = torch.zeros(4, 8)[:2]  # a view too: Dynamo guards on view-ness
        with pytest.raises(BindingError, match="piece_0"):
            model(other)
        assert len(backend.runtimes) == 1


def _write_input(x):
    x.add_(1)
    return x * 2


def _write_input_view(x):
    x[:, 0].mul_(2)
    return x.sum(1)


@pytest.mark.parametrize("f", [_write_input, _write_input_view], ids=["input", "view"])
def test_write_into_a_runner_input_reaches_the_caller_after_capture_and_every_replay(f):
    model, backend = _compile(f)
    with torch.no_grad():
        for step in range(5):  # warmup, capture, three replays
            x, ref = torch.arange(6.0).reshape(3, 2) + step, torch.arange(6.0).reshape(3, 2) + step
            assert torch.equal(model(x), f(ref)) and torch.equal(x, ref), step
    assert backend.runtimes[0].pieces[0].specs[0].written
    (totals,) = _piece_totals(backend).values()
    assert totals["captures"] == 1 and totals["replays"] == 3


def test_eager_piece_reads_runner_input_mutated_by_captured_piece_on_capture_step():
    def f(x):
        x.add_(1)
        with fxsplit.region(MID):
            y = x.sin()
        return y + x

    model, backend = _compile(f, eager_regions=[MID])
    with torch.no_grad():
        for i in range(3):
            x, ref = torch.full((3,), float(i)), torch.full((3,), float(i))
            assert torch.equal(model(x), f(ref)), i
    assert_replayed(backend)


def test_load_state_dict_assign_recaptures_with_new_weights(caplog):
    net, ref = _net(0), _net(0)
    model, backend = _compile(net, eager_regions=[MID])
    with torch.no_grad():
        for i in range(3):
            assert torch.equal(model(_x(2, i)), ref(_x(2, i)))
        new = {k: torch.randn_like(v) for k, v in net.state_dict().items()}
        net.load_state_dict(new, assign=True)
        ref.load_state_dict(new)
        with caplog.at_level(logging.INFO, logger="fxsplit"):
            caplog.clear()
            assert torch.equal(model(_x(2, 10)), ref(_x(2, 10)))
            moved = [r for r in caplog.records if r.name.startswith("fxsplit")]
        assert len(moved) == 1 and "graph_0" in moved[0].getMessage()
        for i in range(11, 14):
            assert torch.equal(model(_x(2, i)), ref(_x(2, i))), i
    assert len(backend.plans) == 1  # no recompile
    assert counters.snapshot()["recaptures"] == 1
    for piece, total in _piece_totals(backend).items():
        assert total["captures"] == 2 and total["replays"] == 3, piece


# ---------------------------------------------------------------------------------------------
# 4. Capture failure


@torch.library.custom_op("fxsplit_rttest::host_sync", mutates_args=())
def host_sync(x: torch.Tensor) -> torch.Tensor:
    """No cudagraph_unsafe tag, so the mark pass keeps it captured; its kernel syncs."""
    return x + float(x.sum().item() > 0)


@host_sync.register_fake
def _(x):
    return torch.empty_like(x)


def _syncing(x):
    return host_sync(x * 2) + 1


def test_capture_failure_falls_back_uncaptured_with_one_warning():
    model, backend = _compile(_syncing)
    with torch.no_grad(), pytest.warns(UserWarning) as seen:
        for i in range(4):
            x = torch.full((3,), i - 1.0)
            assert torch.equal(model(x), _syncing(x)), i
    assert [p.kind for p in backend.plans[0].pieces] == ["captured"]
    warned = [str(w.message) for w in seen if "runs uncaptured" in str(w.message)]
    assert len(warned) == 1 and "piece_0" in warned[0] and "item" in warned[0], warned
    total = _piece_totals(backend)["piece_0"]
    assert total["captures"] == 0 and total["uncaptured_runs"] == 4
    # the capture step and the two calls after it ran uncaptured for that reason
    ((reason, calls),) = backend.stats["graph_0"]["piece_0"]["refused"].items()
    assert "item" in reason and calls == 3


def test_capture_failure_raises_with_on_capture_error_raise():
    model, _ = _compile(_syncing, on_capture_error="raise")
    with torch.no_grad():
        model(torch.ones(3))  # warmup
        with pytest.raises(CaptureError, match="item"):
            model(torch.ones(3))


class _CountingSync(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)
        return host_sync(x) + self.count


def test_capture_failure_fallback_runs_side_effects_once():
    module = _CountingSync()
    model, backend = _compile(module)
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitWarning, match="item"):
        for _ in range(3):
            model(torch.ones(2))
    assert module.count.item() == 3
    (totals,) = _piece_totals(backend).values()
    assert totals["captures"] == 0 and totals["uncaptured_runs"] == 3  # the capture failed


# ---------------------------------------------------------------------------------------------
# 5. Outputs


def test_clone_outputs_keeps_the_previous_output():
    net = _net()
    model, _ = _compile(net, eager_regions=[MID], clone_outputs=True)
    with torch.no_grad():
        model(_x(2, 0))
        held = model(_x(2, 1))
        before = held.clone()
        new = model(_x(2, 2))
    assert counters.snapshot()["replays"] == 2
    assert torch.equal(held, before) and torch.equal(new, net(_x(2, 2)))


# ---------------------------------------------------------------------------------------------
# 6. Grad


def test_grad_enabled_runs_uncaptured_with_one_warning():
    net = _net(grad=True)
    model, _ = _compile(net, eager_regions=[MID])
    with pytest.warns(fxsplit.FxsplitWarning, match="grad") as seen:
        outs = [model(_x(2, i)) for i in range(3)]
    assert warned_at(seen) == [("test_runtime.py", "outs = [model(_x(2, i)) for i in range(3)]")]
    assert all(o.grad_fn is not None for o in outs)
    assert torch.equal(outs[2], net(_x(2, 2)))
    snap = counters.snapshot()
    assert snap["captures"] == 0 and snap["replays"] == 0 and snap["uncaptured_runs"] == 6
    outs[2].sum().backward()
    assert net.a.weight.grad is not None


class HandsAWeightViewToAttention(nn.Module):
    """A captured piece hands a view of a weight to the eager piece after it (as a model whose
    cache update runs eager under v1 hands it the conv weight): without grad the view still
    requires grad (a view of a leaf), with no autograd history a replay could return stale."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 1, 4))

    def forward(self, x):
        h, w = x.sin(), self.weight.squeeze(1)
        with fxsplit.region(MID):
            h = (h @ w).softmax(-1)
        return h.cos()


def test_a_view_of_a_weight_handed_on_without_grad_is_captured():
    net = HandsAWeightViewToAttention()
    model, backend = _compile(net, eager_regions=[MID])
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
            assert torch.equal(model(x), net(x)), i
    assert_replayed(backend, at_least=2)


class ReturnsAWeightView(HandsAWeightViewToAttention):
    def forward(self, x):
        return super().forward(x), self.weight.squeeze(1)


def test_a_returned_view_of_a_weight_is_made_anew_each_call_as_eager_makes_it():
    """A replay rebuilds the view over the weight: a view made at capture would carry the
    weight's version of then, and once the weight changed in place (an optimizer step, a
    weight load) autograd refuses to use it ("A view was created in no_grad mode and its base
    ... has been modified inplace"), where eager's view of this call works."""
    net = ReturnsAWeightView()
    model, backend = _compile(net, eager_regions=[MID])
    for i in range(5):
        with torch.no_grad():
            if i == 4:
                net.weight.mul_(2)
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
            (got, view), (want, eager_view) = model(x), net(x)
            assert torch.equal(got, want) and torch.equal(view, eager_view), i
        assert (view * 1).requires_grad and view.grad_fn is None, i
    assert_replayed(backend, at_least=2)


# ---------------------------------------------------------------------------------------------
# 7. Reset and isolation


def test_dynamo_reset_frees_runtimes_plans_and_graphs():
    model, backend = _compile(_net(), eager_regions=[MID])
    with torch.no_grad():
        for i in range(3):
            model(_x(2, i))
    runtime = backend.runtimes[0]
    graphs = [weakref.ref(e.graph) for p in runtime.pieces for e in p.entries.values()]
    assert len(graphs) == 2
    runtime = weakref.ref(runtime)
    torch._dynamo.reset()
    assert backend.runtimes == [] and backend.plans == [] and backend.stats == {}
    del model
    _real_collect()
    assert runtime() is None
    assert all(g() is None for g in graphs)


def test_two_backends_share_no_stats():
    net_a, net_b = _net(0), _net(1)
    model_a, backend_a = _compile(net_a, eager_regions=[MID])
    model_b, backend_b = _compile(net_b, eager_regions=[MID])
    with torch.no_grad():
        for i in range(3):
            model_a(_x(2, i))
        before = backend_a.stats
        for i in range(5):
            assert torch.equal(model_b(_x(2, i)), net_b(_x(2, i)))
    assert backend_a.stats == before
    assert [rt.graph_id for rt in backend_b.runtimes] == ["graph_0"]
    assert backend_a.runtimes[0] is not backend_b.runtimes[0]
    assert sum(t["replays"] for t in _piece_totals(backend_a).values()) == 2
    assert sum(t["replays"] for t in _piece_totals(backend_b).values()) == 6
    assert counters.snapshot()["replays"] == 8  # the process-wide view adds both


@needs_swap
def test_two_backends_see_each_others_memory_through_the_one_record():
    """Which memory fxsplit produced is one record for the process
    (:data:`fxsplit.runtime.memory.provenance.RECORD`): an output of a model compiled with one
    backend
    is fxsplit's memory for every backend; a reset takes that backend's pools out of the record
    (the output it handed out moves to memory of its own: the caller's), and the record keeps
    no output alive."""
    model_a, backend_a = _compile(_net(0), eager_regions=[MID])
    model_b, _ = _compile(_net(1), eager_regions=[MID])
    eager_a, eager_b = _net(0), _net(1)
    with torch.no_grad():
        for i in range(3):
            out_a, out_b = model_a(_x(2, i)), model_b(_x(2, i))
            assert torch.equal(out_a, eager_a(_x(2, i))), i
            assert torch.equal(out_b, eager_b(_x(2, i))), i
    assert sum(t["replays"] for t in _piece_totals(backend_a).values()) == 2
    record = provenance.RECORD
    assert record.in_pool(out_a) and record.produced(out_a)
    assert record.in_pool(out_b) and record.produced(out_b)
    assert not record.produced(_x(2, 0))
    backend_a.reset()
    assert not record.in_pool(out_a) and not record.produced(out_a)
    assert record.in_pool(out_b) and record.produced(out_b)
    storage = StorageWeakRef(out_b.untyped_storage())
    del out_b
    assert storage.expired()


# ---------------------------------------------------------------------------------------------
# 8. Backend.capture


def test_backend_capture_captures_every_size_up_front_largest_first(gc_calls):
    net = _net()
    model, backend = _compile(net, dynamic=True, eager_regions=[MID], capture_sizes=[2, 3, 4])
    first = _x(5, 0)
    torch._dynamo.maybe_mark_dynamic(first, 0)  # as Backend.capture marks its inputs
    with torch.no_grad():
        model(first)  # compile (Dynamo collects garbage here); 5 is not a capture size
    order = []

    def recording(x):
        order.append(x.shape[0])
        return model(x)

    del gc_calls[:]
    backend.capture(recording, {n: (_x(n, n),) for n in (2, 4, 3)})
    assert order == [4, 4, 3, 3, 2, 2]  # warmup_runs=1, then capture, per size
    assert len(gc_calls) == 1  # one capture session
    for piece, keys in backend.stats["graph_0"].items():
        captured = [c for c in keys.values() if c.get("captures")]
        assert len(captured) == 3 and all(c.get("replays", 0) == 0 for c in captured), piece
    assert counters.snapshot()["replays"] == 0
    with torch.no_grad():
        x = _x(3, 7)
        assert torch.equal(model(x), net(x))
    assert counters.snapshot()["replays"] == 2 and counters.snapshot()["captures"] == 6


def test_backend_capture_then_every_size_replays_without_recompiling(gc_calls):
    net = _net()
    model, backend = _compile(net, eager_regions=[MID])  # torch.compile's default dynamic
    sizes = (8, 4, 2)
    backend.capture(model, {n: (_x(n, n),) for n in sizes})
    assert len(backend.plans) == 1
    before = counters.snapshot()
    with torch.no_grad():
        for n in (*sizes, 8):
            x = _x(n, 100 + n)
            assert torch.equal(model(x), net(x))
    after = counters.snapshot()
    assert after["uncaptured_runs"] == before["uncaptured_runs"]
    assert after["captures"] == before["captures"]
    assert after["replays"] - before["replays"] == 4 * len(backend.plans[0].captured)
    assert len(backend.plans) == 1


def test_lazy_capture_step_collects_garbage_once(gc_calls):
    def f(x):
        x = x * 2
        with fxsplit.region(MID):
            x = x.sin()
        x = x + 1
        with fxsplit.region(MID):
            x = x.cos()
        return x * 3

    model, backend = _compile(f, eager_regions=[MID])
    with torch.no_grad():
        model(torch.ones(2))  # compile + warmup
        del gc_calls[:]
        model(torch.ones(2))  # captures 3 pieces
    assert len(backend.plans[0].captured) == 3
    assert counters.snapshot()["captures"] == 3
    assert len(gc_calls) == 1


# ---------------------------------------------------------------------------------------------
# 9. capture="cuda" without a device


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_capture_cuda_without_cuda_raises_clear_error():
    model = torch.compile(lambda x: x + 1, backend=fxsplit.Backend(capture="cuda"))
    # torch wraps the backend's error (BackendCompilerFailed); look along the cause chain.
    with pytest.raises(Exception) as info:
        model(torch.ones(2))
    chain, error = [], info.value
    while error is not None and len(chain) < 10:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("capture='cuda'" in text for text in chain), chain


# ---------------------------------------------------------------------------------------------
# Adversarial small graphs


def _check_steps(fn, make_args, steps, dynamic=None, **options):
    """Run ``fn`` eagerly and compiled on equal fresh inputs each step; compare outputs and the
    inputs afterwards (in-place ops). Returns the backend."""
    model, backend = _compile(fn, dynamic=dynamic, **options)
    with torch.no_grad():
        for step in range(steps):
            eager_args, compiled_args = make_args(step), make_args(step)
            expected, got = fn(*eager_args), model(*compiled_args)
            expected = expected if isinstance(expected, tuple) else (expected,)
            got = got if isinstance(got, tuple) else (got,)
            assert len(got) == len(expected)
            for e, g in zip(expected, got, strict=True):
                if isinstance(e, torch.Tensor):
                    assert torch.equal(e, g), step
                else:
                    assert e == g, step
            for e, g in zip(eager_args, compiled_args, strict=True):
                if isinstance(e, torch.Tensor):
                    assert torch.equal(e, g), step
    return backend


def test_varying_python_int_is_part_of_the_key():
    def f(x, n):
        return x * n + torch.arange(n).sum()

    values = [2, 3, 2, 3, 4, 2, 4]
    backend = _check_steps(f, lambda s: (torch.ones(3), values[s]), len(values), dynamic=True)
    assert counters.snapshot()["replays"] > 0
    assert len(backend.runtimes[0].pieces[0].entries) == 3


def test_varying_python_float_replays_correctly():
    def f(x, s):
        with fxsplit.region(MID):
            x = x.cos()
        return x * s

    values = [0.5, 1.5, 0.5, 1.5, 2.5, 0.5]
    _check_steps(
        f, lambda s: (torch.ones(2), values[s]), len(values), dynamic=True, eager_regions=[MID]
    )
    assert counters.snapshot()["replays"] > 0


def test_symint_read_after_eager_piece():
    def f(x, n):
        with fxsplit.region(MID):
            x = x.cos()
        return x + torch.arange(x.shape[0]) * n

    _check_steps(
        f,
        lambda s: (torch.ones(2 + s % 2), 2 + s // 2 % 2),
        12,
        dynamic=True,
        eager_regions=[MID],
    )
    assert counters.snapshot()["replays"] > 0


def test_none_int_and_input_outputs():
    def f(x, y):
        with fxsplit.region(MID):
            k = x.shape[0] * 2
        return None, k, x, y.sin() + k

    _check_steps(
        f,
        lambda s: (torch.ones(s % 2 + 2) * s, torch.ones(s % 2 + 2) * s),
        6,
        dynamic=True,
        eager_regions=[MID],
    )
    assert counters.snapshot()["replays"] > 0


def test_non_contiguous_and_expanded_runner_inputs():
    def f(x, y):
        return x * 2 + 1, y * 3

    _check_steps(
        f,
        lambda s: (
            (torch.arange(6.0).reshape(2, 3) + s).t(),
            torch.tensor([float(s)]).expand(3),
        ),
        5,
    )
    assert counters.snapshot()["replays"] == 3


def test_buffer_updated_in_captured_piece_once_per_step():
    class Stepper(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count.add_(1)
            with fxsplit.region(MID):
                x = x.relu()
            return x + self.count

    module = Stepper()
    model, backend = _compile(module, eager_regions=[MID])
    with torch.no_grad():
        outs = [model(torch.ones(2)).clone() for _ in range(5)]
    assert_replayed(backend, at_least=3)
    assert module.count.item() == 5
    assert [o[0].item() for o in outs] == [2.0, 3.0, 4.0, 5.0, 6.0]


def test_data_dependent_eager_piece_feeds_captured_piece():
    def f(x):
        y = x * 2
        idx = (y > 3).nonzero()
        return (idx * 2).sum() + y.sum(), idx * 3

    values = [[1.0, 2.0, 3.0], [3.0, 3.0, 1.0], [0.0, 0.0, 5.0], [3.0, 3.0, 3.0], [1.0, 2.0, 3.0]]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        backend = _check_steps(f, lambda s: (torch.tensor(values[s % len(values)]),), 7)
    assert [p.kind for p in backend.plans[0].pieces] == ["captured", "eager", "captured"]
    assert counters.snapshot()["replays"] > 0


def test_verify_accepts_correct_replays_of_a_mutating_piece():
    def f(x):
        x.add_(1)
        with fxsplit.region(MID):
            y = x.cos()
        return y * x

    model, _ = _compile(f, eager_regions=[MID], verify=True)
    with torch.no_grad():
        model(torch.zeros(3))
        model(torch.zeros(3))
        for i in range(3):
            x, ref = torch.full((3,), float(i)), torch.full((3,), float(i))
            assert torch.equal(model(x), f(ref)) and torch.equal(x, ref)
    assert counters.snapshot()["replays"] == 3 * 2


def test_output_view_of_runner_input_aliases_the_callers_tensor():
    def f(x):
        return x.view(-1), x + 1

    model, backend = _compile(f)
    with torch.no_grad():
        for i in range(3):
            x = torch.full((2, 2), float(i))
            view, _ = model(x)
            x.add_(10)
            assert torch.equal(view, x.view(-1)), i
    assert_replayed(backend)


def test_plan_names_the_outputs_that_view_an_input_from_functionalization():
    """The aliasing facts: views (``view``, ``t``) and an input written in place and returned
    are outputs aliasing an input; fresh results (``+``, ``clone``) are not."""

    def f(x, y):
        return x.view(-1), x + 1, y.t(), x.clone(), y.mul_(2)

    model, backend = _compile(f)
    with torch.no_grad():
        model(torch.randn(2, 2), torch.randn(2, 2))
    (piece,) = backend.plans[0].pieces
    assert piece.kind == "captured" and piece.writes == ("l_y_",)
    assert sorted(piece.aliases) == ["mul_ -> l_y_", "t -> l_y_", "view -> l_x_"], piece.aliases


def test_overlapping_runner_inputs_keep_their_aliasing():
    """Runner inputs sharing storage, one written in place and one copied: each such call runs
    uncaptured, counted and warned once; calls without the overlap capture and replay."""

    def f(a, b):
        a.add_(1)
        return b * 2

    model, backend = _compile(f)
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitWarning, match="share storage") as seen:
        for i in range(4):
            base, ref = torch.arange(4.0) + i, torch.arange(4.0) + i
            got, expected = model(base[:3], base[1:]), f(ref[:3], ref[1:])
            assert torch.equal(got, expected), i
            assert torch.equal(base, ref), i
        (totals,) = _piece_totals(backend).values()
        assert totals["captures"] == 0 and totals["uncaptured_runs"] == 4
        for i in range(4):  # same shapes, storages apart
            a, b = torch.arange(4.0)[:3] + i, torch.arange(4.0)[1:] + i
            a_ref = a.clone()
            assert torch.equal(model(a, b), f(a_ref, b.clone())) and torch.equal(a, a_ref), i
    assert len([w for w in seen if "share storage" in str(w.message)]) == 1
    ((reason, calls),) = backend.stats["graph_0"]["piece_0"]["refused"].items()
    assert "share storage" in reason and calls == 3
    assert_replayed(backend)


def test_output_fed_back_as_next_input_without_mutation():
    def f(x):
        return x * 2 + 1

    model, _ = _compile(f)
    expected, got = torch.ones(3), torch.ones(3)
    with torch.no_grad():
        for step in range(5):
            expected, got = f(expected), model(got)
            assert torch.equal(got, expected), step
    assert counters.snapshot()["replays"] == 3


def test_output_fed_back_into_a_piece_that_mutates_its_input():
    def f(x):
        x.mul_(2)
        return x + 1

    model, backend = _compile(f)
    expected, got = torch.ones(3), torch.ones(3)
    with torch.no_grad():
        for step in range(5):
            expected, got = f(expected), model(got)
            assert torch.equal(got, expected), step
    assert_replayed(backend)


def test_previous_output_passed_back_is_read_before_a_replay_overwrites_it():
    def f(x, y):
        a = y * 2
        with fxsplit.region(MID):
            b = x.cos()
        return a, a + b

    model, backend = _compile(f, eager_regions=[MID])
    prev_e, prev_c = torch.ones(3), torch.ones(3)
    with torch.no_grad():
        for step in range(5):
            y = torch.full((3,), float(step))
            prev_e, expected = f(prev_e, y)
            prev_c, got = model(prev_c, y)
            assert torch.equal(got, expected), step
    assert_replayed(backend)


def test_verify_compares_random_pieces_with_the_replays_numbers():
    """The replay and the uncaptured run verify compares it with draw the same numbers, and
    the call leaves the generator where eager leaves it: seeded once, the compiled calls draw
    eager's numbers call after call."""

    def f(x):
        noise = torch.rand_like(x)
        return (x + noise).sin() + x

    backend = _backend(verify=True)
    model = torch.compile(f, backend=backend)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    with torch.no_grad():
        torch.manual_seed(0)
        want = [f(x) for x in xs]
        torch.manual_seed(0)
        got = [model(x).clone() for x in xs]  # kept past the next call (torch 2.11 poisons)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert counters.snapshot()["replays"] == 3
    assert backend.plans[0].pieces[0].random


@torch.library.custom_op("fxsplit_test_runtime::softmax_into", mutates_args=("out",))
def _softmax_into(q: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q.softmax(-1))


class FillsAnEmptyBuffer(nn.Module):
    """A captured piece allocates the output buffer an eager op fills (TensorRT-LLM's and
    vLLM's ``*_with_output`` attention): what the buffer holds when the piece ends is
    unspecified, so verify has nothing of it to compare."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        q = self.a(x)
        out = torch.empty_like(q)
        _softmax_into(q, out)
        return self.b(out)


@torch.library.custom_op("fxsplit_test_runtime::grow", mutates_args=("x",))
def _grow(x: torch.Tensor) -> None:
    x.resize_(x.numel() * 2)


class ResizesAnOutput(nn.Module):
    """An eager op resizes (``resize_``) a captured piece's output, which lives in the capture
    memory pool and cannot grow."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        _grow(h)
        return h.sum()


def test_a_resize_of_a_captured_output_names_the_graph_and_the_fix():
    compiled = torch.compile(
        ResizesAnOutput().eval(),
        backend=_backend(splitting_ops=["fxsplit_test_runtime::grow"]),
    )
    with torch.no_grad():
        compiled(torch.randn(2, 4))  # warm-up: eager memory
        with pytest.raises(RuntimeError, match=r"graph_0: the model resized .* Resize a clone"):
            compiled(torch.randn(2, 4))


def test_a_returned_output_resizes_under_clone_outputs():
    """A returned output is pool memory handed out (it cannot grow, as with cudagraph trees);
    ``clone_outputs=True`` returns memory of the caller's own."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 4).eval()
    compiled = torch.compile(linear, backend=_backend(clone_outputs=True))
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
            out = compiled(x)
            assert torch.equal(out, linear(x)), step
    out.resize_(16)
    assert out.shape == (16,)
    assert counters.snapshot()["replays"] == 1


def test_verify_treats_nan_as_equal_to_nan():
    def f(x):
        return x.log() + x  # the log of a negative number is nan

    backend = _backend(verify=True)
    model = torch.compile(f, backend=backend)
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            got = model(x)
            assert got.isnan().any(), step
            torch.testing.assert_close(got, f(x), rtol=0, atol=0, equal_nan=True)
    assert counters.snapshot()["replays"] == 2


def test_strict_binding_checks_addresses_with_capture_off_too():
    def f(x, positions):
        return x * 2 + positions.unsqueeze(-1)

    model = torch.compile(f, backend=fxsplit.Backend(capture="off", runner="v2", eager_regions=[]))
    x, positions = torch.randn(3, 4), torch.arange(3.0)
    with torch.no_grad():
        model(x, positions)  # warm-up
        model(x, positions)  # would capture: addresses fixed
        x.copy_(torch.randn(3, 4))
        model(x, positions)  # same tensors refilled: fine
        with pytest.raises(fxsplit.BindingError, match="positions"):
            model(x, torch.arange(3.0))  # a fresh tensor, as a buggy runner would hand
        model(torch.randn(5, 4), torch.arange(5.0))  # another shape: its own first call


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_strict_binding_takes_fed_back_outputs_alike_with_capture_on_and_off(capture):
    """Outputs fed back are fxsplit's to copy, never a BindingError; a fresh tensor where the
    capture bound the runner's own buffer is one, with capture on and off alike."""

    def f(x):
        h = x.sin() * 2
        with fxsplit.region(MID):
            h = h.cos()
        return h + 1

    backend = fxsplit.Backend(capture=capture, runner="v2", eager_regions=[MID])
    model = torch.compile(f, backend=backend)
    buffer = torch.randn(3, 4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", fxsplit.FxsplitWarning)  # the refused fed-back calls
        model(buffer)
        model(buffer)  # capture (or, with capture off, the addresses fixed): the runner's buffer
        x = model(buffer)
        expected = x.clone()  # x is fed back: torch 2.11 invalidates it after the next step
        for step in range(4):  # each step's input is the previous step's output
            x, expected = model(x), f(expected)
            assert torch.equal(x, expected), step
        with pytest.raises(fxsplit.BindingError):  # a fresh tensor fxsplit never produced
            model(torch.randn(3, 4))


def test_weights_reloaded_every_other_step_warn_of_a_recapture_storm():
    net, ref = _net(0), _net(0)
    model, _ = _compile(net, eager_regions=[MID])
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitWarning, match="recaptured") as seen:
        for i in range(10):
            if i % 2 == 0 and i > 0:
                new = {k: torch.randn_like(v) for k, v in net.state_dict().items()}
                net.load_state_dict(new, assign=True)
                ref.load_state_dict(new)
            assert torch.equal(model(_x(2, i)), ref(_x(2, i))), i
    # one warning (not taken for rebinding), at the call that replayed
    assert warned_at(seen) == [
        ("test_runtime.py", "assert torch.equal(model(_x(2, i)), ref(_x(2, i))), i")
    ]
    assert "moved" in str(seen[0].message)


def test_stats_keys_read_as_sizes_and_typed_host_values():
    """``Backend.stats`` (and the dump's runtime.json) names a capture key by its token count
    and host values with their types, not by Python's repr of a tuple of classes."""

    def f(x, n: int):
        h = x.sin() * n
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        return h + 1

    backend = fxsplit.Backend(capture="emulate")
    model = torch.compile(f, backend=backend, dynamic=True)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 8), 3)
    keys = {key for pieces in backend.stats.values() for p in pieces.values() for key in p}
    assert "4, 8, int 3" in keys, keys  # the sizes of x, then n
    assert not any("class" in key for key in keys), keys


def test_a_call_while_another_thread_is_inside_one_raises_and_changes_nothing():
    """One Backend's graphs share a memory pool and static buffers: a call from a second
    thread while a first is inside one would read and write the first one's memory (wrong
    numbers, found with four threads). It raises before touching anything."""
    import threading

    from tests.stack import Stack

    model, backend = Stack(1), fxsplit.Backend(capture="emulate")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(3, 8))
    (runtime,) = backend.runtimes
    forward, inside, release, got = runtime._forward, threading.Event(), threading.Event(), []

    def blocking(*args):
        inside.set()
        release.wait(30)
        return forward(*args)

    def first(x):
        with torch.no_grad():
            got.append(compiled(x))

    x = torch.randn(3, 8)
    runtime._forward = blocking
    thread = threading.Thread(target=first, args=(x,))
    thread.start()
    try:
        assert inside.wait(30)
        runtime._forward = forward
        with torch.no_grad(), pytest.raises(fxsplit.ConcurrentCallError, match="another thread"):
            compiled(torch.randn(3, 8))
    finally:
        release.set()
        thread.join(30)
    replays = counters.snapshot()["replays"]
    with torch.no_grad():
        assert torch.equal(got[0], model(x))
        y = torch.randn(3, 8)
        assert torch.equal(compiled(y), model(y))
    assert counters.snapshot()["replays"] > replays


def test_a_capture_key_names_an_opaque_object_by_type_and_ordinal_never_an_address():
    from fxsplit.runtime.piece.stats import key_text

    class Handle:
        pass

    first, second = Handle(), Handle()
    text = key_text((4, (Handle, first), (Handle, second), (Handle, first), (int, 3)))
    assert re.fullmatch(r"4, Handle #(\d+), Handle #(\d+), Handle #\1, int 3", text), text
    assert "0x" not in text and text == key_text(
        (4, (Handle, first), (Handle, second), (Handle, first), (int, 3))
    )


def _add_into(x):
    out = torch.empty_like(x)
    torch.add(x, 1, out=out)
    return out


def _copy_into_view(x):
    out = torch.empty_like(x)
    out.view(-1).copy_((x + 1).view(-1))
    return out


@pytest.mark.parametrize("fn", [_add_into, _copy_into_view], ids=["out", "view"])
def test_verify_compares_an_allocated_buffer_the_piece_writes_through_out_or_a_view(fn):
    """An ``empty_like`` the piece itself fills (an ``out=`` argument, a view's ``copy_``) holds
    the piece's numbers: verify compares it, and a stale read (a trusted input that moved)
    raises rather than return last call's numbers."""
    compiled, backend = _compile(fn, verify=True, input_binding="trust")
    with torch.no_grad(), pytest.raises(VerifyError, match="differs from running it uncaptured"):
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x), fn(x))
    assert backend.plans[0].pieces[0].unset == ()


class FillsAViewOfAnEmptyBuffer(FillsAnEmptyBuffer):
    """The buffer the eager op fills is a view of the memory the piece allocates."""

    def forward(self, x):
        q = self.a(x)
        out = torch.empty(q.numel()).view(q.shape)
        _softmax_into(q, out)
        return self.b(out)


@pytest.mark.parametrize("model", [FillsAnEmptyBuffer, FillsAViewOfAnEmptyBuffer])
def test_verify_leaves_out_a_buffer_the_piece_allocates_for_an_eager_op(model):
    model = model().eval()
    backend = _backend(verify=True, splitting_ops=["fxsplit_test_runtime::softmax_into"])
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x), model(x))
    assert backend.plans[0].pieces[0].unset == ("out",)
    assert_replayed(backend)
