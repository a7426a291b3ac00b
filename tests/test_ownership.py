"""Buffer ownership and aliasing under capture: each case once returned a wrong number or
corrupted a caller's tensor with no error (CPU, ``capture="emulate"``, under no_grad).

The rule under test (docs/capture.md, "Whose memory fxsplit writes"): fxsplit writes into a
tensor the caller handed in only where the model writes it; a caller's tensor is a static buffer
only when declared persistent; values the caller never handed in are fxsplit's to copy, never
to refuse; outputs that are views of an input stay views of the caller's tensor.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit import counters
from fxsplit.runtime.inputs.binding import RUNNER
from fxsplit.runtime.inputs.static_buffers import own_buffer
from tests.versions import needs_swap
from tests.warned import warned_at

D = 4


pytestmark = pytest.mark.usefixtures("fresh_capture_state")


@torch.library.custom_op("fxsplit_own::fresh", mutates_args=())
def fresh(x: torch.Tensor) -> torch.Tensor:
    """An eager op returning a new tensor every call."""
    return torch.cumsum(x, dim=-1) * 0.5


@fresh.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fxsplit_own::attend", mutates_args=())
def attend(q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Eager "attention": reads the whole cache."""
    return q * cache.sum() + cache.flatten()[: q.shape[-1]]


@attend.register_fake
def _(q, cache):
    return torch.empty_like(q)


@torch.library.custom_op("fxsplit_own::bump", mutates_args=["t"])
def bump(t: torch.Tensor) -> None:
    """An eager op writing its argument in place."""
    t.add_(100)


@bump.register_fake
def _(t):
    return None


@torch.library.custom_op("fxsplit_own::cache_update", mutates_args=["kv_cache"])
def cache_update(k: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes k's rows into kv_cache at slots (a KV-cache write)."""
    kv_cache.index_copy_(0, slots, k)


@cache_update.register_fake
def _(k, kv_cache, slots):
    return None


FRESH = ["fxsplit_own::fresh"]


def _compile(fn, *ops, dynamic=None, **options):
    """``fn`` compiled with capture emulated, the ``fxsplit_own`` ops it calls (``ops``, eager
    ones such as ``"fresh"``) as splitting ops; without ops, no region is eager (the function has
    none), so fxsplit has nothing to warn about."""
    if ops:
        options.setdefault("splitting_ops", [f"fxsplit_own::{op}" for op in ops])
    else:
        options.setdefault("eager_regions", [])
    backend = fxsplit.Backend(capture="emulate", **options)
    return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True), backend


def _data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _replays() -> int:
    return counters.totals["replays"]


def _replays_by_piece(backend) -> dict[str, int]:
    """Replays of each captured piece of the backend's one graph, every capture key summed."""
    (pieces,) = backend.stats.values()
    return {name: sum(c.get("replays", 0) for c in keys.values()) for name, keys in pieces.items()}


def test_view_of_previous_output_fed_back_reads_its_own_values():
    """``h[B:]`` of the last output fed back as the next input: a slice, so its start address
    differs from the output buffer's, but the next replay overwrites it all the same."""

    def f(x):
        h = torch.cat([x, x + 1]) * 2
        y = fxsplit_own_fresh(h)
        return h, y * 3

    cf, _ = _compile(f, "fresh", dynamic=False)
    b = 3
    x_eager = x = _data(b, D)
    with torch.no_grad():
        for step in range(6):
            h_e, y_e = f(x_eager)
            h, y = cf(x)
            assert torch.equal(h, h_e) and torch.equal(y, y_e), step
            x_eager, x = h_e[b:], h[b:]
    assert _replays() > 0


def fxsplit_own_fresh(x):
    return torch.ops.fxsplit_own.fresh(x)


