"""Tests of the CPU capture emulator (fxsplit.runtime.emulation.emulator). A replay runs the
recorded ops
again on the same device, so every value is compared bit for bit (``rtol=0, atol=0``)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from fxsplit.runtime.emulation.emulated_pool import EmulatedPool
from fxsplit.runtime.emulation.emulator import (
    LEFT_CAPTURING,
    CaptureError,
    EmulatedGraph,
    HostValueChangedError,
    MovedMemoryError,
    StateMovedError,
    call_opaque,
)


@torch.library.custom_op("fxsplit_emutest::scale_into", mutates_args=("out",))
def _scale_into(x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    out.copy_(x * scale)


@torch.library.custom_op("fxsplit_emutest::plus_one", mutates_args=())
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@torch.library.custom_op("fxsplit_emutest::syncs_inside", mutates_args=())
def _syncs_inside(x: torch.Tensor) -> torch.Tensor:
    n = int(x.sum().item() > 0)
    return x + n


@torch.library.custom_op("fxsplit_emutest::scaled_by_handle", mutates_args=())
def _scaled_by_handle(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    """A kernel reading a host handle, as vLLM's CPU linear reads its oneDNN handler."""
    return x * handle.item()


def _grad_ctx(mode: str):
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference":
        return torch.inference_mode()
    return contextlib.nullcontext()


def test_replay_sees_inplace_update_of_recorded_input():
    x = torch.randn(4, 8)
    g = EmulatedGraph()
    out = g.capture(lambda t: torch.sin(t) * 2 + 1, x)
    torch.testing.assert_close(out, torch.sin(x) * 2 + 1, rtol=0, atol=0)
    new = torch.randn(4, 8)
    x.copy_(new)
    g.replay()
    torch.testing.assert_close(out, torch.sin(new) * 2 + 1, rtol=0, atol=0)


def test_replay_reads_the_recorded_tensor_not_one_the_program_names_later():
    """Frozen addresses: after capture the program names another tensor; replay still reads the
    recorded one (a stale read for the program), refilled in place."""
    holder = {"t": torch.randn(4)}
    recorded = holder["t"]
    g = EmulatedGraph()
    out = g.capture(lambda: holder["t"] * 2)
    holder["t"] = torch.full((4,), 100.0)  # a fresh tensor: the graph never sees it
    recorded.copy_(torch.arange(4.0))
    g.replay()
    assert torch.equal(out, torch.arange(4.0) * 2)


def test_output_identity_kept_and_overwritten_by_next_replay():
    x = torch.ones(3)
    g = EmulatedGraph()
    out = g.capture(lambda t: t + 1, x)
    ptr = out.data_ptr()
    first = out  # a caller holding "the first result"
    snapshot = out.clone()
    x.fill_(10.0)
    g.replay()
    assert first is out and out.data_ptr() == ptr
    torch.testing.assert_close(first, torch.full((3,), 11.0), rtol=0, atol=0)
    assert not torch.equal(first, snapshot)


def test_results_of_one_opaque_call_that_view_one_another_still_do():
    """A unit recorded whole (a compiled piece) returning a tensor and views of it: moved into
    the pool, the views still view it, so a write through one reaches the others."""

    def unit(t):
        h = t * 2
        return h, h[1:], h.split([1, 2], dim=-1)[1]

    x = torch.ones(3, 3)
    g = EmulatedGraph()
    h, tail, half = g.capture(lambda t: call_opaque(unit, (t,)), x)
    tail.add_(1.0)
    half.mul_(10.0)
    assert h.untyped_storage().data_ptr() == tail.untyped_storage().data_ptr()
    assert torch.equal(h, torch.tensor([[2.0, 20, 20], [3, 30, 30], [3, 30, 30]]))
    x.fill_(2.0)
    g.replay()
    assert torch.equal(h, torch.full((3, 3), 4.0)) and torch.equal(half, torch.full((3, 2), 4.0))


def test_an_opaque_units_results_move_into_the_pool_unrecorded():
    """Moving an opaque unit's results into the pool allocates (the pool's first segment, the
    copy); that ran with the recorder on, so the segment's torch.empty became an op of the
    capture and its memory a block of the pool: a 20 MiB segment made to hold the 2 MiB one,
    held by the pool for ever (the teardown check found it: a dropped graph's memory still
    in use)."""
    x = torch.ones(3, 3)
    g = EmulatedGraph()
    out = g.capture(lambda t: call_opaque(lambda u: u * 2, (t,)), x)
    assert len(g.pool.segments) == 1 and g.pool.allocated_bytes == 512
    x.fill_(3.0)
    g.replay()
    assert torch.equal(out, torch.full((3, 3), 6.0))


def test_host_scalar_is_frozen_at_capture():
    cfg = {"n": 3}
    x = torch.arange(4.0)
    g = EmulatedGraph()
    out = g.capture(lambda t: t * cfg["n"] + t.shape[0], x)
    cfg["n"] = 5
    x.copy_(torch.ones(4))
    g.replay()
    torch.testing.assert_close(out, torch.full((4,), 3.0 + 4.0), rtol=0, atol=0)


