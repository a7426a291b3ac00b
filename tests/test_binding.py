"""How captured pieces bind their inputs (``fxsplit/runtime/inputs/binding.py``): views of
parameters
and buffers bound by address, one static buffer per caller tensor shared by every capture key and
piece, and strict binding checked the same way with capture on and off."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.runtime.memory.output_lifetime import can_swap

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

D = 8


class _LayerCache(nn.Module):
    """Each call writes a layer's slice of a cache buffer the caller hands in as a view, and reads
    the whole buffer (so the buffer is a graph input too, sharing storage with that view)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 4, D))
        self.w = nn.Parameter(torch.randn(D, D), requires_grad=False)

    def forward(self, x, slot):
        slot.copy_(torch.tanh(x @ self.w))  # the piece writes the caller's view of the buffer
        with fxsplit.region(fxsplit.ATTENTION):
            h = slot.sin() + self.cache.sum(0)
        return h * 2


def _replays(backend):
    return sum(
        c.get("replays", 0) for g in backend.stats.values() for p in g.values() for c in p.values()
    )


def test_a_runner_input_viewing_a_buffer_the_piece_writes_is_bound_by_address_and_replays():
    model, eager = _LayerCache(), _LayerCache()
    eager.load_state_dict(model.state_dict())
    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for step in range(5):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
            got = compiled(x, model.cache[0])
            want = eager(x, eager.cache[0])
            assert torch.equal(got, want), step
            assert torch.equal(model.cache, eager.cache), step
    assert _replays(backend) == 2 * 3  # two captured pieces
    assert not any(p.get("refused") for g in backend.stats.values() for p in g.values()), (
        backend.stats
    )


def test_a_moved_view_of_a_buffer_runs_uncaptured_for_that_call():
    model, eager = _LayerCache(), _LayerCache()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=fxsplit.Backend(capture="emulate"))
    with torch.no_grad(), pytest.warns(UserWarning, match="view of a parameter or buffer"):
        for step in range(5):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
            layer = 1 if step == 4 else 0  # another layer's slice: another address
            assert torch.equal(compiled(x, model.cache[layer]), eager(x, eager.cache[layer]))
            assert torch.equal(model.cache, eager.cache), step