WRITES = {
    "swapaxes": lambda c, s: c.swapaxes(0, 1)[0, :, 0].copy_(s),
    "setitem_swapaxes": lambda c, s: c.swapaxes(0, 1).__setitem__((0, slice(None), 0), s),
    "T": lambda c, s: c[0].T[1].copy_(s),
    "mT": lambda c, s: c.mT[0, 2].copy_(s),
    "unfold": lambda c, s: c[1].unfold(0, 2, 2)[0, 0].copy_(s[:2]),
    "real": lambda c, s: c.real[2, 1].copy_(s),
    "diagonal": lambda c, s: c[0].diagonal().copy_(s),
    "as_strided": lambda c, s: c.as_strided((D,), (D + 1,), 3).copy_(s),
    "index_put_slice": lambda c, s: c[1:][0].index_put_((torch.arange(D),), s, accumulate=True),
    "swapdims_add_": lambda c, s: c.swapdims(1, 2)[3].add_(s),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_write_through_a_view_in_captured_piece_reaches_the_cache(how):
    write = WRITES[how]

    def f(k, cache):
        write(cache, k.sum(0) * 2)
        return torch.ops.fxsplit_own.attend(k.sin(), cache)

    cf, _ = _compile(f, "attend")
    cache_e, cache = torch.zeros(D, D, D), torch.zeros(D, D, D)
    with torch.no_grad():
        for step in range(5):
            k = _data(3, D, seed=step)
            expected = f(k, cache_e)
            got = cf(k, cache)
            assert torch.equal(got, expected), (how, step)
            assert torch.equal(cache, cache_e), (how, step)
    assert _replays() > 0


def test_view_of_copied_value_written_by_later_eager_piece():
    """An eager op returns v; the captured piece takes y = v[0]; a later eager op writes y in
    place: the write must reach v, as in eager."""

    def f(x):
        v = torch.ops.fxsplit_own.fresh(x)
        y = v[0]
        z = (x * 2).sum()
        torch.ops.fxsplit_own.bump(y)
        return v.sum(1) + z

    cf, _ = _compile(f, "bump", "fresh")
    with torch.no_grad():
        for step in range(5):
            x = _data(3, D, seed=step)
            assert torch.equal(cf(x), f(x)), step
    assert _replays() > 0


def test_custom_op_packet_writing_kv_cache_in_captured_piece_under_v1():
    def f(k, kv_cache, slots, q):
        torch.ops.fxsplit_own.cache_update(k * 2, kv_cache, slots)
        return torch.ops.fxsplit_own.attend(q, kv_cache)

    cf, _ = _compile(f, "attend", runner="v1")
    cache_e, cache = torch.zeros(16, D), torch.zeros(16, D)
    with torch.no_grad():
        for step in range(5):
            k, q = _data(2, D, seed=step), _data(2, D, seed=10 + step)
            slots = torch.tensor([2 * step, 2 * step + 1])
            expected = f(k, cache_e, slots, q)
            assert torch.equal(cf(k, cache, slots, q), expected), step
            assert torch.equal(cache, cache_e), step
    assert _replays() > 0


def test_v2_copy_binding_never_writes_one_caller_tensor_into_another():
    def f(x):
        return torch.ops.fxsplit_own.fresh(x.sin()) * 2

    cf, _ = _compile(f, "fresh", runner="v2", input_binding="copy")
    a, b = _data(3, D, seed=1), _data(3, D, seed=2)
    a0, b0 = a.clone(), b.clone()
    with torch.no_grad():
        for x in (a, a, b, a, b, b, a):
            assert torch.equal(cf(x), f(x))
            assert torch.equal(a, a0) and torch.equal(b, b0)
    assert _replays() > 0


def test_v1_strict_binding_same_tensor_every_step():
    def f(x):
        return torch.ops.fxsplit_own.fresh(x.sin()) * 2

    cf, backend = _compile(f, "fresh", runner="v1", input_binding="strict")
    x = _data(3, D)
    with torch.no_grad():
        for step in range(5):
            x.copy_(_data(3, D, seed=step))
            assert torch.equal(cf(x), f(x)), step
    assert _replays() > 0
    first = backend.runtimes[0].pieces[0]
    (spec,) = (s for s in first.specs if s.kind == RUNNER)
    assert first.stats.copies_by_input[spec.name] == 0  # bound by address, never copied


def test_signed_zero_host_value_is_its_own_capture_key():
    def f(h, shift: float):
        return torch.ops.fxsplit_own.fresh(h) / shift

    cf, backend = _compile(f, "fresh", dynamic=True)
    h = torch.ones(3, D)
    with torch.no_grad():
        for shift in (0.0, -0.0, 0.0, -0.0, -0.0, 0.0):
            assert torch.equal(cf(h, shift), f(h, shift)), shift
    (keys,) = (
        k for k in backend.stats["graph_0"].values() if any(c["captures"] for c in k.values())
    )
    captured = [c for c in keys.values() if c.get("captures")]
    assert len(captured) == 2 and all(c.get("replays") for c in captured), keys


def test_bool_and_int_host_values_are_different_keys():
    from fxsplit.runtime.piece.entry import key_function as _key_function

    key = _key_function(((0, None),))

    def part(v):
        return key((v,))[0]

    assert part(True) != part(1) != part(1.0)
    assert part(0.0) != part(-0.0) and part(0) != part(0.0)
    assert part(float("nan")) == part(float("nan"))
    assert part(2.5) == part(2.5) and part(None) == part(None)


def test_reduction_over_non_contiguous_input_replays_bit_exactly():
    def f(x):
        return x.sum() * 2

    cf, _ = _compile(f)
    with torch.no_grad():
        for step in range(10):
            buf = _data(64, 33, seed=step) * 1000
            x = buf[:, 1:]
            assert torch.equal(cf(x), f(x)), step
    assert _replays() > 0


def test_a_static_buffer_keeps_the_callers_strides_and_address_alignment():
    """A caller's tensor copied into fxsplit's static buffer keeps its strides and its address
    modulo the allocator's alignment (64 bytes on CPU): a vectorised kernel picks how it splits
    the data by both (CUDA's by the pointer's alignment), so the replay reduces as eager did."""
    base = _data(4096)
    for offset in (0, 1, 3, 17, 600):
        for value in (
            base[offset : offset + 1000],
            base[offset : offset + 64 * 33].view(64, 33)[:, 1:],
        ):
            buffer, _ = own_buffer(value)
            assert buffer.data_ptr() % 64 == value.data_ptr() % 64, offset
            assert buffer.stride() == value.stride() and torch.equal(buffer, value), offset


def test_v2_output_fed_back_as_next_input():
    def f(x):
        return torch.ops.fxsplit_own.fresh(x).tanh() + 0.5

    cf, _ = _compile(f, "fresh", runner="v2")
    x_e = x = _data(3, D)
    with torch.no_grad():
        for step in range(6):
            x_e, x = f(x_e), cf(x)
            assert torch.equal(x, x_e), step
    assert _replays() > 0


@torch.compiler.disable
def _helper(h):
    return h.cos() + 1


def test_v2_value_from_disabled_helper_between_graphs_is_copied_not_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, D)
            self.b = nn.Linear(D, D)

        def forward(self, x):
            h = torch.ops.fxsplit_own.fresh(self.a(x))
            h = _helper(h)
            return torch.ops.fxsplit_own.fresh(self.b(h)) * 2

    model = M().eval()
    backend = fxsplit.Backend(capture="emulate", runner="v2", splitting_ops=FRESH)
    cf = torch.compile(model, backend=backend)
    x = _data(3, D)
    with torch.no_grad():
        for step in range(5):
            x.copy_(_data(3, D, seed=step))
            assert torch.equal(cf(x), model(x)), step
    assert _replays() > 0


