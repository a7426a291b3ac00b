"""The capture runtime on a real CUDA/HIP device (``capture="cuda"``): the core checks of
``tests/test_runtime.py``, small and quick. Skipped where torch sees no CUDA device.

Outputs are compared with a tight tolerance rather than bit for bit: a kernel launched from a
graph may use another cuBLAS workspace than the eager launch. Stale reads (the field's bug) give
errors far above it. Replay speed is not asserted here (see ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit import counters
from fxsplit.models import deepseek_v4 as ds
from fxsplit.runtime.binding import RUNNER, BindingError
from tests.nets import KeyFree, RegionMlp

pytestmark = [
    pytest.mark.usefixtures("fresh_dynamo"),
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]

CFG = ds.DeepseekV4Config()
PREP_CAPTURED = {"eager_regions": [fxsplit.SPARSE_INDEXER, fxsplit.ATTENTION]}
METADATA = ("positions", "slot_mapping", "block_table", "seq_lens")
MID = "eager_mid"
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _ds_compiled(**options):
    backend = fxsplit.Backend(capture="cuda", **options)
    model = ds.build(CFG).to("cuda")
    return torch.compile(model, backend=backend, dynamic=True, fullgraph=True), backend


def _ds_decode(model, batches, persistent=False):
    runner = ds.DecodeRunner(CFG, max(batches), persistent=persistent, device="cuda")
    with torch.no_grad():
        out = ds.run_decode(model, runner, batches)
    torch.cuda.synchronize()
    return out


def _ds_eager(batches, persistent=False):
    return _ds_decode(ds.build(CFG).to("cuda"), batches, persistent)


def _close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def _piece_totals(backend, graph="graph_0") -> dict[str, Counter]:
    return {
        piece: sum((Counter(c) for c in keys.values()), Counter())
        for piece, keys in backend.stats[graph].items()
    }


def _prep_pieces(backend) -> list[str]:
    return [p.name for p in backend.plans[0].captured if fxsplit.ATTN_PREP in p.regions]


def _net() -> RegionMlp:
    """:class:`tests.nets.RegionMlp` (width 16, region MID) on the device, seeded weights."""
    torch.manual_seed(0)
    return RegionMlp(width=16, region=MID).eval().requires_grad_(False).to("cuda")


def test_v1_default_plan_matches_eager_across_changing_sizes():
    batches = [2, 2, 4, 4, 3, 2, 5, 4, 2, 3, 4, 2]
    expected = _ds_eager(batches)
    model, backend = _ds_compiled(capture_sizes=[2, 4])
    got = _ds_decode(model, batches)
    assert backend.runtimes[0].mode == "cuda"
    assert not _prep_pieces(backend)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert _close(a, b), step
    captured = len(backend.plans[0].captured)
    assert counters.snapshot()["captures"] == 2 * captured
    assert counters.snapshot()["replays"] > 0


def test_v1_prep_captured_with_trust_gives_wrong_output():
    batches = [2] * 5
    expected = _ds_eager(batches)
    model, backend = _ds_compiled(**PREP_CAPTURED, input_binding="trust")
    got = _ds_decode(model, batches)
    assert _prep_pieces(backend)
    assert _close(got[0], expected[0]) and _close(got[1], expected[1])
    assert not all(_close(a, b) for a, b in zip(got[2:], expected[2:], strict=True))
    assert counters.snapshot()["replays"] > 0  # the garbage comes from replays


def test_v1_prep_captured_strict_refuses_fresh_metadata():
    model, backend = _ds_compiled(**PREP_CAPTURED, input_binding="strict")
    runner = ds.DecodeRunner(CFG, 2, device="cuda")
    with torch.no_grad():
        model(*runner.step(2))
        model(*runner.step(2))
        step = runner.step(2)
        with pytest.raises(BindingError) as info:
            model(*step)
    message = str(info.value)
    assert any(re.search(rf"\b{name}\b", message) for name in _prep_pieces(backend)), message
    specs = [s for p in backend.runtimes[0].pieces for s in p.specs if s.kind == RUNNER]
    assert any(s.name in message and s.source in message for s in specs), message
    addresses = set(re.findall(r"0x[0-9a-f]+", message))
    assert len(addresses) == 2 and {f"0x{t.data_ptr():x}" for t in step} & addresses
    assert counters.snapshot()["captures"] > 0 and counters.snapshot()["replays"] == 0


def test_v2_persistent_buffers_prep_captured_matches_eager():
    batches = [2, 3, 4, 2, 3, 4, 4, 2]
    expected = _ds_eager(batches, persistent=True)
    model, backend = _ds_compiled(runner="v2")
    assert backend.config.binding == "strict"
    got = _ds_decode(model, batches, persistent=True)
    assert _prep_pieces(backend)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert _close(a, b), step
    for piece in backend.runtimes[0].pieces:
        runner_inputs = {s.name for s in piece.specs if s.kind == RUNNER}
        assert not runner_inputs & set(piece.stats.copies_by_input), piece.name
    assert counters.snapshot()["replays"] == 2 * len(backend.plans[0].captured)


def test_one_capture_per_piece_per_size_then_replays():
    net = _net()
    backend = fxsplit.Backend(eager_regions=[MID])  # capture="auto": CUDA tensors -> "cuda"
    model = torch.compile(net, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for i, n in enumerate([2, 2, 2, 4, 4, 4, 2, 4]):
            x = torch.randn(n, 16, device="cuda") + i
            assert _close(model(x), net(x)), i
    assert backend.runtimes[0].mode == "cuda"
    assert [p.kind for p in backend.plans[0].pieces] == ["captured", "eager", "captured"]
    for piece, keys in backend.stats["graph_0"].items():
        captured = [c for c in keys.values() if c.get("captures")]
        assert len(captured) == 2, piece
        assert all(c["captures"] == 1 and c["replays"] == 2 for c in captured), piece
    snap = counters.snapshot()
    assert snap["captures"] == 4 and snap["replays"] == 8


def test_graphs_of_one_backend_share_one_pool():
    net = _net()
    backend, other = fxsplit.Backend(eager_regions=[MID]), fxsplit.Backend(eager_regions=[MID])
    model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
    model_other = torch.compile(_net(), backend=other, dynamic=False, fullgraph=True)
    with torch.no_grad():
        for n in (2, 3, 2, 3, 2, 3):
            x = torch.randn(n, 16, device="cuda")
            assert _close(model(x), net(x))
            model_other(x)
    pools = [rt.pool for rt in backend.runtimes]
    assert len(pools) == 2 and pools[0] is not None and pools[0] is pools[1]
    assert other.runtimes[0].pool is not pools[0]
    assert sum(t["replays"] for t in _piece_totals(backend, "graph_1").values()) == 2


@torch.library.custom_op("fxsplit_cuda::syncs", mutates_args=())
def syncs(x: torch.Tensor) -> torch.Tensor:
    """Reads a device value on the host inside its kernel: illegal under capture."""
    return x * float(x.abs().max().item() > -1)


@syncs.register_fake
def _(x):
    return torch.empty_like(x)


class _SyncNet(RegionMlp):
    """:class:`tests.nets.RegionMlp` whose first piece calls ``syncs``: its capture fails."""

    def forward(self, x):
        h = torch.ops.fxsplit_cuda.syncs(self.a(x))
        with fxsplit.region(self.region):
            h = self.mid(h)
        return self.b(h)


def test_failed_capture_leaves_the_pool_usable_for_every_other_piece():
    torch.manual_seed(0)
    net = _SyncNet(width=16, region=MID).eval().requires_grad_(False).to("cuda")
    backend = fxsplit.Backend(eager_regions=[MID])
    model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 16, device="cuda")
            assert _close(model(x), net(x))
    pieces = backend.runtimes[0].pieces
    failed = [p for p in pieces if p.failed is not None]
    assert len(failed) == 1 and "capturing" in failed[0].failed.lower(), failed[0].failed
    assert "previous error" not in failed[0].failed
    replayed = [p for p in pieces if p.failed is None]
    assert replayed and all(
        sum(k["replays"] for k in p.stats.per_key.values()) >= 3 for p in replayed
    )


def test_recapture_after_weights_move_and_after_backend_reset():
    net = _net()
    backend = fxsplit.Backend(eager_regions=[MID])
    model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 16, device="cuda"))
        net.load_state_dict({k: v.clone() * 0.5 for k, v in net.state_dict().items()}, assign=True)
        for _ in range(4):
            x = torch.randn(4, 16, device="cuda")
            assert _close(model(x), net(x))
        assert counters.snapshot()["recaptures"] == 1
        torch._dynamo.reset()
        counters.reset()
        model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
        for _ in range(4):
            x = torch.randn(4, 16, device="cuda")
            assert _close(model(x), net(x))
    assert counters.snapshot()["replays"] > 0
    assert all(p.failed is None for p in backend.runtimes[0].pieces)


def test_inductor_pieces_capture_replay_and_match_eager(tmp_path):
    """compile_pieces="inductor" under real CUDA graphs: the distinct captured pieces are
    compiled, captured and replayed, and the output equals eager's."""
    batches = [2, 3, 2, 3, 2, 3]
    expected = _ds_eager(batches, persistent=True)
    model, backend = _ds_compiled(
        runner="v2", compile_pieces="inductor", cache_dir=str(tmp_path), on_capture_error="raise"
    )
    got = _ds_decode(model, batches, persistent=True)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert _close(a, b), step
    records = [r for split in backend.compiled for r in split.compiled_pieces or ()]
    compiled = {name for r in records if r.outcome != "eager" for name in r.pieces}
    assert compiled, [(r.pieces, r.reason) for r in records]
    replayed = {piece for piece, totals in _piece_totals(backend).items() if totals["replays"]}
    assert compiled <= replayed, (compiled, replayed)