def _branch(t):
    if t.sum() > 0:
        return t + 1
    return t - 1


ILLEGAL = [
    ("item", lambda t: t + t.sum().item(), "_local_scalar_dense (.item())"),
    ("cpu", lambda t: t.cpu() + 1, "cpu()"),
    ("to_cpu", lambda t: t.to("cpu") + 1, 'to("cpu")'),
    ("tolist", lambda t: t.tolist(), "tolist"),
    ("numpy", lambda t: t.numpy(), "numpy"),
    ("nonzero", lambda t: t.nonzero(), "aten::nonzero"),
    ("masked_select", lambda t: torch.masked_select(t, t > 0), "aten::masked_select"),
    ("bool_index", lambda t: t[t > 0], "boolean-mask indexing"),
    ("bool_index_assign", lambda t: t.clone().index_put_((t > 0,), t), "boolean-mask"),
    ("unique", lambda t: torch.unique(t), "unique"),
    ("one_hot", lambda t: F.one_hot((t > 0).long()), "one_hot (num_classes=-1)"),
    ("branch", _branch, "__bool__"),
    ("int", lambda t: t * int(t[0]), "__int__"),
    ("print", lambda t: print(t), "__repr__"),
    ("synchronize", lambda t: torch.cuda.synchronize(), "torch.cuda.synchronize"),
    ("pin_memory", lambda t: torch.empty(4, pin_memory=True), "pin_memory"),
    ("custom_op_body", lambda t: _syncs_inside(t), "aten::item"),
]


@pytest.mark.parametrize(("fn", "needle"), [c[1:] for c in ILLEGAL], ids=[c[0] for c in ILLEGAL])
def test_illegal_op_raises_capture_error_naming_it(fn, needle):
    x = torch.randn(8)
    g = EmulatedGraph()
    with pytest.raises(CaptureError, match="illegal during CUDA graph capture") as info:
        g.capture(lambda t: (t * 2, fn(t)), x)
    assert needle in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert not g.captured and g.num_ops == 0
    with pytest.raises(RuntimeError, match="before a successful capture"):
        g.replay()
    # The graph is reusable after the failure.
    out = g.capture(lambda t: t * 2, x)
    g.replay()
    torch.testing.assert_close(out, x * 2, rtol=0, atol=0)


def test_synchronize_patch_is_undone():
    owners = (torch.cuda, torch.cpu, torch.accelerator, torch.cuda.Stream, torch.cuda.Event)
    before = [vars(o).get("synchronize") for o in owners]
    with pytest.raises(CaptureError, match=r"torch\.accelerator\.synchronize"):
        EmulatedGraph().capture(lambda: torch.accelerator.synchronize())
    assert [vars(o).get("synchronize") for o in owners] == before


def test_capture_error_swallowed_by_fn_still_fails():
    def fn(t):
        with contextlib.suppress(CaptureError):
            t.sum().item()
        return t + 1

    g = EmulatedGraph()
    with pytest.raises(CaptureError, match="caught inside the captured function"):
        g.capture(fn, torch.randn(3))
    assert not g.captured


def test_other_errors_propagate_and_leave_no_record():
    def fn(t):
        t = t + 1
        raise ValueError("boom")

    g = EmulatedGraph()
    with pytest.raises(ValueError, match="boom"):
        g.capture(fn, torch.randn(3))
    assert not g.captured and g.num_ops == 0


def test_nested_capture_is_an_error():
    inner, outer = EmulatedGraph(), EmulatedGraph()

    def fn(t):
        with contextlib.suppress(CaptureError):
            inner.capture(lambda u: u + 1, t)
        return t * 2

    with pytest.raises(CaptureError, match="nested"):
        outer.capture(fn, torch.randn(2))
    assert not inner.captured and not outer.captured


def test_capture_twice_needs_reset_and_reset_frees():
    x = torch.randn(4)
    g = EmulatedGraph()
    out = g.capture(lambda t: (t + 1) * 2, x)
    with pytest.raises(RuntimeError, match="reset"):
        g.capture(lambda t: t, x)
    g.reset()
    assert g.num_ops == 0 and not g.captured
    g.capture(lambda t: t - 1, x)
    assert g.captured and torch.equal(out, (x + 1) * 2)


def test_the_record_holds_no_output_and_a_dropped_output_frees_its_block():
    """As in a CUDA pool, the graph keeps the memory's address, not the tensor: an output the
    program drops frees its block (a later capture may take it), the record still writes there."""
    x = torch.randn(1024)
    g = EmulatedGraph()
    out = g.capture(lambda t: (t + 1) * 2, x)
    held = g.pool.allocated_bytes
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None and g.captured
    assert g.pool.allocated_bytes < held


