"""The capture runtime's core checks, one test body on every device: the CPU emulator
(``capture="emulate"``, always) and a real CUDA/HIP device (``capture="cuda"``, where torch sees
one), as PyTorch's ``instantiate_device_type_tests`` runs one class on CPU and CUDA. A CUDA test
can then no longer go untested until a GPU appears: what the emulator must do as CUDA does is
asserted here on both.

The emulator replays bit for bit; on CUDA outputs are compared with a tight tolerance, since a
kernel launched from a graph may use another cuBLAS workspace than the eager launch. Stale reads
(the field's bug) give errors far above it. Replay speed is not asserted here (see
``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit import counters
from fxsplit.models import deepseek_v4 as ds
from fxsplit.passes import mark
from fxsplit.runtime.inputs.binding import RUNNER, BindingError
from fxsplit.runtime.memory.output_lifetime import can_swap
from tests.nets import KeyFree, RegionMlp

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CFG = ds.DeepseekV4Config()
PREP_CAPTURED = {"eager_regions": [fxsplit.SPARSE_INDEXER, fxsplit.ATTENTION]}
METADATA = ("positions", "slot_mapping", "block_table", "seq_lens")
MID = "eager_mid"
TOL = {"rtol": 1e-5, "atol": 1e-5}


@dataclass(frozen=True)
class Device:
    """Where one run of a test body runs: the tensors' device and the capture mode."""

    name: str  # "cpu" or "cuda"
    capture: str  # "emulate" or "cuda"

    def close(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Bit for bit in the emulator; within :data:`TOL` on CUDA."""
        if self.capture == "emulate":
            return torch.equal(a, b)
        return a.shape == b.shape and torch.allclose(a, b, **TOL)

    def sync(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()


@pytest.fixture(
    params=[
        pytest.param(Device("cpu", "emulate"), id="emulate"),
        pytest.param(
            Device("cuda", "cuda"),
            id="cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"
                ),
            ],
        ),
    ]
)
def device(request) -> Device:
    """Each test body once per device."""
    return request.param


def _ds_compiled(device: Device, **options):
    backend = fxsplit.Backend(capture=device.capture, **options)
    model = ds.build(CFG).to(device.name)
    return torch.compile(model, backend=backend, dynamic=True, fullgraph=True), backend


def _ds_decode(device: Device, model, batches, persistent=False):
    runner = ds.DecodeRunner(CFG, max(batches), persistent=persistent, device=device.name)
    with torch.no_grad():
        out = ds.run_decode(model, runner, batches)
    device.sync()
    return out


def _ds_eager(device: Device, batches, persistent=False):
    return _ds_decode(device, ds.build(CFG).to(device.name), batches, persistent)


def _piece_totals(backend, graph="graph_0") -> dict[str, Counter]:
    return {
        piece: sum((Counter(c) for c in keys.values()), Counter())
        for piece, keys in backend.stats[graph].items()
    }


def _prep_pieces(backend) -> list[str]:
    return [p.name for p in backend.plans[0].captured if fxsplit.ATTN_PREP in p.regions]


def _net(device: Device) -> RegionMlp:
    """:class:`tests.nets.RegionMlp` (width 16, region MID) on the device, seeded weights."""
    torch.manual_seed(0)
    return RegionMlp(width=16, region=MID).eval().requires_grad_(False).to(device.name)


def _backend(device: Device, **options) -> fxsplit.Backend:
    return fxsplit.Backend(capture=device.capture, eager_regions=[MID], **options)


def test_v1_default_plan_matches_eager_across_changing_sizes(device):
    batches = [2, 2, 4, 4, 3, 2, 5, 4, 2, 3, 4, 2]
    expected = _ds_eager(device, batches)
    model, backend = _ds_compiled(device, capture_sizes=[2, 4])
    got = _ds_decode(device, model, batches)
    assert backend.runtimes[0].mode == device.capture
    assert not _prep_pieces(backend)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert device.close(a, b), step
    captured = len(backend.plans[0].captured)
    assert counters.snapshot()["captures"] == 2 * captured
    assert counters.snapshot()["replays"] > 0


def test_v1_prep_captured_with_trust_gives_wrong_output(device):
    batches = [2] * 5
    expected = _ds_eager(device, batches)
    model, backend = _ds_compiled(device, **PREP_CAPTURED, input_binding="trust")
    got = _ds_decode(device, model, batches)
    assert _prep_pieces(backend)
    assert device.close(got[0], expected[0]) and device.close(got[1], expected[1])
    assert not all(device.close(a, b) for a, b in zip(got[2:], expected[2:], strict=True))
    assert counters.snapshot()["replays"] > 0  # the garbage comes from replays


def test_v1_prep_captured_strict_refuses_fresh_metadata(device):
    model, backend = _ds_compiled(device, **PREP_CAPTURED, input_binding="strict")
    runner = ds.DecodeRunner(CFG, 2, device=device.name)
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


def test_v2_persistent_buffers_prep_captured_matches_eager(device):
    batches = [2, 3, 4, 2, 3, 4, 4, 2]
    expected = _ds_eager(device, batches, persistent=True)
    model, backend = _ds_compiled(device, runner="v2")
    assert backend.config.binding == "strict"
    got = _ds_decode(device, model, batches, persistent=True)
    assert _prep_pieces(backend)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert device.close(a, b), step
    for piece in backend.runtimes[0].pieces:
        runner_inputs = {s.name for s in piece.specs if s.kind == RUNNER}
        assert not runner_inputs & set(piece.stats.copies_by_input), piece.name
    assert counters.snapshot()["replays"] == 2 * len(backend.plans[0].captured)


def test_one_capture_per_piece_per_size_then_replays(device):
    net = _net(device)
    backend = _backend(device)
    model = torch.compile(net, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for i, n in enumerate([2, 2, 2, 4, 4, 4, 2, 4]):
            x = torch.randn(n, 16, device=device.name) + i
            assert device.close(model(x), net(x)), i
    assert backend.runtimes[0].mode == device.capture
    assert [p.kind for p in backend.plans[0].pieces] == ["captured", "eager", "captured"]
    for piece, keys in backend.stats["graph_0"].items():
        captured = [c for c in keys.values() if c.get("captures")]
        assert len(captured) == 2, piece
        assert all(c["captures"] == 1 and c["replays"] == 2 for c in captured), piece
    snap = counters.snapshot()
    assert snap["captures"] == 4 and snap["replays"] == 8


def test_capture_auto_captures_cuda_graphs_on_a_cuda_device(device):
    """``capture="auto"`` (the default) is ``"cuda"`` for a graph on a CUDA device and captures
    nothing on a CPU (without the emulator)."""
    net = _net(device)
    backend = fxsplit.Backend(eager_regions=[MID])
    model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 16, device=device.name)
            assert device.close(model(x), net(x))
    on_cuda = device.name == "cuda"
    assert backend.runtimes[0].mode == "cuda" if on_cuda else not backend.runtimes
    assert (counters.snapshot()["replays"] > 0) == on_cuda


def test_graphs_of_one_backend_share_one_pool(device):
    net = _net(device)
    backend, other = _backend(device), _backend(device)
    model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
    model_other = torch.compile(_net(device), backend=other, dynamic=False, fullgraph=True)
    with torch.no_grad():
        for n in (2, 3, 2, 3, 2, 3):
            x = torch.randn(n, 16, device=device.name)
            assert device.close(model(x), net(x))
            model_other(x)
    pools = [rt.pool for rt in backend.runtimes]
    assert len(pools) == 2 and pools[0] is not None and pools[0] is pools[1]
    assert other.runtimes[0].pool is not pools[0]
    assert sum(t["replays"] for t in _piece_totals(backend, "graph_1").values()) == 2


@torch.library.custom_op("fxsplit_devices::syncs", mutates_args=())
def syncs(x: torch.Tensor) -> torch.Tensor:
    """Reads a device value on the host inside its kernel: illegal under capture."""
    return x * float(x.abs().max().item() > -1)


@syncs.register_fake
def _(x):
    return torch.empty_like(x)


class _SyncNet(RegionMlp):
    """:class:`tests.nets.RegionMlp` whose first piece calls ``syncs``: its capture fails."""

    def forward(self, x):
        h = torch.ops.fxsplit_devices.syncs(self.a(x))
        with fxsplit.region(self.region):
            h = self.mid(h)
        return self.b(h)


def _sync_net(device: Device) -> _SyncNet:
    torch.manual_seed(0)
    return _SyncNet(width=16, region=MID).eval().requires_grad_(False).to(device.name)


def test_failed_capture_leaves_the_pool_usable_for_every_other_piece(device):
    net = _sync_net(device)
    backend = _backend(device)
    model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitRuntimeWarning, match="runs uncaptured"):
        for _ in range(5):
            x = torch.randn(4, 16, device=device.name)
            assert device.close(model(x), net(x))
    pieces = backend.runtimes[0].pieces
    failed = [p for p in pieces if p.failed is not None]
    assert len(failed) == 1 and "capturing" in failed[0].failed.lower(), failed[0].failed
    assert "previous error" not in failed[0].failed
    replayed = [p for p in pieces if p.failed is None]
    assert replayed and all(
        sum(k["replays"] for k in p.stats.per_key.values()) >= 3 for p in replayed
    )


def test_after_a_failed_capture_the_devices_random_numbers_draw_as_before(device):
    """A failed capture leaves the device's default generator in its capturing state (torch
    2.11's CUDA: ``capture_end`` raises before the generator's epilogue; the emulator does the
    same): every later draw outside a capture raised "Offset increment outside graph capture
    encountered unexpectedly" until a capture completed. fxsplit closes that state itself."""
    net = _sync_net(device)
    backend = _backend(device)
    model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitRuntimeWarning, match="capturing"):
        model(torch.ones(4, 16, device=device.name))
        model(torch.ones(4, 16, device=device.name))  # the capture that fails
    assert any(p.failed for p in backend.runtimes[0].pieces)
    torch.manual_seed(7)
    drawn = torch.randn(8, device=device.name)
    torch.manual_seed(7)
    assert torch.equal(torch.randn(8, device=device.name), drawn)