def test_a_cache_handed_in_as_a_plain_argument_is_held_once_across_capture_keys():
    """Under copy binding a KV cache handed in as an argument is copied into one static buffer
    that every capture key of every piece shares, not one per key: at most once a call (the
    caller may refill a tensor it reads where the version counter does not see, so a call
    copies it again; tests/test_field_cases.py, staging tensors)."""
    cache = torch.randn(64, 32, D)  # 64 KiB

    def f(x, kv):
        h = torch.einsum("bd,ntd->bn", x, kv).sin()
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        return h @ kv[:, 0]

    backend = fxsplit.Backend(capture="emulate", input_binding="copy")
    compiled = torch.compile(f, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (2, 3, 4, 5) * 3:
            x = torch.randn(n, D)
            assert torch.equal(compiled(x, cache), f(x, cache)), n
    runtime = backend.runtimes[0]
    held = {id(b.static) for b in runtime.context.buffers if b.static.numel() == cache.numel()}
    assert len(held) == 1
    assert _replays(backend) > 0
    copies = sum(p.stats.copies_by_input.get("l_kv_", 0) for p in runtime.pieces)
    assert copies <= _replays(backend), copies


def test_two_inputs_that_were_one_tensor_at_capture_are_refused_when_they_differ():
    """Bound to one shared buffer at capture (the same caller view twice), two different tensors
    later must not be copied into it one over the other. Dynamo guards on such aliasing; a plain
    torch.fx graph handed to the backend does not."""

    def f(a, b):
        return (a.sin() + b.cos()) * 2

    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def g(a, b):
        return (f(a, b),)

    gm = torch.fx.symbolic_trace(g)
    x = torch.randn(3, D)
    FakeTensorProp(gm).propagate(x, x)
    for node in gm.graph.nodes:  # the traced values, as Dynamo records them
        node.meta["example_value"] = node.meta.get("val")
    backend = fxsplit.Backend(capture="emulate", eager_regions=[], input_binding="copy")
    run = backend(gm, [x, x])
    with torch.no_grad(), pytest.warns(UserWarning, match="one tensor at capture"):
        for _ in range(3):
            assert torch.equal(run(x, x)[0], f(x, x))
        y = torch.randn(3, D)
        assert torch.equal(run(x, y)[0], f(x, y))
    assert _replays(backend) > 0


class _Rebinding(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("t", torch.zeros(4))

    def forward(self, x):
        h = x * 2 + self.t
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        self.t = self.t + 1
        return h * 3


@pytest.mark.parametrize("warmup_runs", [0, 1])
def test_a_buffer_rebound_to_an_output_every_step_is_copied(warmup_runs):
    """``self.t = self.t + 1``: from its first move to memory fxsplit produced (call 1), the
    buffer is copied like a runner input (before, with no warm-up, replays read a stale copy of
    it). Call 1 finds it rebound and starts the pieces afresh (warm-up, capture); every call
    after them replays both captured pieces, and nothing is recaptured. Taking the move for a
    weight reload instead (rebound only on the second consecutive move) costs a recapture with
    no warm-up and a replay per piece with one."""
    compiled_net, eager = _Rebinding(), _Rebinding()
    backend = fxsplit.Backend(capture="emulate", warmup_runs=warmup_runs)
    model = torch.compile(compiled_net, backend=backend, dynamic=True)
    steps = 6
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitWarning, match="moved on consecutive calls"):
        for step in range(steps):
            x = torch.full((2, 4), float(step))
            assert torch.equal(model(x), eager(x)), step
            assert torch.equal(compiled_net.t, eager.t), step
    (pieces,) = backend.stats.values()
    replays = {
        name: sum(c.get("replays", 0) for c in keys.values()) for name, keys in pieces.items()
    }
    assert len(replays) == 2, backend.plans[0].format()
    assert all(n == steps - 1 - warmup_runs - 1 for n in replays.values()), replays
    assert fxsplit.counters.snapshot()["recaptures"] == 0


class _Feedback(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.requires_grad_(False)

    def forward(self, x):
        h = self.a(x)
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        return h.tanh() + 0.5


def test_v2_output_fed_back_into_a_graph_captured_on_the_callers_buffer_is_never_refused():
    """Captured while bound by address to the runner's buffer, the graph then gets its own
    output back: fxsplit's memory, never a BindingError (that call runs uncaptured)."""
    net = _Feedback()
    model = torch.compile(net, backend=fxsplit.Backend(capture="emulate", runner="v2"))
    buffer = torch.randn(3, 4)
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitWarning, match="fxsplit produced"):
        model(buffer)
        model(buffer)
        out = model(buffer)
        assert torch.equal(model(out), net(net(buffer)))


class _HostKeyedRunner(nn.Module):
    def forward(self, x, n, y):
        h = (x * n).sin()
        with fxsplit.region(fxsplit.ATTENTION):
            g = h.cos()
        return g + h + y


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_strict_binding_raises_at_the_call_handing_another_tensor_even_when_it_recaptures(
    capture,
):
    """A call that recaptures a piece (replay order) still checks its persistent inputs first,
    so the runner bug is named at the call that made it, as with capture off."""
    model = torch.compile(
        _HostKeyedRunner(), backend=fxsplit.Backend(capture=capture, runner="v2"), dynamic=True
    )
    x, y = torch.ones(3), torch.full((3,), 2.0)
    with torch.no_grad(), pytest.raises(fxsplit.BindingError):
        for step, n in enumerate([1, 1, 1, 2, 2, 2]):
            model(x, n, y if step != 4 else y.clone())
    assert step == 4


class _ReadsItsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.randn(2, 3, 4))

    def forward(self, x, c):
        h = x * 2 + c.sum(0) + self.cache.mean()
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        return h + 1


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_strict_binding_checks_views_of_a_buffer_alike_with_capture_on_and_off(capture):
    net = _ReadsItsCache()
    model = torch.compile(net, backend=fxsplit.Backend(capture=capture, runner="v2"))
    x = torch.randn(3, 4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", fxsplit.FxsplitWarning)  # the refused other view
        for step in range(5):
            assert torch.equal(model(x, net.cache[step % 2]), net(x, net.cache[step % 2]))


class _ReturnsItsInput(nn.Module):
    def forward(self, x):
        h = x * 2
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        return h + 1, x[:1]


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_strict_binding_holds_when_the_graph_returns_a_view_of_the_runner_input(capture):
    """An output that is a view of the caller's tensor does not make that tensor fxsplit's."""
    model = torch.compile(
        _ReturnsItsInput(), backend=fxsplit.Backend(capture=capture, runner="v2"), dynamic=True
    )
    buffer = torch.randn(3, 4)
    with torch.no_grad(), pytest.raises(fxsplit.BindingError):
        for step in range(6):
            model(buffer if step < 3 else torch.randn(3, 4))
    assert step == 3


class _ChangesItsInputsLayout(nn.Module):
    def forward(self, x, y):
        h = x * 2
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        h.t_()  # runs eagerly (a replay runs no layout change): the piece after it is captured
        return h + y


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_strict_binding_checks_the_piece_after_an_in_place_layout_change(capture):
    """An in-place layout change is an eager piece of its own, so the piece reading ``y`` after
    it is captured (it was never captured when the change was inside it) and a fresh ``y``
    every step fails strict binding, with capture on and off alike."""
    model = torch.compile(
        _ChangesItsInputsLayout(), backend=fxsplit.Backend(capture=capture, runner="v2")
    )
    x = torch.randn(4, 4)
    with torch.no_grad(), pytest.raises(fxsplit.BindingError, match="l_y_"):
        for _ in range(5):
            y = torch.randn(4, 4)  # a fresh tensor every step
            assert torch.equal(model(x, y), _ChangesItsInputsLayout()(x, y))


@pytest.mark.skipif(not can_swap(), reason="this torch cannot move a storage's memory")
def test_a_callers_tensor_at_the_address_of_a_dropped_output_is_still_the_callers():
    """fxsplit knows its outputs by storage identity: the allocator may hand a dropped output's
    address to the caller's next tensor, which strict binding must still bind by address.

    Deterministic on any allocator: the caller's storage takes the output's memory over
    (``_swap_data_ptr_``) before the output is dropped, so it lies at the output's address."""
    backend = fxsplit.Backend(capture="emulate", runner="v2")
    model = torch.compile(_Feedback(), backend=backend)
    with torch.no_grad():
        x = torch.randn(3, 4)
        out = model(x)  # warm-up: the output is fxsplit's
        address = out.untyped_storage().data_ptr()
        mine = torch.UntypedStorage(out.untyped_storage().nbytes())
        out.untyped_storage()._swap_data_ptr_(mine)
        del out
        buffer = torch.empty(0).set_(mine, 0, (3, 4), (4, 1))
        assert buffer.data_ptr() == address
        buffer.copy_(x)
        model(buffer)  # capture: bound to the caller's buffer by address
        model(buffer)
        assert _replays(backend) == len(backend.plans[0].captured)  # each piece once
        with pytest.raises(fxsplit.BindingError):
            model(torch.randn(3, 4))


class _SoftmaxAttention(nn.Module):
    """``Linear(D, D)`` (its parameters require grad), softmax in the ATTENTION region, ``* 2``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return h * 2


def test_strict_binding_checked_with_capture_off_counts_the_grad_refusal_and_warns_nothing():
    """Found by a hunt: with capture off nothing was going to be captured, so grad enabled (a
    parameter requires grad) is counted as the refusal it would be, never warned about (it
    was, with strict binding)."""
    net = _SoftmaxAttention()
    backend = fxsplit.Backend(capture="off", runner="v2")
    model = torch.compile(net, backend=backend)
    x = torch.randn(4, D)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert torch.equal(model(x), net(x))
    pieces = [p for graph in backend.stats.values() for p in graph.values()]
    refused = [why for p in pieces for why in p["refused"]]
    assert refused and all("grad is enabled" in why for why in refused), backend.stats


class _TanhSinLinear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x).tanh()
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.sin()
        return self.b(h)


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_strict_binding_sees_the_callers_tensor_given_new_memory_in_place(capture):
    """Found by a hunt: the runner's persistent tensor is the same Python object every step, but
    ``x.set_(new)`` gives it other memory. The address check was skipped for the very object
    bound at capture, so each replay read the old memory (wrong by 0.48, no warning); the
    object's address is checked like any other's: a BindingError, as for a moved buffer."""
    model = torch.compile(_TanhSinLinear(), backend=fxsplit.Backend(capture=capture, runner="v2"))
    x = torch.zeros(3, D)
    with torch.no_grad(), pytest.raises(fxsplit.BindingError, match="l_x_"):
        for step in range(6):
            x.set_(torch.full((3, D), float(step)))  # same object, new storage
            assert torch.equal(model(x), _TanhSinLinear()(x)), step
    assert step == 2  # warm-up, capture, then the first call that hands other memory


# ---------------------------------------------------------------------------------------------
# When fxsplit's copy of a caller's tensor still holds its values
#
# A copy made earlier in a call counts for the pieces after it only while the caller's tensor
# is unchanged, and its version counter is not the whole story: another tensor over the same
# memory (``torch.from_numpy(a.numpy())``) has a counter of its own. What may write that memory
# unseen ends the copy's validity: a piece's uncaptured run, a captured piece's write-back.


class _WritesAOverB(nn.Module):
    """``b`` is another tensor over ``a``'s memory with a version counter of its own. The first
    captured piece reads ``b``, the second writes ``a`` in place, the third reads ``b`` again;
    the eager pieces between them are pure (``sin``, ``cos``: nothing there writes). With
    ``reads_b`` the second piece reads ``b`` too, so its capture is refused (separate static
    buffers could not keep ``a`` and ``b`` one memory) and it runs uncaptured every call."""

    def __init__(self, reads_b: bool):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(D, D), requires_grad=False)
        self.reads_b = reads_b

    def forward(self, x, a, b):
        h = torch.tanh(x @ self.w) + b
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.sin()
        a.mul_(h + b if self.reads_b else h)
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.cos()
        return h * b


class _WritesAThroughOut(nn.Module):
    """:class:`_WritesAOverB` with the write in the eager piece, through ``out=``
    (``torch.add(h, 1.0, out=a)``): its only op, a call of torch's own that writes nothing but
    the ``out=`` argument."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(D, D), requires_grad=False)

    def forward(self, x, a, b):
        h = torch.tanh(x @ self.w) + b
        with fxsplit.region(fxsplit.ATTENTION):
            torch.add(h, 1.0, out=a)
        return h * b


def _run_over_one_memory(make, runner: str = "v2") -> fxsplit.Backend:
    """Six calls of the model ``make`` makes, compiled and eager, each on ``a`` refilled and
    ``b`` over its memory; the outputs and ``a`` must be eager's, bit for bit. Under runner
    v2 (copy binding) a piece writing ``a`` is captured; under v1 it runs with the eager piece
    beside it (``a`` is a runner tensor the step writes: fxsplit.passes.cache_ops)."""
    model, eager = make(), make()
    backend = fxsplit.Backend(capture="emulate", runner=runner, input_binding="copy")
    compiled = torch.compile(model, backend=backend)
    a_c, a_e = torch.zeros(4, D), torch.zeros(4, D)
    b_c, b_e = torch.from_numpy(a_c.numpy()), torch.from_numpy(a_e.numpy())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", fxsplit.FxsplitWarning)  # the refused captures
        for step in range(6):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
            fill = torch.randn(4, D, generator=torch.Generator().manual_seed(100 + step))
            a_c.copy_(fill)
            a_e.copy_(fill)
            got, want = compiled(x, a_c, b_c), eager(x, a_e, b_e)
            assert torch.equal(got, want), (step, (got - want).abs().max().item())
            assert torch.equal(a_c, a_e), step
    return backend


def _piece_counts(backend, name: str) -> dict[str, int]:
    return _counts(backend, "graph_0", name)


def _total(backend, counter: str) -> int:
    """``counter`` summed over every captured piece of every graph of ``backend``."""
    return sum(
        _counts(backend, graph, name)[counter]
        for graph, pieces in backend.stats.items()
        for name in pieces
    )


def _counts(backend, graph: str, name: str) -> dict[str, int]:
    keys = [c for k, c in backend.stats[graph][name].items() if k != "refused"]
    names = ("captures", "replays", "uncaptured_runs", "reorders")
    return {k: sum(c.get(k, 0) for c in keys) for k in names}


def test_a_copy_made_before_an_earlier_piece_ran_uncaptured_is_made_again():
    """The second piece runs uncaptured and writes ``b``'s memory through ``a``, which ``b``'s
    version counter does not see: the third piece copies ``b`` again rather than replay the
    copy the first piece made."""
    backend = _run_over_one_memory(lambda: _WritesAOverB(reads_b=True))
    first, middle, last = sorted(backend.stats["graph_0"])
    assert any("share storage" in why for why in backend.stats["graph_0"][middle]["refused"])
    assert _piece_counts(backend, middle)["captures"] == 0
    assert _piece_counts(backend, middle)["uncaptured_runs"] == 6
    assert _piece_counts(backend, first)["replays"] >= 3
    assert _piece_counts(backend, last)["replays"] >= 3


def test_a_write_back_to_a_callers_tensor_makes_the_copies_of_its_memory_stale():
    """The second piece replays and writes ``a`` back: ``b``'s memory changed where ``b``'s
    version counter does not see it, so the third piece copies ``b`` again rather than replay
    the copy the first piece made."""
    backend = _run_over_one_memory(lambda: _WritesAOverB(reads_b=False))
    assert sorted(backend.stats["graph_0"]) == ["piece_0", "piece_2", "piece_4"]
    for name in backend.stats["graph_0"]:
        assert _piece_counts(backend, name)["replays"] >= 3, name


def test_a_copy_made_before_an_eager_piece_writing_through_out_is_made_again():
    """An eager piece whose op hands an ``out=`` argument may write (whatever its functional
    overloads say), here ``b``'s memory through ``a``: the piece after it copies ``b`` again
    rather than replay the copy the first piece made."""
    backend = _run_over_one_memory(_WritesAThroughOut)
    assert sorted(backend.stats["graph_0"]) == ["piece_0", "piece_2"]
    for name in backend.stats["graph_0"]:
        assert _piece_counts(backend, name)["replays"] >= 3, name


def test_a_copy_made_before_an_eager_piece_writing_a_callers_tensor_in_place_is_made_again():
    """Under v1 ``a.mul_`` runs in the eager piece (a runner tensor the step writes), whose
    torch op bumps ``a``'s version counter but not ``b``'s: the piece after it copies ``b``
    again (the memory the eager piece wrote) rather than replay the first piece's copy."""
    backend = _run_over_one_memory(lambda: _WritesAOverB(reads_b=False), runner="v1")
    plan = backend.plans[0]
    assert [p.kind for p in plan.pieces] == ["captured", "eager", "captured"]
    assert "cache:a" in plan.pieces[1].reasons
    for name in backend.stats["graph_0"]:
        assert _piece_counts(backend, name)["replays"] >= 3, name


class _WritesAThroughANamedOutOverload(_WritesAThroughOut):
    """:class:`_WritesAThroughOut` writing ``a`` through an out= overload called by name, whose
    output arguments are not called ``out`` (``aten.sort.values(h, values=a, indices=i)``)."""

    def forward(self, x, a, b):
        h = torch.tanh(x @ self.w) + b
        with fxsplit.region(fxsplit.ATTENTION):
            order = torch.empty(a.shape, dtype=torch.int64)
            torch.ops.aten.sort.values(h, -1, False, values=a, indices=order)
        return h * b


def test_a_copy_made_before_a_write_through_a_named_out_overload_is_made_again():
    """Found by a hunt: ``aten.sort.values`` names its outputs ``values=`` and ``indices=``, so
    the write to ``a`` was taken for none, and the piece after the eager one replayed its copy
    of ``b`` (``a``'s memory under a counter of its own): wrong by 5.6, no warning."""
    backend = _run_over_one_memory(_WritesAThroughANamedOutOverload, runner="v1")
    for name in backend.stats["graph_0"]:
        assert _piece_counts(backend, name)["replays"] >= 3, name


class _WritesStaticA(nn.Module):
    """The second captured piece writes ``a``, which the caller declared static (bound by
    address); ``b`` is ``a``'s memory under a counter of its own, read before and after."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(D, D), requires_grad=False)

    def forward(self, x, a, b):
        h = torch.tanh(x @ self.w) + b
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        a.add_(h)
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return h * b


def test_a_captured_write_to_a_static_input_makes_the_copies_of_its_memory_stale():
    """Found by a hunt: a captured piece writing an input bound by address (no write-back to
    make) only bumped its version counter; the piece after it replayed the copy of ``b`` made
    before (``a``'s memory under a counter of its own): wrong by 4.0 from the capture on."""
    model, eager = _WritesStaticA(), _WritesStaticA()
    backend = fxsplit.Backend(capture="emulate", runner="v2", input_binding="copy")
    compiled = torch.compile(model, backend=backend)
    a_c, a_e = torch.zeros(4, D), torch.zeros(4, D)
    torch._dynamo.mark_static_address(a_c)
    b_c, b_e = torch.from_numpy(a_c.numpy()), torch.from_numpy(a_e.numpy())
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
            got, want = compiled(x, a_c, b_c), eager(x, a_e, b_e)
            assert torch.equal(got, want), (step, (got - want).abs().max().item())
            assert torch.equal(a_c, a_e), step
    for name in backend.stats["graph_0"]:
        assert _piece_counts(backend, name)["replays"] >= 3, name


def test_a_copy_of_memory_a_captured_graph_writes_is_remembered_again_once_its_graph_is_freed():
    """While a captured graph writes ``a`` by address, the copy of ``b`` (``a``'s memory) is
    made every call; once the graph is freed (``reset``), its span is no longer registered."""
    model = _WritesStaticA()
    backend = fxsplit.Backend(capture="emulate", runner="v2", input_binding="copy")
    compiled = torch.compile(model, backend=backend)
    a = torch.zeros(4, D)
    torch._dynamo.mark_static_address(a)
    b = torch.from_numpy(a.numpy())
    with torch.no_grad():
        for step in range(3):
            compiled(torch.randn(4, D, generator=torch.Generator().manual_seed(step)), a, b)
    context = backend.runtimes[0].context
    storage = a.untyped_storage()
    span = (storage.data_ptr(), storage.data_ptr() + storage.nbytes())
    assert context.buffers.written.overlaps(span)
    marks = [buffer.mark[4] for buffer in context.buffers if buffer.mark is not None]
    assert not [m for m in marks if m[0] < span[1] and span[0] < m[1]], marks
    backend.runtimes[0].reset()
    assert not context.buffers.written.overlaps(span)


_INNER: dict = {"call": None, "depth": 0}


@torch.library.custom_op("fxsplit_binding::call_inside", mutates_args=())
def _call_inside(x: torch.Tensor) -> torch.Tensor:
    """Calls ``_INNER["call"]`` once (not from inside itself), then returns a copy of ``x``."""
    if _INNER["depth"] == 0 and _INNER["call"] is not None:
        _INNER["depth"] += 1
        try:
            _INNER["call"]()
        finally:
            _INNER["depth"] -= 1
    return x.clone()


@_call_inside.register_fake
def _(x):
    return torch.empty_like(x)


class _CallsItselfInside(nn.Module):
    """An eager op calls the compiled model itself (another batch size, one graph under
    ``dynamic=True``); then a piece reads ``b``, an eager piece writes ``a`` (``b``'s memory,
    a counter of its own) and the last piece reads ``b`` again."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(D, D), requires_grad=False)

    def forward(self, x, a, b):
        x = torch.ops.fxsplit_binding.call_inside(x)
        h = torch.tanh(x @ self.w) + b
        with fxsplit.region(fxsplit.ATTENTION):
            a.mul_(0.5).add_(h.sin())
        return torch.tanh(h @ self.w) * b


def test_a_call_of_the_graph_inside_its_own_call_leaves_the_outer_calls_copy_rule_intact():
    """Found by a review: the inner call ended by forgetting the arguments of the call around
    it, so the outer copies of ``b`` were not flagged as lying over memory an eager piece
    writes, and the last piece replayed a stale copy (wrong by 0.91, no warning; before the
    flag, the same program raised IndexError)."""
    backend = fxsplit.Backend(capture="emulate", splitting_ops=["fxsplit_binding::call_inside"])
    model, eager = _CallsItselfInside(), _CallsItselfInside()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    a_c, a_e = torch.zeros(4, D), torch.zeros(4, D)
    b_c, b_e = torch.from_numpy(a_c.numpy()), torch.from_numpy(a_e.numpy())
    i_c, i_e = torch.zeros(2, D), torch.zeros(2, D)  # the inner call's a, and its twin
    j_c, j_e = torch.from_numpy(i_c.numpy()), torch.from_numpy(i_e.numpy())
    try:
        with torch.inference_mode():
            for step in range(6):
                x = torch.randn(4, D, generator=torch.Generator().manual_seed(step))
                y = torch.randn(2, D, generator=torch.Generator().manual_seed(50 + step))
                fill = torch.randn(4, D, generator=torch.Generator().manual_seed(100 + step))
                a_c.copy_(fill)
                a_e.copy_(fill)
                _INNER["call"] = lambda y=y: eager(y, i_e, j_e)
                want = eager(x, a_e, b_e)
                _INNER["call"] = lambda y=y: compiled(y, i_c, j_c)
                got = compiled(x, a_c, b_c)
                assert torch.equal(got, want), (step, (got - want).abs().max().item())
                assert torch.equal(a_c, a_e) and torch.equal(i_c, i_e), step
    finally:
        _INNER["call"] = None
    assert len(backend.runtimes) == 1  # one graph, called inside itself
    for name in backend.stats["graph_0"]:  # the outer calls replay (the inner run through)
        assert _piece_counts(backend, name)["replays"] >= 4, name


class _CallsItselfInsideFirst(nn.Module):
    """The eager op calling the model itself reads the first piece's output, which the inner
    call's pieces would write again (same graph, same capture key)."""

    def forward(self, x, y):
        h = y.relu()
        with fxsplit.region(fxsplit.ATTENTION):
            h = torch.ops.fxsplit_binding.call_inside(h).sin()
        h = y + h
        with fxsplit.region(fxsplit.ATTENTION):
            x.mul_(h)
            h = h.tanh()
        return y * h


def test_a_graph_called_inside_its_own_call_at_the_same_key_leaves_the_outer_values():
    """Found by the property's new draw: the inner call replayed the graphs of the outer call's
    key, over the memory holding the outer call's values still in use (the first piece's output
    the calling op reads): wrong by up to 0.70 from the first replay, no warning. The inner call
    runs uncaptured (its pieces counted as uncaptured runs); the outer one replays."""
    backend = fxsplit.Backend(
        capture="emulate", input_binding="copy", splitting_ops=["fxsplit_binding::call_inside"]
    )
    model = _CallsItselfInsideFirst()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    try:
        for step in range(6):
            x, y, inner, inner_y = (torch.randn(3, D, generator=gen) for _ in range(4))
            xe, xc, ie, ic = x.clone(), x.clone(), inner.clone(), inner.clone()
            with torch.inference_mode():
                _INNER["call"] = lambda ie=ie, iy=inner_y: model(ie, iy)
                want = model(xe, y)
                _INNER["call"] = lambda ic=ic, iy=inner_y: compiled(ic, iy)
                got = compiled(xc, y)
            assert torch.equal(got, want), (step, (got - want).abs().max().item())
            assert torch.equal(xc, xe) and torch.equal(ic, ie), step
    finally:
        _INNER["call"] = None
    assert len(backend.runtimes) == 1
    for name in backend.stats["graph_0"]:
        counts = _piece_counts(backend, name)
        assert counts["replays"] >= 4 and not counts["reorders"], (name, counts)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(7)))

    def forward(self, x):
        h = (x @ self.w).sigmoid()
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return (h @ self.w).cos()