def test_legal_idioms_do_not_raise():
    x = torch.randn(6)

    def fn(t):
        y = t.to(t.device) * 2  # device-generic move: not a host copy in the emulator
        y[y < 0] = 0.0  # masked_fill path on CUDA: no sync
        idx = torch.nonzero_static(t > 0, size=6)
        return y, idx, F.one_hot(torch.tensor([0, 2]), num_classes=3)

    g = EmulatedGraph()
    y, _idx, oh = g.capture(fn, x)
    x.copy_(torch.randn(6))
    g.replay()
    torch.testing.assert_close(y, torch.clamp(x * 2, min=0), rtol=0, atol=0)
    torch.testing.assert_close(oh, F.one_hot(torch.tensor([0, 2]), num_classes=3), rtol=0, atol=0)


@pytest.mark.parametrize("op", ["topk", "split", "max", "sort", "chunk_cat"])
def test_multi_output_ops_replay(op):
    x = torch.randn(4, 6)
    fns = {
        "topk": lambda t: torch.topk(t, 3, dim=-1),
        "split": lambda t: [s * 2 for s in torch.split(t, [2, 4], dim=1)],
        "max": lambda t: torch.max(t, dim=1),
        "sort": lambda t: torch.sort(t, dim=0, descending=True),
        "chunk_cat": lambda t: torch.cat(t.chunk(3, dim=1)[::-1], dim=1),
    }
    fn = fns[op]
    g = EmulatedGraph()
    outs = g.capture(fn, x)
    for _ in range(3):
        x.copy_(torch.randn(4, 6))
        g.replay()
        expected = fn(x)
        got = [outs] if isinstance(outs, torch.Tensor) else list(outs)
        want = [expected] if isinstance(expected, torch.Tensor) else list(expected)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kv_cache_index_copy_is_replayed_with_recorded_index():
    cache = torch.zeros(8, 4)
    pos = torch.tensor([0, 1])  # per-step metadata, kept in a persistent buffer
    k = torch.randn(2, 4)

    def step(k, pos):
        cache.index_copy_(0, pos, k)
        return cache.sum(dim=0)

    g = EmulatedGraph()
    total = g.capture(step, k, pos)
    assert ("aten::index_copy_", "run") in g.actions
    first = cache[:2].clone()
    for p in (2, 4):
        pos.copy_(torch.tensor([p, p + 1]))
        k.copy_(torch.randn(2, 4))
        g.replay()
        torch.testing.assert_close(cache[p : p + 2], k, rtol=0, atol=0)
    torch.testing.assert_close(cache[:2], first, rtol=0, atol=0)  # earlier writes stay
    torch.testing.assert_close(total, cache.sum(dim=0), rtol=0, atol=0)


def test_custom_op_mutating_out_replays():
    x = torch.randn(5)
    out = torch.empty(5)
    g = EmulatedGraph()
    g.capture(lambda t, o: _scale_into(t, 3.0, o), x, out)
    assert g.actions == (("fxsplit_emutest::scale_into", "run"),)
    x.copy_(torch.randn(5))
    g.replay()
    torch.testing.assert_close(out, x * 3.0, rtol=0, atol=0)


def test_functional_custom_op_replays_into_recorded_output():
    x = torch.randn(5)
    g = EmulatedGraph()
    y = g.capture(lambda t: _plus_one(t) * 2, x)
    assert g.actions[0] == ("fxsplit_emutest::plus_one", "run+copy")
    x.copy_(torch.randn(5))
    g.replay()
    torch.testing.assert_close(y, (x + 1) * 2, rtol=0, atol=0)


def test_host_handle_read_inside_a_custom_op_is_frozen_and_checked_at_replay():
    x = torch.randn(5)
    handle = torch.tensor(3)  # a 0-dim int64 CPU tensor the capture did not make
    g = EmulatedGraph()
    y = g.capture(lambda t: _scaled_by_handle(t, handle) + 1, x)
    x.copy_(torch.randn(5))
    g.replay()
    torch.testing.assert_close(y, x * 3 + 1, rtol=0, atol=0)
    handle.fill_(4)
    with pytest.raises(HostValueChangedError, match=r"read as 3 at capture .* now holds 4"):
        g.replay()