def test_buffer_rebound_in_forward_is_copied_not_recaptured(caplog):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("t", torch.zeros(D))

        def forward(self, x):
            self.t = self.t + 1
            return torch.ops.fxsplit_own.fresh(x * self.t) * 2

    model, ref = M(), M()
    cf = torch.compile(model, backend=fxsplit.Backend(capture="emulate", splitting_ops=FRESH))
    with (
        torch.no_grad(),
        pytest.warns(fxsplit.FxsplitWarning, match="moved on consecutive calls") as seen,
    ):
        for step in range(12):
            x = _data(3, D, seed=step)
            assert torch.equal(cf(x), ref(x)), step
    # once, at the line that called the compiled model
    assert warned_at(seen) == [("test_ownership.py", "assert torch.equal(cf(x), ref(x)), step")]
    assert counters.totals["captures"] > 0 and _replays() >= 6
    assert counters.totals["recaptures"] <= 1


class _Block(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.ops.fxsplit_own.fresh(self.lin(x)) * 2


def test_two_instances_sharing_dynamos_graph_copy_their_weights_and_say_how_to_stop_it():
    """Dynamo compiles one graph for every instance of a class (weights are graph inputs): one
    Backend for two instances gives the right numbers, copying the weights each call, and
    says so once; a Backend each compiles a graph each, binds the weights by address and
    copies nothing."""
    first, second = _Block(0).eval(), _Block(1).eval()

    def run(backends) -> set[str]:
        """The inputs copied into static buffers (weights show as ``l_self_...``)."""
        models = (first, second)
        a, b = (torch.compile(m, backend=be) for m, be in zip(models, backends, strict=True))
        with torch.no_grad():
            for step in range(6):
                x = _data(3, D, seed=step)
                assert torch.equal(a(x), first(x)) and torch.equal(b(x), second(x)), step
        assert _replays() > 0
        pieces = [p for be in set(backends) for rt in be.runtimes for p in rt.pieces]
        return {n for p in pieces for n, copies in p.stats.copies_by_input.items() if copies}

    shared = fxsplit.Backend(capture="emulate", splitting_ops=FRESH)
    with pytest.warns(fxsplit.FxsplitWarning, match="compile each with its own fxsplit.Backend"):
        copied = run([shared, shared])
    assert any("lin_parameters_weight" in name for name in copied), copied
    torch._dynamo.reset()
    own = [fxsplit.Backend(capture="emulate", splitting_ops=FRESH) for _ in range(2)]
    copied = run(own)
    assert not any("lin_parameters" in name for name in copied), copied


def test_capture_sizes_read_the_first_forward_argument_not_the_first_used():
    def f(tokens, block_table):
        n = block_table.shape[0]
        return torch.ops.fxsplit_own.fresh(tokens * n) + 1

    cf, _ = _compile(f, "fresh", dynamic=True, capture_sizes=[8, 16])
    with torch.no_grad():
        for step in range(6):
            size = 8 if step % 2 else 16
            tokens, table = _data(size, D, seed=step), torch.zeros(3, 5, dtype=torch.long)
            assert torch.equal(cf(tokens, table), f(tokens, table))
    assert counters.totals["captures"] > 0 and _replays() > 0


def test_size_input_names_the_argument():
    def f(block_table, tokens):
        return torch.ops.fxsplit_own.fresh(tokens * block_table.shape[0]) + 1

    cf, _backend = _compile(f, "fresh", dynamic=True, capture_sizes=[8], size_input="tokens")
    with torch.no_grad():
        for step in range(4):
            table, tokens = torch.zeros(3, 5, dtype=torch.long), _data(8, D, seed=step)
            assert torch.equal(cf(table, tokens), f(table, tokens))
    assert _replays() > 0


def test_in_place_op_on_input_returns_the_callers_tensor():
    def f(x, y):
        return x.add_(y)

    cf, _ = _compile(f)
    with torch.no_grad():
        for step in range(5):
            x, y = _data(3, D, seed=step), _data(3, D, seed=50 + step)
            x_e = x.clone()
            out = cf(x, y)
            f(x_e, y)
            assert torch.equal(x, x_e) and out.data_ptr() == x.data_ptr(), step
            out.mul_(0)  # eager aliasing: the output is the input
            assert not x.any()
    assert counters.totals["captures"] > 0 and _replays() > 0


@pytest.mark.parametrize(
    "view", ["t", "T", "mT", "expand_as", "unfold", "diagonal", "getitem", "real"]
)
def test_output_view_of_input_stays_a_view_of_the_callers_tensor(view):
    views = {
        "t": lambda x: x.t(),
        "T": lambda x: x.T,
        "mT": lambda x: x.mT,
        "expand_as": lambda x: x[:1].expand_as(x),
        "unfold": lambda x: x.unfold(1, 2, 1),
        "diagonal": lambda x: x.diagonal(),
        "getitem": lambda x: x[1:, ::2],
        "real": lambda x: x.real,
    }

    def f(x):
        return views[view](x), x.sum() * 2

    cf, _ = _compile(f)
    with torch.no_grad():
        for step in range(4):
            x = _data(3, D, seed=step)
            v, s = cf(x)
            v_e, s_e = f(x)
            assert torch.equal(v, v_e) and torch.equal(s, s_e)
            assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), view
            assert v.stride() == v_e.stride() and v.storage_offset() == v_e.storage_offset()
    assert counters.totals["captures"] > 0 and _replays() > 0