def test_recapture_after_weights_move_and_after_backend_reset(device):
    net = _net(device)
    backend = _backend(device)
    model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 16, device=device.name))
        net.load_state_dict({k: v.clone() * 0.5 for k, v in net.state_dict().items()}, assign=True)
        for _ in range(4):
            x = torch.randn(4, 16, device=device.name)
            assert device.close(model(x), net(x))
        assert counters.snapshot()["recaptures"] == 1
        torch._dynamo.reset()
        counters.reset()
        model = torch.compile(net, backend=backend, dynamic=False, fullgraph=True)
        for _ in range(4):
            x = torch.randn(4, 16, device=device.name)
            assert device.close(model(x), net(x))
    assert counters.snapshot()["replays"] > 0
    assert all(p.failed is None for p in backend.runtimes[0].pieces)


@pytest.mark.slow
def test_inductor_pieces_capture_replay_and_match_eager(device, tmp_path):
    """compile_pieces="inductor": the distinct captured pieces are compiled, captured and
    replayed, and the output equals eager's (within TOL: Inductor's kernels reorder
    reductions)."""
    batches = [2, 3, 2, 3, 2, 3]
    expected = _ds_eager(device, batches, persistent=True)
    model, backend = _ds_compiled(
        device,
        runner="v2",
        compile_pieces="inductor",
        cache_dir=str(tmp_path),
        on_capture_error="raise",
    )
    got = _ds_decode(device, model, batches, persistent=True)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5), step
    records = [r for split in backend.compiled for r in split.compiled_pieces or ()]
    compiled = {name for r in records if r.outcome != "eager" for name in r.pieces}
    assert compiled, [(r.pieces, r.reason) for r in records]
    replayed = {piece for piece, totals in _piece_totals(backend).items() if totals["replays"]}
    assert compiled <= replayed, (compiled, replayed)