def test_a_host_handle_given_new_memory_is_loud_at_replay_even_holding_the_same_value():
    """The handle is checked by its address as well as its value: a handle at another address
    is another object to the kernel (vLLM's oneDNN handler is a pointer), where a CUDA graph
    replays what it read at the capture's."""
    x = torch.randn(5)
    handle = torch.tensor(3)
    g = EmulatedGraph()
    y = g.capture(lambda t: _scaled_by_handle(t, handle) + 1, x)
    g.replay()
    torch.testing.assert_close(y, x * 3 + 1, rtol=0, atol=0)
    old = handle.untyped_storage()  # held, so the new memory cannot reuse its address
    handle.set_(torch.tensor(3))
    assert handle.data_ptr() != old.data_ptr()
    with pytest.raises(HostValueChangedError, match=r"read as 3 at capture .* holds 3 at another"):
        g.replay()


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda t: (t.sum() > 0).long(), "made by the capture"),
        (lambda t: torch.tensor(3.0).expand(()), "a float"),
        (lambda t: torch.tensor([3]), "not 0-dim"),
    ],
    ids=["made_by_capture", "float", "one_dim"],
)
def test_other_tensors_read_inside_a_custom_op_stand_for_device_tensors(make, why):
    x = torch.randn(5)
    g = EmulatedGraph()
    with pytest.raises(CaptureError, match="reads a device value on the host"):
        g.capture(lambda t: _scaled_by_handle(t, make(t)), x)
    assert not g.captured, why


def test_views_are_not_copied():
    x = torch.randn(4, 6)

    def fn(t):
        v = t.view(6, 4).t()  # views of the input
        row = v[0]
        return v, row, row * 2

    g = EmulatedGraph()
    v, row, doubled = g.capture(fn, x)
    actions = dict(g.actions)
    assert actions["aten::view"] == "skip:view"
    assert actions["aten::t"] == "skip:view"
    assert actions["aten::select.int"] == "skip:view"
    assert g.num_replayed_ops == 1 < g.num_ops
    assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    x.copy_(torch.randn(4, 6))
    g.replay()
    torch.testing.assert_close(doubled, x.view(6, 4).t()[0] * 2, rtol=0, atol=0)
    torch.testing.assert_close(row, x.view(6, 4).t()[0], rtol=0, atol=0)


def test_allocations_are_skipped_and_zeros_rerun():
    x = torch.randn(4)

    def fn(t):
        buf = torch.empty(8)
        buf[:4].copy_(t)
        acc = torch.zeros(4)
        acc.add_(t)
        return buf, acc

    g = EmulatedGraph()
    buf, acc = g.capture(fn, x)
    assert ("aten::empty.memory_format", "skip:alloc") in g.actions
    tail = buf[4:].clone()
    x.copy_(torch.randn(4))
    g.replay()
    g.replay()
    torch.testing.assert_close(buf[:4], x, rtol=0, atol=0)
    torch.testing.assert_close(
        buf[4:], tail, equal_nan=True, rtol=0, atol=0
    )  # memory keeps its contents
    torch.testing.assert_close(
        acc, x, rtol=0, atol=0
    )  # zeros re-ran: no accumulation across replays


def test_constant_tensor_is_restored_each_replay():
    x = torch.zeros(2)

    def fn(t):
        c = torch.tensor([1.0, 2.0])
        c.mul_(2)
        return t + c

    g = EmulatedGraph()
    out = g.capture(fn, x)
    for _ in range(3):
        g.replay()
        torch.testing.assert_close(out, torch.tensor([2.0, 4.0]), rtol=0, atol=0)


def test_random_ops_draw_fresh_numbers():
    x = torch.ones(64)
    g = EmulatedGraph()
    out = g.capture(lambda t: torch.rand_like(t) + F.dropout(t, 0.5, training=True), x)
    first = out.clone()
    g.replay()
    assert not torch.equal(out, first)


def test_a_failed_capture_leaves_the_default_generator_capturing_as_cuda_does():
    """torch 2.11's CUDA ``capture_end`` raises before the generator's capture epilogue: the
    default generator still counts itself as capturing, and every draw from it outside a
    capture raises until a capture completes or its state is closed. Other generators draw."""
    x = torch.ones(4)
    g = EmulatedGraph()
    with pytest.raises(CaptureError):
        g.capture(lambda t: t * t.sum().item(), x)
    with pytest.raises(RuntimeError, match=LEFT_CAPTURING):
        torch.randn(3)
    assert torch.rand(3, generator=torch.Generator().manual_seed(0)).shape == (3,)
    g.close_capture_state()
    torch.manual_seed(3)
    drawn = torch.randn(3)
    torch.manual_seed(3)
    assert torch.equal(torch.randn(3), drawn)


def test_a_completed_capture_ends_the_generators_capture_state():
    x = torch.ones(4)
    with pytest.raises(CaptureError):
        EmulatedGraph().capture(lambda t: t * t.sum().item(), x)
    out = EmulatedGraph().capture(lambda t: t + torch.rand_like(t), x)  # draws inside: fine
    assert out.shape == (4,) and torch.randn(2).shape == (2,)


def test_a_generator_other_than_the_default_one_must_be_registered():
    """As ``CUDAGraph.register_generator_state``: a capture drawing from a generator it was
    not given fails; one it was given advances on every replay."""
    generator = torch.Generator().manual_seed(0)
    x = torch.zeros(8)
    with pytest.raises(CaptureError, match="register_generator_state"):
        EmulatedGraph().capture(lambda t: t + torch.rand(8, generator=generator), x)
    g = EmulatedGraph(generators=(generator,))
    out = g.capture(lambda t: t + torch.rand(8, generator=generator), x)
    first = out.clone()
    g.replay()
    assert not torch.equal(out, first)