def test_a_graph_called_several_times_inside_anothers_call_replays_each_call_in_order():
    """Found by an adversarial review: a second model called three times by the first model's
    eager op (one step: a call inside another's is part of its step) recaptured its pieces at
    its second and third calls of every step, and so did the outer piece after the op (the
    same graphs replayed again after later ones): right numbers, 16 reorders per piece over
    8 steps, no warning; on a GPU a capture per call. Each call of a graph in a step now has
    graphs of its own, replayed in capture order from one step to the next (as cudagraph
    trees record a node per call path)."""
    backend = fxsplit.Backend(capture="emulate", splitting_ops=["fxsplit_binding::call_inside"])
    outer, inner = _CallsItselfInsideFirst(), _Inner()
    compiled_outer = torch.compile(outer, backend=backend, dynamic=True)
    compiled_inner = torch.compile(inner, backend=backend, dynamic=True)
    gen = torch.Generator().manual_seed(0)

    def three_calls(model, x, kept):
        first = model(x)
        second = model(first * 0.5)
        kept.append(model(first + second))

    try:
        with torch.inference_mode():
            for step in range(8):
                x, y, z = (torch.randn(3, D, generator=gen) for _ in range(3))
                kept_e, kept_c = [], []
                _INNER["call"] = lambda z=z, kept=kept_e: three_calls(inner, z, kept)
                want = outer(x.clone(), y)
                _INNER["call"] = lambda z=z, kept=kept_c: three_calls(compiled_inner, z, kept)
                got = compiled_outer(x.clone(), y)
                assert torch.equal(got, want), (step, (got - want).abs().max().item())
                assert torch.equal(kept_c[0], kept_e[0]), step
    finally:
        _INNER["call"] = None
    for graph, pieces in backend.stats.items():
        for name in pieces:
            counts = _counts(backend, graph, name)
            # two steps warm up and capture; six replay, once per call of the graph
            calls = 3 if graph != "graph_0" else 1
            assert counts["reorders"] == 0, (graph, name, counts)
            assert counts["captures"] == calls, (graph, name, counts)
            assert counts["replays"] == 6 * calls, (graph, name, counts)