@pytest.mark.skipif(not can_swap(), reason="torch 2.11 invalidates a kept output instead")
def test_an_output_kept_past_later_replays_keeps_its_values_and_may_go_back_in(device):
    """Outputs are handed out over the pool's memory (no copy); one still held when a later
    replay rewrites that memory moves to memory of its own first, on CUDA as in the emulator
    (before, CUDA made it raise on read where the emulator kept its values)."""
    net = _net(device)
    model = torch.compile(net, backend=_backend(device), dynamic=False)
    with torch.no_grad():
        xs = [torch.randn(2, 16, device=device.name) for _ in range(4)]
        kept = [model(x) for x in xs]
        for x, out in zip(xs, kept, strict=True):
            assert device.close(out, net(x))
        assert device.close(model(kept[1]), net(net(xs[1])))
    assert counters.snapshot()["replays"] > 0


@pytest.mark.skipif(can_swap(), reason="this torch moves a kept output out of the pool instead")
def test_where_torch_cannot_move_a_storage_a_kept_output_raises_naming_the_fix(device):
    """torch 2.11: a kept output a later replay overwrote raises when read (torch's storage
    access check) or handed back in (``StaleOutputError``)."""
    net = _net(device)
    model = torch.compile(net, backend=_backend(device), dynamic=False)
    with torch.no_grad():
        kept = [model(torch.randn(2, 16, device=device.name)) for _ in range(4)]
        last = kept[-1].clone()
        with pytest.raises(RuntimeError, match="clone_outputs"):
            kept[1].sum().item()
        with pytest.raises(fxsplit.StaleOutputError):
            model(kept[1])
        assert torch.equal(kept[-1], last)  # the newest is whole
    assert counters.snapshot()["replays"] > 0