def test_piece_with_an_empty_input_is_captured():
    def f(x, empty):
        return torch.cat([x * 2, empty]).sin()

    cf, _ = _compile(f)
    with torch.no_grad():
        for step in range(4):
            x, e = _data(3, D, seed=step), torch.empty(0, D)
            assert torch.equal(cf(x, e), f(x, e))
    assert counters.totals["captures"] > 0 and _replays() > 0


def test_enable_grad_inside_no_grad_runs_eagerly_with_fresh_grad_fn():
    """What autograd tracks in a graph entered without grad is marked capture-unsafe: a replay
    would return the capture step's grad_fn, and what it saves would be pool memory. Each call
    gets a fresh grad_fn over memory of its own, and nothing is refused or warned."""
    w = torch.ones(D, requires_grad=True)

    def f(x):
        with torch.enable_grad():
            y = (x * w).sum(-1)
        return y

    cf, backend = _compile(f)
    xs = [_data(3, D, seed=s) for s in range(4)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [cf(x) for x in xs]
    assert all(o.requires_grad and o.grad_fn is not None for o in outs)
    # each call's own autograd graph: the gradient follows that call's input
    for x, o in zip(xs, outs, strict=True):
        (grad,) = torch.autograd.grad(o.sum(), w)
        assert torch.equal(grad, x.sum(0))
    assert len({o.data_ptr() for o in outs}) == len(outs)  # no replay buffer handed out twice
    (plan,) = backend.plans
    assert [p.kind for p in plan.pieces] == ["eager"]
    assert "unsafe:aten::mul (autograd tracks it)" in plan.pieces[0].reasons


def test_runner_input_aliasing_a_written_module_buffer_keeps_eager_numbers():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(D, D))

        def forward(self, k, view):
            self.cache[0].add_(k.sum(0))
            return view.sum(0) * 2 + k.sin().sum()

    model, ref = M(), M()
    backend = fxsplit.Backend(capture="emulate", eager_regions=[])
    cf = torch.compile(model, backend=backend)
    with torch.no_grad():
        for step in range(5):
            k = _data(3, D, seed=step)
            assert torch.equal(cf(k, model.cache[:2]), ref(k, ref.cache[:2])), step
            assert torch.equal(model.cache, ref.cache)
    # the view of the buffer is bound by address: captured and replayed, nothing refused
    (keys,) = backend.stats["graph_0"].values()
    assert "refused" not in keys
    assert sum(c.get("replays", 0) for c in keys.values()) == 3


def test_a_runner_input_the_model_only_reads_is_copied_at_every_replay():
    """Even handed unchanged (the same tensor, address and version): the caller may refill it
    where the version counter does not see (NumPy, ``.data``), as engines fill staging
    buffers."""

    def f(x, cache):
        return torch.ops.fxsplit_own.fresh(x * cache.sum())

    cf, backend = _compile(f, "fresh")
    cache = _data(64, 64)
    with torch.no_grad():
        for step in range(6):
            x = _data(3, D, seed=step)
            assert torch.equal(cf(x, cache), f(x, cache))
        cache.add_(1)
        x = _data(3, D, seed=99)
        assert torch.equal(cf(x, cache), f(x, cache))
    copies = {
        name: n
        for piece in backend.runtimes[0].pieces
        for name, n in piece.stats.copies_by_input.items()
    }
    cache_copies = [n for name, n in copies.items() if "cache" in name]
    assert _replays() == 7 - 2  # calls 2 to 6 replay the captured piece
    assert cache_copies == [_replays()], copies