def test_a_record_without_a_kernel_is_empty():
    """Views, ``empty`` allocations and metadata changes launch no kernel: CUDA warns "The
    CUDA Graph is empty" for such a capture, and the emulator says so."""
    x = torch.ones(2, 3)
    g = EmulatedGraph()
    g.capture(lambda t: (t.t()[1:], torch.empty_like(t).view(-1)), x)
    assert g.captured and g.empty
    h = EmulatedGraph()
    h.capture(lambda t: t.t() * 2, x)
    assert not h.empty


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_matmul_softmax_layernorm_chain_matches_eager(mode):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    norm = torch.nn.LayerNorm(16)

    def block(t):
        h = lin(t)
        a = torch.softmax(h @ h.transpose(-1, -2) / 4.0, dim=-1)
        return norm(a @ h + t)

    static_x = torch.randn(2, 5, 16)
    g = EmulatedGraph()
    with _grad_ctx(mode):
        out = g.capture(block, static_x)
    for _ in range(4):
        new = torch.randn(2, 5, 16)
        with torch.no_grad():
            static_x.copy_(new)
            g.replay()
            expected = block(new)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_replay_inside_capture_is_recorded():
    x = torch.randn(3)
    inner = EmulatedGraph()
    y = inner.capture(lambda t: t + 1, x)
    outer = EmulatedGraph()
    z = outer.capture(lambda: (inner.replay(), y * 2)[1])
    x.fill_(1.0)
    outer.replay()
    torch.testing.assert_close(z, torch.full((3,), 4.0), rtol=0, atol=0)


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.unsqueeze_(0).squeeze_(0),
        lambda t: t.t_().t_(),
        lambda t: t.transpose_(0, 1).transpose_(0, 1),
        lambda t: t.as_strided_(t.shape, t.stride()),
    ],
)
def test_in_place_metadata_changes_are_not_replayed(change):
    def fn(x):
        t = x * 2
        change(t)
        return t.sum(0) + x

    x = torch.randn(3, 4)
    g = EmulatedGraph()
    out = g.capture(fn, x)
    assert any(action == "skip:metadata" for _, action in g.actions)
    for _ in range(3):
        x.copy_(torch.randn(3, 4))
        g.replay()
        assert torch.equal(out, fn(x))


@pytest.mark.parametrize("shape", [(4, 4), (3, 4)], ids=["square", "non_square"])
@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.t_(),
        lambda t: t.transpose_(0, 1),
        lambda t: t.as_strided_((t.shape[1], t.shape[0]), (1, t.shape[1])),
        lambda t: t.unsqueeze_(0),
    ],
    ids=["t_", "transpose_", "as_strided_", "unsqueeze_"],
)
def test_metadata_change_of_an_intermediate_replays_with_the_capture_layout(change, shape):
    """``y = x * 2; y.t_(); return y + 1``: the kernel writing ``y`` replays into ``y``'s memory
    with the layout it had when it ran; the output keeps the layout it had at the end of capture.
    (Before, replays wrote through the changed layout: wrong on a square ``x``, a shape error on
    a non-square one.)"""

    def fn(x):
        y = x * 2
        change(y)
        return y + 1, y

    x = torch.randn(*shape)
    g = EmulatedGraph()
    out, y_out = g.capture(fn, x)
    for step in range(3):
        x.copy_(torch.randn(*shape))
        g.replay()
        want, want_y = fn(x)
        assert out.shape == want.shape and torch.equal(out, want), step
        assert y_out.stride() == want_y.stride() and torch.equal(y_out, want_y), step


def test_graphs_sharing_a_pool_reuse_scratch_and_replays_out_of_order_overwrite():
    """Two graphs in one pool: the second capture's output lands in the first graph's scratch
    (freed when the first capture ended). Replays in capture order are right; replaying the first
    graph after the second overwrites the second's output, as in a shared CUDA pool."""
    pool = EmulatedPool()
    a, b = torch.randn(4096), torch.randn(4096)
    first, second = EmulatedGraph(pool), EmulatedGraph(pool)
    first_out = first.capture(lambda t: ((t + 1) * 3).sum(0, keepdim=True), a)
    second_out = second.capture(lambda t: t * 5, b)
    in_scratch = {blk.offset for seg in pool.segments for blk in seg.blocks if blk.ref}
    assert len(in_scratch) == 2  # first's output, second's output; first's scratch reused
    first.replay()
    second.replay()
    assert torch.equal(first_out, ((a + 1) * 3).sum(0, keepdim=True))
    assert torch.equal(second_out, b * 5)
    first.replay()  # out of capture order: its scratch write lands on second's output
    assert not torch.equal(second_out, b * 5)