def test_steady_loop_rebinding_the_output_reads_no_stale_value(device):
    net = _net(device)
    model = torch.compile(net, backend=_backend(device), dynamic=False)
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(2, 16, device=device.name)
            out = model(x)
            assert device.close(out, net(x)), step
    assert counters.snapshot()["replays"] > 0


def test_a_piece_out_of_capture_order_is_recaptured_and_matches_eager(device):
    net = KeyFree(region=MID).to(device.name)
    backend = _backend(device, warmup_runs=0)
    model = torch.compile(net, backend=backend, dynamic=True)
    with torch.no_grad():
        for step, n in enumerate([4, 4, 8, 8, 4, 8, 4]):
            x = torch.randn(n, 16, device=device.name)
            got, want = model(x), net(x)
            assert all(device.close(g, w) for g, w in zip(got, want, strict=True)), step
    totals = _piece_totals(backend)
    assert sum(t["reorders"] for t in totals.values()) >= 1
    assert sum(t["replays"] for t in totals.values()) > 0


def test_a_capture_refused_after_it_succeeded_leaves_the_pool_usable(device):
    """An output that requires grad refuses the capture after it ended; the pool's keeper
    graph keeps the pool, so the next piece still captures. (The mark pass runs a result
    autograd tracks eagerly; patched out here, the capture itself must refuse it.)"""

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

    net = Grads().to(device.name)
    backend = _backend(device)
    model = torch.compile(net, backend=backend, dynamic=False)
    with (
        mock.patch.object(mark, "_autograd_tracked", lambda value, grad_at_entry: False),
        torch.no_grad(),
        pytest.warns(fxsplit.FxsplitRuntimeWarning, match="requires grad"),
    ):
        for _ in range(4):
            x = torch.randn(2, 16, device=device.name)
            assert device.close(model(x), net(x))
    totals = _piece_totals(backend)
    assert totals["piece_0"]["captures"] == 0 and totals["piece_2"]["replays"] > 0


def test_a_piece_that_launches_no_kernel_runs_as_its_python(device):
    """A graph of views and an ``empty`` allocation only (no eager piece to join): its capture
    holds no kernel (CUDA warns "The CUDA Graph is empty"), so the piece runs as its Python,
    silently, with no input copied; from then on its calls count nothing, as an eager piece's
    (the warm-up and the capture that found no kernel are its 2 uncaptured runs)."""

    def views(x):
        return x.t()[1:], torch.empty_like(x).view(-1)

    backend = fxsplit.Backend(capture=device.capture, eager_regions=[])
    model = torch.compile(views, backend=backend, dynamic=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            x = torch.randn(3, 4, device=device.name)
            got = model(x)
            assert got[0].data_ptr() == x.t()[1:].data_ptr()  # a view of the caller's x
            assert got[1].shape == (12,)
    (piece,) = backend.runtimes[0].pieces
    assert piece.failed is not None and "no kernel" in piece.failed
    snap = counters.snapshot()
    assert snap["replays"] == 0 and snap["input_copies"] == 0 and snap["uncaptured_runs"] == 2