def test_mark_static_address_input_is_never_copied():
    def f(x, cache):
        cache[: x.shape[0]].copy_(x)
        return torch.ops.fxsplit_own.attend(x, cache)

    cf, backend = _compile(f, "attend", runner="v1")
    cache = torch.zeros(16, D)
    torch._dynamo.mark_static_address(cache)
    cache_e = cache.clone()
    with torch.no_grad():
        for step in range(5):
            x = _data(3, D, seed=step)
            assert torch.equal(cf(x, cache), f(x, cache_e)), step
            assert torch.equal(cache, cache_e)
    copies = [
        n
        for p in backend.runtimes[0].pieces
        for k, n in p.stats.copies_by_input.items()
        if "cache" in k
    ]
    assert not copies and _replays() > 0


def test_one_layer_function_called_with_each_layers_marked_cache_never_copies_a_cache():
    """One compiled function per layer, called with each layer's ``mark_static_address``
    cache: a graph per cache, each bound to its cache's address (the address is part of the
    capture key), never a copy of a cache in or out (before: the cache was taken for a
    parameter that moved on consecutive calls, and every cache was copied every call)."""
    lin = nn.Linear(D, D).eval()

    def layer(x, cache, position):
        cache.index_copy_(0, position, lin(x))
        return (cache.sum(0, keepdim=True) + x).relu()

    caches = [torch.zeros(16, D) for _ in range(4)]
    for cache in caches:
        torch._dynamo.mark_static_address(cache)
    eager_caches = [c.clone() for c in caches]
    backend = fxsplit.Backend(capture="emulate", eager_regions=[])
    compiled = torch.compile(layer, backend=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "moved on consecutive calls" warning
        for step in range(4):
            h = want = _data(1, D, seed=step)
            position = torch.tensor([step])
            for cache, eager_cache in zip(caches, eager_caches, strict=True):
                h, want = compiled(h, cache, position), layer(want, eager_cache, position)
            assert torch.equal(h, want)
            assert all(torch.equal(a, b) for a, b in zip(caches, eager_caches, strict=True))
    (piece,) = backend.runtimes[0].pieces
    assert not [k for k in piece.stats.copies_by_input if "cache" in k]
    assert counters.snapshot()["captures"] == 4 and _replays() == 8


def test_a_view_of_a_marked_cache_handed_between_pieces_is_read_by_address():
    """A layer's slice of a marked KV cache (``kv[0, 1]``), made in one captured piece, written
    there and read by a later captured piece after an eager op: bound by address in both,
    never copied in or out."""
    lin = nn.Linear(D, D).eval()

    def f(x, kv, position):
        layer = kv[0, 1]
        layer.index_copy_(0, position, lin(x))
        scores = torch.ops.fxsplit_own.attend(x, layer)
        return lin(scores + layer[:1])

    cf, backend = _compile(f, "attend", runner="v1")
    kv = torch.zeros(2, 2, 16, D)
    torch._dynamo.mark_static_address(kv)
    eager_kv = kv.clone()
    with torch.no_grad():
        for step in range(5):
            x, position = _data(1, D, seed=step), torch.tensor([step])
            assert torch.equal(cf(x, kv, position), f(x, eager_kv, position)), step
            assert torch.equal(kv, eager_kv)
    copied = [k for p in backend.runtimes[0].pieces for k in p.stats.copies_by_input]
    assert not [k for k in copied if "kv" in k or "layer" in k], copied
    assert _replays() == 2 * 3


def test_analysis_failure_logs_and_runs_uncaptured(caplog, monkeypatch):
    from fxsplit.facts import aliasing

    def broken():
        raise ImportError("no collector in this torch")

    monkeypatch.setattr(aliasing, "_collector", broken)

    def f(x):
        return torch.ops.fxsplit_own.fresh(x.sin()) * 2

    cf, backend = _compile(f, "fresh")
    with torch.no_grad(), pytest.warns(UserWarning, match="aliasing analysis failed") as seen:
        for step in range(3):
            x = _data(3, D, seed=step)
            assert torch.equal(cf(x), f(x))
    assert _replays() == 0
    assert len([w for w in seen if "aliasing analysis failed" in str(w.message)]) == len(
        backend.plans[0].captured
    )  # once per piece
    refused = [c.get("refused", {}) for c in backend.stats["graph_0"].values()]
    assert all(sum(r.values()) == 3 for r in refused), refused


def test_transformers_static_cache_generate_replays_every_piece_and_copies_the_cache_once_a_call():
    """transformers' StaticCache, made in a compiled forward, is not marked static (its lazy
    init marks it only outside Dynamo), so its tensors are plain arguments the model writes:
    copied in once a call (not once a piece), since the caller may write them where the version
    counter does not see (tests/test_field_cases.py). Marking them
    (``torch._dynamo.mark_static_address``) binds them by address instead."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 5))
    generate = {"max_new_tokens": 10, "do_sample": False, "cache_implementation": "static"}
    with torch.no_grad():
        expected = model.generate(ids, **generate)
        backend = fxsplit.Backend(
            capture="emulate", splitting_ops=["aten::scaled_dot_product_attention"]
        )
        model.forward = torch.compile(model.forward, backend=backend)
        got = model.generate(ids, **generate)
    assert torch.equal(got, expected)
    decode = backend.runtimes[-1]
    assert all(p.failed is None and p.entries for p in decode.pieces)
    assert all(sum(k["replays"] for k in p.stats.per_key.values()) >= 7 for p in decode.pieces)
    cache_copies = {
        name: n
        for p in decode.pieces
        for name, n in p.stats.copies_by_input.items()
        if "keys" in name or "values" in name or "cumulative_length" in name
    }
    calls = decode.context.calls
    assert cache_copies and all(n <= calls for n in cache_copies.values()), (cache_copies, calls)


# Found by an adversarial review (each once returned a wrong number with no error).


class _NarrowBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", _data(6, D))

    def forward(self, x, k: int):
        v = self.w.narrow(0, k, 2)  # a captured piece's output: a view of a buffer
        t = torch.ops.fxsplit_own.fresh(x * 2)
        return v * 3 + t.sum()  # a later captured piece reads it


def test_view_output_read_by_a_later_piece_is_never_copied_into():
    """A host int keys the first piece: a new value runs it uncaptured while the later piece
    replays. Its input (a view of a buffer) must not be bound by identity, or the copy of the
    new view lands inside the buffer."""
    model, ref = _NarrowBuffer(), _NarrowBuffer()
    backend = fxsplit.Backend(capture="emulate", splitting_ops=FRESH)
    cf = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    x = _data(5, D, seed=3)
    with torch.no_grad():
        for k in (2, 2, 2, 4, 2, 4):
            assert torch.equal(cf(x, k), ref(x, k)), k
            assert torch.equal(model.w, ref.w), k
    # piece_0: k=2 captured at the second call, replayed at calls 2 and 4; piece_2 replays from
    # call 2 on, k=4's first sight (call 3) included
    assert _replays_by_piece(backend) == {"piece_0": 2, "piece_2": 3}


def test_view_of_a_persistent_input_read_by_a_later_piece_under_v2():
    def f(x, k: int):
        v = x.narrow(0, k, 2)
        t = torch.ops.fxsplit_own.fresh(x * 2)
        return v * 3 + 1, t

    cf, backend = _compile(f, "fresh", dynamic=True, runner="v2")
    x = torch.empty(6, D)
    with torch.no_grad():
        for step, k in enumerate((2, 2, 2, 4, 2)):
            x.copy_(_data(6, D, seed=step))
            snapshot = x.clone()
            expected, got = f(snapshot, k), cf(x, k)
            assert torch.equal(x, snapshot), step  # the model never writes x
            assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), step
    # piece_0 (keyed by k) replays k=2 at calls 2 and 4; piece_2, reading the view, replays
    # from call 2 on, with the view k=4 makes at call 3 included
    assert _replays_by_piece(backend) == {"piece_0": 2, "piece_2": 3}


@needs_swap
def test_model_write_to_a_handed_back_output_reaches_it():
    def f(x, h):
        h.add_(1)
        return torch.ops.fxsplit_own.fresh(x * 2) + h.sum()

    cf, _ = _compile(f, "fresh", dynamic=True)
    with torch.no_grad():
        for step in range(3):
            x, h = _data(5, D, seed=step), _data(3, seed=10 + step)
            held_e, held_g = f(x, h.clone()), cf(x, h.clone())
        for step in range(3):  # another size: nothing overwrites the held output
            x = _data(7, D, seed=20 + step)
            assert torch.equal(cf(x, held_g[0, :3]), f(x, held_e[0, :3])), step
            assert torch.equal(held_g, held_e), step
    assert _replays() > 0


def test_expanded_input_replays_bit_exactly():
    def f(x):
        return torch.ops.fxsplit_own.fresh(x.sum(1)) * 2

    cf, _ = _compile(f, "fresh")
    with torch.no_grad():
        for step in range(4):
            x = _data(4097, 1, seed=step).expand(4097, 333)
            assert torch.equal(cf(x), f(x)), step
    assert _replays() > 0


@pytest.mark.parametrize("view", ["view_as_complex", "conj", "view_dtype", "real"])
def test_output_view_changing_dtype_or_conj_bit_of_input(view):
    def f(x):
        y = torch.ops.fxsplit_own.fresh(x.abs() if x.is_complex() else x)
        if view == "view_as_complex":
            out = torch.view_as_complex(x)
        elif view == "conj":
            out = x.conj()
        elif view == "view_dtype":
            out = x.view(torch.int32)
        else:
            out = x.real
        return out, y * 2

    complex_input = view in ("conj", "real")
    cf, _ = _compile(f, "fresh")
    with torch.no_grad():
        for step in range(4):
            x = _data(3, 2, seed=step)
            x = torch.view_as_complex(x.contiguous()).contiguous() if complex_input else x
            expected, got = f(x), cf(x)
            assert got[0].dtype == expected[0].dtype and got[0].is_conj() == expected[0].is_conj()
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), step
    assert _replays() > 0


def test_clone_outputs_keeps_the_conj_bit():
    def f(x):
        t = torch.ops.fxsplit_own.fresh(x.abs()) * 2 * x
        return t.conj(), -t

    cf, _ = _compile(f, "fresh", clone_outputs=True)
    with torch.no_grad():
        for step in range(4):
            x = torch.view_as_complex(_data(3, 2, seed=step))
            for a, b in zip(cf(x), f(x), strict=True):
                assert torch.equal(a, b) and a.is_conj() == b.is_conj(), step
    assert _replays() > 0


@needs_swap
def test_buffers_swapped_in_forward_keep_their_values():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("prev", torch.zeros(D))
            self.register_buffer("cur", torch.zeros(D))

        def forward(self, x):
            self.prev, self.cur = self.cur, self.cur * 0.5 + self.prev + x.sum(0)
            return torch.ops.fxsplit_own.fresh(x) + self.prev

    model, ref = M(), M()
    cf = torch.compile(model, backend=fxsplit.Backend(capture="emulate", splitting_ops=FRESH))
    with (
        torch.no_grad(),
        pytest.warns(fxsplit.FxsplitWarning, match="moved on consecutive calls") as seen,
    ):
        for step in range(8):
            x = _data(3, D, seed=step)
            assert torch.equal(cf(x), ref(x)), step
            assert torch.equal(model.prev, ref.prev) and torch.equal(model.cur, ref.cur), step
    assert warned_at(seen) == [("test_ownership.py", "assert torch.equal(cf(x), ref(x)), step")]
    assert _replays() > 0


def test_storage_swapped_under_an_unchanged_version_counter_is_copied():
    def f(x):
        return torch.ops.fxsplit_own.fresh(x.sin()) * 2 + x

    cf, _ = _compile(f, "fresh")
    x = _data(4, 3)
    with torch.no_grad():
        for step in range(5):
            x.data = _data(4, 3, seed=step)  # new address, version counter untouched
            assert torch.equal(cf(x), f(x)), step
    assert _replays() > 0


@torch.compiler.disable
def _plus_one(t):
    return t + 1


def test_v2_local_computed_before_a_graph_break_is_copied_not_refused():
    def f(x, w):
        g = _plus_one(x * 2 + w)
        torch._dynamo.graph_break()
        return torch.ops.fxsplit_own.fresh(g.sin() * w) + g

    cf = torch.compile(
        f, backend=fxsplit.Backend(capture="emulate", runner="v2", splitting_ops=FRESH)
    )
    x, w = torch.empty(4, D), _data(4, D, seed=1)
    with torch.no_grad():
        for step in range(8):
            x.copy_(_data(4, D, seed=step))
            assert torch.equal(cf(x, w), f(x, w)), step
    assert _replays() > 0


# Found by a second adversarial review.


def test_eval_dropout_returns_its_input_so_writes_through_it_reach_the_caller():
    """The analysis runs the kernels eager runs: eval-mode dropout returns its input (its
    Python decomposition would return a clone and hide the write)."""

    def f(x):
        h = F.dropout(x, 0.1, training=False)
        h.add_(1)
        return h * 2, torch.ops.fxsplit_own.fresh(x)

    cf, _ = _compile(f, "fresh")
    with torch.no_grad():
        for step in range(5):
            xe, xc = torch.full((3,), float(step)), torch.full((3,), float(step))
            expected, got = f(xe), cf(xc)
            assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), step
            assert torch.equal(xe, xc), step
    assert _replays() > 0


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_view_output_of_an_input_with_conj_or_neg_bit(bit):
    def f(x):
        return x * 2, x[1:]

    cf, _ = _compile(f)
    with torch.no_grad():
        for step in range(4):
            z = torch.view_as_complex(_data(3, 2, seed=step)) if bit == "conj" else _data(3, 2)
            x = z.conj() if bit == "conj" else torch._neg_view(z)
            for a, b in zip(cf(x), f(x), strict=True):
                assert torch.equal(a, b), step
    assert _replays() > 0


@needs_swap
def test_earlier_output_handed_back_as_a_tensor_and_a_view_of_it():
    """The piece writes ``x`` and reads ``y``, a view of it: two separate static copies could not
    keep that aliasing, so that call runs uncaptured (warned, counted), with eager's numbers."""

    def f(x, y):  # y is a view of x
        o = x * 3
        z = torch.ops.fxsplit_own.fresh(o)
        x.mul_(2)
        return o, y.sum(0) + z.sum()

    cf, backend = _compile(f, "fresh")
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitWarning, match="share storage"):
        xe = torch.arange(12.0).reshape(4, 3)
        xc = xe.clone()
        for _ in range(3):
            expected, got = f(xe, xe[1:]), cf(xc, xc[1:])
        he, hc = expected[0], got[0]  # hc lives in fxsplit's static output buffer
        expected, got = f(he, he[1:]), cf(hc, hc[1:])
        assert torch.equal(expected[1], got[1]) and torch.equal(he, hc)
    assert any("refused" in keys for keys in backend.stats["graph_0"].values())
    assert _replays() > 0


