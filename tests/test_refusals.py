"""A piece the runtime will not capture says so: ``on_capture_error="raise"`` raises on the first
such call with the reason; ``"fallback"`` runs it uncaptured, counts the reason per piece in
``Backend.stats`` (``{"refused": {reason: calls}}``) and warns once per reason."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.passes import mark

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

D = 4
MID = "refusal_mid"


def _writes_a_reads_b(a, b):
    """piece_0 writes ``a`` and reads ``b``: handing views of one tensor as both cannot be kept
    by two static copies."""
    a.mul_(0.5)
    h = b.sin() + a
    with fxsplit.region(MID):
        h = h.cos()
    return h * 2


def _shared_views(step):
    base = torch.randn(2 * D, D, generator=torch.Generator().manual_seed(step))
    return base[:D], base[D:]


def _apart(step):
    a, b = _shared_views(step)
    return a.clone(), b.clone()


def _compile(fn, dynamic=None, **options):
    options.setdefault("capture", "emulate")
    backend = fxsplit.Backend(eager_regions=[MID], **options)
    return torch.compile(fn, backend=backend, dynamic=dynamic), backend


def _split(x):
    h = x.sin() * 2
    with fxsplit.region(MID):
        h = h.cos()
    return h + 1


def _refused(backend, piece="piece_0"):
    return backend.stats["graph_0"][piece].get("refused", {})


def test_raise_refuses_inputs_sharing_storage_with_a_written_input_on_the_first_such_call():
    model, _ = _compile(_writes_a_reads_b, on_capture_error="raise")
    with torch.no_grad():
        model(*_apart(0))  # warm-up
        model(*_apart(1))  # capture
        with pytest.raises(fxsplit.CaptureRefusedError, match="share storage"):
            model(*_shared_views(2))


def test_fallback_counts_and_warns_once_for_inputs_sharing_storage():
    model, backend = _compile(_writes_a_reads_b)
    with torch.no_grad(), pytest.warns(UserWarning, match="share storage") as seen:
        for step in range(6):
            a, b = _shared_views(step) if step >= 2 else _apart(step)
            a_e, b_e = (t.clone() for t in (a, b))
            if step >= 2:  # keep the eager copy aliased like the compiled one
                base = torch.cat([a_e, b_e])
                a_e, b_e = base[:D], base[D:]
            assert torch.equal(model(a, b), _writes_a_reads_b(a_e, b_e)), step
    assert len([w for w in seen if "share storage" in str(w.message)]) == 1
    assert sum(_refused(backend).values()) == 4
    keys = backend.stats["graph_0"]["piece_0"]
    assert sum(c.get("captures", 0) for k, c in keys.items() if k != "refused") == 1


def test_raise_refuses_a_piece_the_aliasing_analysis_cannot_run_on(monkeypatch):
    from fxsplit.facts import aliasing

    def broken():
        raise ImportError("no collector in this torch")

    monkeypatch.setattr(aliasing, "_collector", broken)
    model, _ = _compile(_split, on_capture_error="raise")
    with torch.no_grad(), pytest.raises(fxsplit.CaptureRefusedError, match="aliasing analysis"):
        model(torch.randn(3))


def test_raise_reports_an_output_that_requires_grad():
    """Where the graph's example values do not say what autograd tracks (the mark pass then
    leaves the product captured), the capture itself refuses an output that requires grad."""

    class Grads(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(D, D))

        def forward(self, x):
            with torch.enable_grad():
                y = x @ self.w  # leaves its piece requiring grad
            with fxsplit.region(MID):
                z = y.detach().sin()
            return z * 2

    model, _ = _compile(Grads(), on_capture_error="raise")
    with (
        mock.patch.object(mark, "_autograd_tracked", lambda value, grad_at_entry: False),
        torch.no_grad(),
    ):
        model(torch.randn(2, D))  # warm-up
        with pytest.raises(RuntimeError, match="requires grad"):
            model(torch.randn(2, D))


def test_raise_refuses_when_max_captured_keys_is_reached():
    model, _ = _compile(
        _split, dynamic=True, on_capture_error="raise", max_captured_keys=1, warmup_runs=0
    )
    with torch.no_grad():
        model(torch.randn(2, D))
        with pytest.raises(fxsplit.CaptureRefusedError, match="max_captured_keys=1"):
            model(torch.randn(3, D))


def test_raise_refuses_grad_enabled_inputs_that_require_grad():
    model, _ = _compile(_split, on_capture_error="raise")
    with pytest.raises(fxsplit.CaptureRefusedError, match="requires grad"):
        model(torch.randn(2, D, requires_grad=True))


def test_fallback_never_warns_for_pieces_that_capture():
    model, backend = _compile(_split)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            model(torch.randn(2, D))
    assert not _refused(backend)


def test_inputs_sharing_storage_that_the_piece_only_reads_are_captured():
    def f(x, y, z):
        z.add_(1)
        h = x * 2 + y.sum()
        with fxsplit.region(MID):
            h = h.cos()
        return h

    model, backend = _compile(f)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(4):
            base = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
            z, z_e = torch.zeros(4, 3), torch.zeros(4, 3)
            assert torch.equal(model(base, base[1:], z), f(base, base[1:], z_e))
            assert torch.equal(z, z_e)
    assert not _refused(backend) and sum(
        c.get("replays", 0) for c in backend.stats["graph_0"]["piece_0"].values()
    )


def test_grad_enabled_inputs_that_require_grad_are_counted_per_piece():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, D)

        def forward(self, x):
            h = self.a(x)
            with fxsplit.region(MID):
                h = h.cos()
            return h * 2

    model, backend = _compile(M())
    with pytest.warns(fxsplit.FxsplitWarning, match="requires grad"):
        for _ in range(4):
            model(torch.randn(2, D))
    for piece in ("piece_0", "piece_2"):
        assert sum(_refused(backend, piece).values()) == 4, backend.stats


def test_capture_off_never_raises_a_capture_refusal():
    """Strict binding checked with capture off (runner v2) captures nothing to refuse."""
    model, backend = _compile(
        _split,
        dynamic=True,
        capture="off",
        runner="v2",
        on_capture_error="raise",
        max_captured_keys=1,
    )
    assert backend.config.binding == "strict"
    with torch.no_grad():
        for n in (2, 2, 3, 3, 4):
            x = torch.randn(n, D)
            assert torch.equal(model(x), _split(x))
    assert backend.runtimes and backend.runtimes[0].mode == "check"


def test_verify_compares_bit_for_bit_in_the_emulator_and_within_tolerance_on_cuda():
    from fxsplit.runtime.piece.verify import same as _same

    a = torch.tensor([1.0, 2.0, float("nan")])
    b = a.clone()
    b[0] = torch.nextafter(b[0], torch.tensor(2.0))  # one ulp away
    assert _same(a, a.clone(), exact=True) and not _same(a, b, exact=True)
    assert _same(a, b, exact=False)  # a graph-launched kernel may round differently on CUDA
    assert not _same(a, a + 1e-3, exact=False)


@torch.library.custom_op("fxsplit_refusal::noisy_sync", mutates_args=())
def _noisy_sync(x: torch.Tensor) -> torch.Tensor:
    """Draws random numbers, then reads a value on the host (illegal under capture); no tag
    says it draws random numbers."""
    noise = torch.rand_like(x)
    return x * x.abs().max().item() + noise


@_noisy_sync.register_fake
def _(x):
    return torch.empty_like(x)


def _noisy_split(x):
    h = torch.ops.fxsplit_refusal.noisy_sync(x.sin()) * 2
    with fxsplit.region(MID):
        h = h.cos()
    return h + 1


def test_a_failed_capture_falling_back_draws_eagers_random_numbers():
    """piece_0's capture fails inside a custom op after it drew random numbers; the fallback
    run must draw what eager draws (the failed capture's draws undone), on that call and after
    (no manual_seed between calls, as in a serving loop)."""
    model, backend = _compile(_noisy_split)
    x = torch.randn(4, D)
    torch.manual_seed(0)
    with torch.no_grad():
        want = [_noisy_split(x) for _ in range(4)]
    torch.manual_seed(0)
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitRuntimeWarning, match="runs uncaptured"):
        got = [model(x).clone() for _ in range(4)]
    assert _refused(backend)  # piece_0's capture failed and fell back
    assert sum(c.get("replays", 0) for c in backend.stats["graph_0"]["piece_2"].values()) > 0
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), (step, (g - w).abs().max().item())