def test_a_block_freed_during_capture_is_reused_within_the_same_capture():
    pool = EmulatedPool()
    g = EmulatedGraph(pool)

    seen = []

    def fn(t):
        u = t + 1
        seen.append(u.data_ptr())
        v = u * 2
        del u  # its block is free for w, as with the caching allocator
        w = v - 3
        seen.append(w.data_ptr())
        return w

    x = torch.randn(4096)
    out = g.capture(fn, x)
    assert seen[0] == seen[1]
    x.copy_(torch.randn(4096))
    g.replay()
    assert torch.equal(out, (x + 1) * 2 - 3)


@pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="this torch cannot move memory"
)
def test_a_replay_refuses_memory_moved_since_capture():
    """A storage's data moved after capture (``_swap_data_ptr_``, how fxsplit gives a held
    output memory of its own): the record would follow it, a CUDA graph would read the old
    address. The emulator raises instead of differing from CUDA."""
    x, w = torch.randn(4), torch.randn(4)
    g = EmulatedGraph()
    out = g.capture(lambda: x * w)
    g.replay()
    torch.testing.assert_close(out, x * w, rtol=0, atol=0)
    w.untyped_storage()._swap_data_ptr_(w.untyped_storage().clone())
    with pytest.raises(MovedMemoryError, match="would read and write its old address"):
        g.replay()


# An engine's op reads per-step state that is not among its arguments (vLLM's attention reads
# slot mappings and block tables from a forward context): here a global table of slots.
_SLOTS = {"table": torch.arange(4)}


@torch.library.custom_op("fxsplit_emutest::gather_slots", mutates_args=())
def _gather_slots(x: torch.Tensor) -> torch.Tensor:
    return x[_SLOTS["table"]] * 2


@_gather_slots.register_fake
def _(x):
    return x.new_empty(4, *x.shape[1:])


@torch.library.custom_op("fxsplit_emutest::write_slots", mutates_args=())
def _write_slots(x: torch.Tensor) -> torch.Tensor:
    _SLOTS["cache"].index_copy_(0, _SLOTS["table"], x[:4])
    return x + 1


@_write_slots.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_reading_state_updated_in_place_replays_it():
    """State outside the op's arguments kept in a persistent buffer and refilled in place:
    the replay reads the same memory a CUDA graph reads, so it follows the new values."""
    _SLOTS["table"] = torch.arange(4)
    x = torch.randn(8, 3)
    g = EmulatedGraph()
    out = g.capture(lambda t: _gather_slots(t) + 1, x)
    _SLOTS["table"].copy_(torch.tensor([3, 2, 1, 0]))
    g.replay()
    assert torch.equal(out, x[_SLOTS["table"]] * 2 + 1)


def test_a_custom_op_reading_state_rebound_since_capture_raises_naming_op_and_tensor():
    """The per-step state rebuilt as a new tensor (a v1 runner's metadata): a CUDA graph would
    read the capture step's tensor, silently; the emulator, which calls the op afresh, would
    read the new one. It raises instead of being more lenient than CUDA."""
    _SLOTS["table"] = torch.arange(4)
    x = torch.randn(8, 3)
    g = EmulatedGraph()
    g.capture(lambda t: _gather_slots(t) + 1, x)
    _SLOTS["table"] = torch.tensor([0, 0, 0, 0])
    with pytest.raises(
        StateMovedError,
        match=r"gather_slots touched a torch.int64 tensor of "
        r"shape \(4,\).*another tensor than the one it touched at capture",
    ) as e:
        g.replay()
    assert "splitting_ops=['fxsplit_emutest::gather_slots']" in str(e.value)
    assert isinstance(e.value, MovedMemoryError)


@pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="this torch cannot move memory"
)
def test_a_custom_op_writing_state_that_moved_since_capture_raises():
    """A cache the op writes through a forward context, moved to other memory: a CUDA graph
    would write the old address."""
    _SLOTS["table"], _SLOTS["cache"] = torch.arange(4), torch.zeros(8, 3)
    x = torch.randn(8, 3)
    g = EmulatedGraph()
    g.capture(_write_slots, x)
    g.replay()
    cache = _SLOTS["cache"].untyped_storage()
    cache._swap_data_ptr_(cache.clone())
    with pytest.raises(StateMovedError, match="the tensor it touched, but at another address"):
        g.replay()


def test_a_failed_capture_puts_back_what_a_custom_op_wrote_outside_its_arguments():
    """Found by a hunt: a failed capture put back only what the piece writes among its inputs,
    so a cache the op writes through a forward context stayed written, and the eager run that
    follows the failure wrote it again (wrong by 3.5). A CUDA capture executes nothing."""
    _SLOTS["table"], _SLOTS["cache"] = torch.arange(4), torch.zeros(8, 3)
    before = _SLOTS["cache"].clone()
    x = torch.randn(8, 3)

    def piece(t):
        out = _write_slots(t)
        if out.sum() > 0:  # a host read: the capture fails here
            out = out * 2
        return out

    with pytest.raises(CaptureError, match="illegal during CUDA graph capture"):
        EmulatedGraph().capture_piece(piece, [x], [])
    assert torch.equal(_SLOTS["cache"], before)