def test_verify_reads_aliased_inputs_as_the_replay_did():
    def f(a, b):  # b is a view of a
        r = b * 2
        a.add_(1)
        return r

    cf, _ = _compile(f, runner="v2", verify=True)
    a = torch.zeros(3, D)
    with torch.no_grad():
        for step in range(5):
            ref = a.clone()
            expected = f(ref, ref[0])
            assert torch.equal(cf(a, a[0]), expected), step
            assert torch.equal(a, ref), step
    assert _replays() > 0


def test_in_place_unsqueeze_of_an_intermediate_keeps_its_shape():
    def f(x):
        y = x + 1
        y.unsqueeze_(0)
        return y, torch.ops.fxsplit_own.fresh(x)

    cf, _ = _compile(f, "fresh")
    with torch.no_grad():
        for step in range(5):
            x = _data(3, D, seed=step)
            for a, b in zip(cf(x), f(x), strict=True):
                assert a.shape == b.shape and torch.equal(a, b), step
    assert _replays() > 0


NORMS = {
    "F.batch_norm": lambda x, m, v: F.batch_norm(x, m, v, training=True, momentum=0.3),
    "native_batch_norm": lambda x, m, v: torch.native_batch_norm(
        x, None, None, m, v, True, 0.3, 1e-5
    )[0],
    "_native_batch_norm_legit": lambda x, m, v: torch._native_batch_norm_legit(
        x, None, None, m, v, True, 0.3, 1e-5
    )[0],
    "_batch_norm_with_update": lambda x, m, v: torch.ops.aten._batch_norm_with_update(
        x, torch.ones_like(m), torch.zeros_like(m), m, v, 0.3, 1e-5
    )[0],
    "F.instance_norm": lambda x, m, v: (
        F.instance_norm(x.view(2, 3, D).transpose(1, 2), m, v, use_input_stats=True, momentum=0.3)
        .transpose(1, 2)
        .reshape(6, D)
    ),
}


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_running_statistics_of_every_batch_norm_form_reach_the_caller(norm):
    """From the OpInfo sweep: Dynamo calls these as functions or packets, whose schemas (for
    some) do not declare the write; functionalization sees it."""
    fn = NORMS[norm]

    def f(x, mean, var):
        return fn(x, mean, var) * 2

    cf, _ = _compile(f)
    with torch.no_grad():
        for step in range(5):
            x = _data(6, D, seed=step)
            mean_e, var_e = torch.zeros(D), torch.ones(D)
            mean, var = mean_e.clone(), var_e.clone()
            assert torch.equal(cf(x, mean, var), f(x, mean_e, var_e)), step
            assert torch.equal(mean, mean_e) and torch.equal(var, var_e), step
    assert _replays() > 0