def test_an_output_read_after_a_later_replay_overwrote_it_raises_naming_the_fix():
    """Outputs are handed out over the pool's memory (no copy); one still held when a later
    replay rewrites that memory raises on read, through torch's own storage access check."""
    net = _net()
    model = torch.compile(net, backend=fxsplit.Backend(eager_regions=[MID]), dynamic=False)
    with torch.no_grad():
        kept = [model(torch.randn(2, 16, device="cuda")) for _ in range(4)]
        last = kept[-1].clone()
        with pytest.raises(RuntimeError, match="clone_outputs"):
            kept[1].sum().item()
        with pytest.raises(fxsplit.StaleOutputError):
            model(kept[1])
        assert torch.equal(kept[-1], last)  # the newest is whole
    assert counters.snapshot()["replays"] > 0


def test_steady_loop_rebinding_the_output_reads_no_stale_value():
    net = _net()
    model = torch.compile(net, backend=fxsplit.Backend(eager_regions=[MID]), dynamic=False)
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(2, 16, device="cuda")
            out = model(x)
            assert _close(out, net(x)), step
    assert counters.snapshot()["replays"] > 0


def test_a_piece_out_of_capture_order_is_recaptured_and_matches_eager():
    net = KeyFree(region=MID).to("cuda")
    backend = fxsplit.Backend(eager_regions=[MID], warmup_runs=0)
    model = torch.compile(net, backend=backend, dynamic=True)
    with torch.no_grad():
        for step, n in enumerate([4, 4, 8, 8, 4, 8, 4]):
            x = torch.randn(n, 16, device="cuda")
            got, want = model(x), net(x)
            assert all(_close(g, w) for g, w in zip(got, want, strict=True)), step
    totals = _piece_totals(backend)
    assert sum(t["reorders"] for t in totals.values()) >= 1
    assert sum(t["replays"] for t in totals.values()) > 0


def test_a_capture_refused_after_it_succeeded_leaves_the_pool_usable():
    """An output that requires grad refuses the capture after capture_end; the pool's keeper
    graph keeps the pool, so the next piece still captures."""

    class Grads(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))  # requires grad

        def forward(self, x):
            with torch.enable_grad():
                y = x @ self.w  # requires grad inside the piece: its capture is refused
            with fxsplit.region(MID):
                z = y.detach().sin()
            return z * 2

    net = Grads().to("cuda")
    backend = fxsplit.Backend(eager_regions=[MID])
    model = torch.compile(net, backend=backend, dynamic=False)
    with torch.no_grad(), pytest.warns(UserWarning, match="requires grad"):
        for _ in range(4):
            x = torch.randn(2, 16, device="cuda")
            assert _close(model(x), net(x))
    totals = _piece_totals(backend)
    assert totals["piece_0"]["captures"] == 0 and totals["piece_2"]["replays"] > 0