@torch.library.custom_op("fxsplit_emutest::square", mutates_args=())
def _square(x: torch.Tensor) -> torch.Tensor:
    return x * x


@_square.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_reading_only_its_arguments_replays_unchecked():
    """Only ops that touched state outside their arguments, or whose aten ops were called with
    host values (``x + 1``: the 1 could be a Python value read from anywhere), pay for the
    check."""
    x = torch.randn(4)
    g = EmulatedGraph()
    out = g.capture(lambda t: _square(t) * 2, x)
    assert all(type(step[1]).__name__ != "_ReadsState" for step in g._steps)
    h = EmulatedGraph()
    h.capture(lambda t: _plus_one(t) * 2, x)
    assert any(type(step[1]).__name__ == "_ReadsState" for step in h._steps)
    x.copy_(torch.randn(4))
    g.replay()
    assert torch.equal(out, (x * x) * 2)


class _Engine(torch.nn.Module):
    """A layer whose op gathers through the runner's slot table (outside its arguments)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(_gather_slots(self.lin(x)))


@pytest.mark.parametrize("runner", ["rebuilds", "refills"])
def test_a_compiled_piece_reading_a_runners_table_raises_where_cuda_would_read_stale(runner):
    """End to end: a runner that rebuilds its table every step (a v1 runner's metadata) gets a
    loud error at the first replay; one that refills it in place (v2's persistent buffers)
    replays eager's numbers; the op made a splitting op runs eagerly and is right either way."""
    import fxsplit

    torch._dynamo.reset()
    model = torch.nn.Sequential(_Engine()).eval()
    backend = fxsplit.Backend(capture="emulate", eager_regions=[])
    compiled = torch.compile(model, backend=backend)
    eager_op = torch.compile(
        model,
        backend=fxsplit.Backend(
            capture="emulate", eager_regions=[], splitting_ops=["fxsplit_emutest::gather_slots"]
        ),
    )
    _SLOTS["table"] = torch.arange(4)
    with torch.no_grad():
        for step in range(4):
            table = torch.randperm(8)[:4]
            if runner == "rebuilds":
                _SLOTS["table"] = table
            else:
                _SLOTS["table"].copy_(table)
            x = torch.randn(8, 3)
            want = model(x)
            assert torch.equal(eager_op(x), want)
            if runner == "rebuilds" and step == 2:  # capture at 1, the first replay at 2
                with pytest.raises(StateMovedError, match="gather_slots"):
                    compiled(x)
                break
            assert torch.equal(compiled(x), want)
    replays = sum(
        counts.get("replays", 0)
        for pieces in backend.stats.values()
        for keys in pieces.values()
        for key, counts in keys.items()
        if key != "refused"
    )
    assert replays == (2 if runner == "refills" else 0)
    torch._dynamo.reset()


@pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="this torch cannot move memory"
)
def test_a_replay_refuses_an_output_whose_memory_moved_since_capture():
    """The addresses a replay checks are every storage the record writes, outputs included,
    not only what it reads: here the pool block the record writes ``out`` into (the output's
    memory, not a view the program holds) moves, and a CUDA graph would write the old
    address, so the emulator raises. ``x * w``'s output is read by no later op: only its
    destination names it."""
    x, w = torch.randn(4), torch.randn(4)
    g = EmulatedGraph()
    out = g.capture(lambda: x * w)
    g.replay()
    assert torch.equal(out, x * w)
    record = g.pool.block_of(out).record
    record._swap_data_ptr_(record.clone())
    with pytest.raises(MovedMemoryError, match="would read and write its old address"):
        g.replay()


_STASH: dict[str, torch.Tensor] = {}


@torch.library.custom_op("fxsplit_emutest::stash_double", mutates_args=())
def _stash_double(x: torch.Tensor) -> torch.Tensor:
    _STASH["h"] = x * 2  # made by the kernel, kept in a forward context for a later op
    return x + 1


@_stash_double.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fxsplit_emutest::add_stashed", mutates_args=())
def _add_stashed(x: torch.Tensor) -> torch.Tensor:
    return x + _STASH["h"]


@_add_stashed.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_reading_what_an_earlier_op_of_the_graph_stashed_replays():
    """One op's kernel keeps a tensor it made in a forward context, a later op of the same
    graph reads it there: a CUDA graph replays the first kernel into the capture's memory and
    the second reads it, right; every replay stashes a new tensor, which is no moved state."""
    x = torch.randn(4)
    g = EmulatedGraph()
    out = g.capture(lambda t: _add_stashed(_stash_double(t)), x)
    for _ in range(3):
        x.copy_(torch.randn(4))
        g.replay()
        assert torch.equal(out, (x + 1) + x * 2)


def test_a_stash_the_program_replaces_outside_the_graph_still_raises():
    """The reading op alone in the graph: what it read at capture was the program's, and a
    tensor put there since is moved state."""
    _STASH["h"] = torch.ones(4)
    g = EmulatedGraph()
    g.capture(lambda t: _add_stashed(t) * 1, torch.randn(4))
    _STASH["h"] = torch.zeros(4)
    with pytest.raises(StateMovedError, match="another tensor than the one it touched"):
        g.replay()


_WINDOW = {"all": torch.arange(16.0)}


@torch.library.custom_op("fxsplit_emutest::add_window", mutates_args=())
def _add_window(x: torch.Tensor) -> torch.Tensor:
    return x + _WINDOW["now"]


@_add_window.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_reading_another_view_of_the_same_state_raises():
    """The forward context holds a window into a persistent buffer, moved on since capture
    (``all[4:8]`` for ``all[0:4]``): same storage, same address, but a CUDA kernel reads the
    view it was launched on, the capture's window, silently."""
    _WINDOW["now"] = _WINDOW["all"][0:4]
    x = torch.zeros(4)
    g = EmulatedGraph()
    out = g.capture(lambda t: _add_window(t) * 1, x)
    _WINDOW["now"] = _WINDOW["all"][0:8].view(2, 4)[0]  # the same view, made anew
    g.replay()
    assert torch.equal(out, _WINDOW["all"][0:4])
    _WINDOW["now"] = _WINDOW["all"][4:8]
    with pytest.raises(StateMovedError, match="another view of it"):
        g.replay()


class _AddsGlobalBranch(torch.nn.Module):
    def forward(self, t):
        return (_gather_slots(t) * 2,)


class _TriplesBranch(torch.nn.Module):
    def forward(self, t):
        return (t[:4] * 3,)


def test_a_custom_op_reading_state_inside_a_hop_branch_captures_and_is_checked():
    """A custom op reading a forward context inside ``cond``'s branch: the capture ran (it
    raised TypeError in the checker of the branch, which notes nothing), and a replay after the
    state was replaced raises as for the op outside a HOP."""
    true_fn = torch.fx.symbolic_trace(_AddsGlobalBranch())
    false_fn = torch.fx.symbolic_trace(_TriplesBranch())
    _SLOTS["table"] = torch.arange(4)
    x = torch.randn(8, 3)
    g = EmulatedGraph()
    out = g.capture(lambda t: torch.ops.higher_order.cond(True, true_fn, false_fn, (t,))[0], x)
    x.copy_(torch.randn(8, 3))
    g.replay()
    assert torch.equal(out, x[:4] * 4)
    _SLOTS["table"] = torch.tensor([0, 0, 0, 0])
    with pytest.raises(StateMovedError, match="another tensor than the one it touched"):
        g.replay()


SCALE = [1.0]  # a Python value fxsplit_emutest::scaled reads outside its arguments


@torch.library.custom_op("fxsplit_emutest::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE[0] + 0.5


@_scaled.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_python_value_a_custom_op_reads_that_changed_since_capture_raises():
    """A CUDA graph replays the capture's kernel launch, with the value it read then (1.0),
    silently; the emulator re-calls the kernel, which read the new value and followed it (the
    CPU passed where the GPU was stale). The host values its aten ops are called with are
    noted at capture and checked at every replay."""
    SCALE[0] = 1.0
    x = torch.ones(4)
    g = EmulatedGraph()
    out = g.capture(lambda t: torch.ops.fxsplit_emutest.scaled(t * 2), x)
    g.replay()
    torch.testing.assert_close(out, torch.full((4,), 2.5), rtol=0, atol=0)
    SCALE[0] = 2.0
    try:
        with pytest.raises(HostValueChangedError, match=r"scaled.*1\.0\] -> \[2\.0"):
            g.replay()
    finally:
        SCALE[0] = 1.0


@torch.library.custom_op("fxsplit_emutest::keeps", mutates_args=())
def _keeps(x: torch.Tensor, how: int) -> torch.Tensor:
    KEPT.append(x if how == 0 else x[1:] if how == 1 else x.untyped_storage())
    return x * 2


@_keeps.register_fake
def _(x, how):
    return torch.empty_like(x)


KEPT: list = []


@pytest.mark.parametrize("how", ["tensor", "view", "storage"])
def test_a_custom_op_keeping_its_argument_fails_the_capture(how):
    """Its kernel keeps a reference past the call: a replay runs no Python, so it would keep
    the capture's tensor, which every replay rewrites (CUDA captures it silently)."""
    with pytest.raises(CaptureError, match=r"keeps_?.*keeps an argument.*splitting_ops"):
        EmulatedGraph().capture(
            lambda t: torch.ops.fxsplit_emutest.keeps(
                t + 1, ["tensor", "view", "storage"].index(how)
            ),
            torch.ones(4),
        )
    KEPT.clear()