class _OtherInner(_Inner):
    """A graph of its own (instances of one class share one)."""

    def forward(self, x):
        return super().forward(x).tanh()


def test_graphs_called_inside_anothers_call_in_an_order_that_changes_each_step_warn_once():
    """Two models called by the first model's eager op in an order that alternates from step
    to step: each step's first model replays graphs captured after the other's, so one of them
    recaptures at every step (a capture per step on a GPU, numbers right). fxsplit cannot key
    that apart; it says so once, naming the piece and what to do."""
    backend = fxsplit.Backend(capture="emulate", splitting_ops=["fxsplit_binding::call_inside"])
    outer, first, second = _CallsItselfInsideFirst(), _Inner(), _OtherInner()
    compiled_outer = torch.compile(outer, backend=backend, dynamic=True)
    compiled = [torch.compile(m, backend=backend, dynamic=True) for m in (first, second)]
    gen = torch.Generator().manual_seed(0)

    def both(models, z, kept, step):
        order = models if step % 2 else models[::-1]
        kept.extend(model(z) for model in order)

    try:
        with torch.inference_mode(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(10):
                x, y, z = (torch.randn(3, D, generator=gen) for _ in range(3))
                kept_e, kept_c = [], []
                _INNER["call"] = lambda z=z, k=kept_e, s=step: both((first, second), z, k, s)
                want = outer(x.clone(), y)
                _INNER["call"] = lambda z=z, k=kept_c, s=step: both(compiled, z, k, s)
                got = compiled_outer(x.clone(), y)
                assert torch.equal(got, want), step
                assert all(map(torch.equal, kept_c, kept_e)), step
    finally:
        _INNER["call"] = None
    assert _total(backend, "reorders") >= 6, backend.stats
    messages = [str(w.message) for w in seen if "capture order" in str(w.message)]
    assert len(messages) == 1, messages
    assert "recaptured" in messages[0] and "fxsplit.Backend" in messages[0], messages[0]


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_a_strict_runner_calling_a_graph_twice_inside_anothers_call_binds_each_call_apart(capture):
    """Found by an adversarial review: under runner v2 (strict binding) a second model called
    twice by the first model's eager op, each call with a persistent buffer of its own. Emulate
    (and CUDA) bind each call's graphs apart; with capture off the strict check looked up the
    first call's addresses for the second call and raised BindingError at step 1: a right
    runner failed on a CPU machine and worked on a GPU."""
    backend = fxsplit.Backend(
        capture=capture, runner="v2", splitting_ops=["fxsplit_binding::call_inside"]
    )
    outer, inner = _CallsItselfInsideFirst(), _Inner()
    compiled_outer = torch.compile(outer, backend=backend)
    compiled_inner = torch.compile(inner, backend=backend)
    x, y, z1, z2 = (torch.zeros(3, D) for _ in range(4))  # the runner's persistent buffers
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for step in range(6):
                for t in (x, y, z1, z2):
                    t.copy_(torch.randn(3, D, generator=gen))
                kept_e, kept_c = [], []
                _INNER["call"] = lambda k=kept_e: k.extend((inner(z1), inner(z2)))
                x_e = x.clone()
                want = outer(x_e, y)
                _INNER["call"] = lambda k=kept_c: k.extend((compiled_inner(z1), compiled_inner(z2)))
                got = compiled_outer(x, y)
                assert torch.equal(got, want) and torch.equal(x, x_e), step
                assert all(map(torch.equal, kept_c, kept_e)), step
    finally:
        _INNER["call"] = None
    if capture == "emulate":
        counts = _counts(backend, "graph_1", "piece_0")
        assert counts["replays"] == 8 and not counts["reorders"], counts


def test_a_graph_called_inside_anothers_call_under_no_grad_and_inference_mode_in_turn():
    """Found by an adversarial review: inside an eager op's kernel Dynamo's guards see the same
    dispatch keys under ``torch.no_grad()`` and ``torch.inference_mode()``, so the inner model
    keeps one graph for both; fxsplit's static buffer made under inference mode was an
    inference tensor, and the no_grad step's copy into it raised where eager works (warned and
    run uncaptured at step 2, raised at step 4). Static buffers are made outside inference
    mode: the steps replay."""
    backend = fxsplit.Backend(capture="emulate", splitting_ops=["fxsplit_binding::call_inside"])
    outer, inner = _CallsItselfInsideFirst(), _Inner()
    compiled_outer = torch.compile(outer, backend=backend)
    compiled_inner = torch.compile(inner, backend=backend)
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(3, D, generator=gen)  # a caller's tensor, made outside both modes
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", fxsplit.FxsplitRuntimeWarning)
            for step in range(8):
                x, y = (torch.randn(3, D, generator=gen) for _ in range(2))
                mode = torch.inference_mode() if step % 2 else torch.no_grad()
                with mode:
                    kept_e, kept_c = [], []
                    _INNER["call"] = lambda k=kept_e: k.append(inner(state))
                    want = outer(x.clone(), y)
                    _INNER["call"] = lambda k=kept_c: k.append(compiled_inner(state))
                    got = compiled_outer(x.clone(), y)
                assert torch.equal(got, want) and torch.equal(kept_c[0], kept_e[0]), step
    finally:
        _INNER["call"] = None
    assert _total(backend, "replays") >= 8, backend.stats