class _Inner(torch.nn.Module):
    def forward(self, z):
        return (z * 2).sin()


class _EagerCaller(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        return self.helper(x + 1)

    @torch.compiler.disable(recursive=False)
    def helper(self, y):
        return self.inner(y * 3)  # runs eagerly: a fresh tensor every step


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_v2_frame_called_by_eager_model_code_reads_the_models_fresh_values(capture):
    """Dynamo compiles ``inner`` as a frame of its own, called by model code it runs eagerly
    (here a ``torch.compiler.disable(recursive=False)`` helper; in transformers' LongcatFlash a
    graph break and the recompile limit). Its argument was computed by the model, not handed in
    by the runner: copied under strict binding, never refused."""
    model = _EagerCaller()
    compiled = torch.compile(
        model, backend=fxsplit.Backend(runner="v2", capture=capture, eager_regions=[])
    )
    x = torch.randn(4, 8)  # the runner's tensor: the same every step
    with torch.no_grad():
        for _ in range(4):
            x.add_(1)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    assert _replays() > 0 if capture == "emulate" else _replays() == 0


def test_piece_after_a_data_dependent_size_is_analysed_at_capture_and_replays():
    """A piece whose input size comes from ``nonzero`` (an unbacked symbol) cannot be analysed at
    split time: it is analysed at its first capture on the real sizes, then replays (before, it
    always ran uncaptured)."""

    def f(x):
        idx = torch.nonzero(x > 0)  # data-dependent: runs eagerly
        return (idx.float() * 2 + 1).sum(0)

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        cf, backend = _compile(f, splitting_ops=[])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(6):
                x = torch.tensor([1.0, -1.0, 2.0, 3.0 if step < 4 else -3.0])
                assert torch.equal(cf(x), f(x)), step
    stats = backend.stats["graph_0"]
    after = [p for p in backend.plans[0].captured if "nonzero" not in " ".join(p.nodes)][-1]
    assert sum(c.get("replays", 0) for c in stats[after.name].values()) >= 2
    assert not any("refused" in keys for keys in stats.values())
