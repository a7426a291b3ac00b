"""Sizes that change every step run eagerly (fxsplit.passes.step_sizes), the rest replays; the
replay watch warns when a captured piece never replays (fxsplit.runtime.piece.replay_watch)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit import counters
from fxsplit.facts.symbols import describe, symbols
from fxsplit.runtime.piece import replay_watch

# The toy models have no attention region: the runner's "no node is in any region" is expected.
pytestmark = [
    pytest.mark.usefixtures("fresh_capture_state"),
    pytest.mark.filterwarnings("ignore:.*is in any region:fxsplit.FxsplitWarning"),
]

STEPS = 12
REPLAYS_FROM = 4  # (1-based) the first decode graph is static, the next captures on its 2nd call


class GrowingCache:
    """Keys grown by concatenation every step, as transformers' ``DynamicCache`` does."""

    def __init__(self, width: int = 8):
        self.keys = torch.zeros(1, 2, width)


class Decoder(nn.Module):
    """A decode step: projections, a cache update and attention over the cache (matmul and
    softmax, no attention op), an output projection."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x, cache):
        q = self.q(x)
        cache.keys = torch.cat([cache.keys, self.k(x)], dim=1)
        cache.keys.numel()  # read and dropped: Dynamo keeps the unused host value
        scores = (q @ cache.keys.transpose(1, 2)).softmax(-1)
        return self.out(scores @ cache.keys).relu()


def _decode(model, steps=STEPS, seed=0):
    torch.manual_seed(seed)
    cache = GrowingCache()
    xs = [torch.randn(1, 1, 8) for _ in range(steps)]
    outs, calls = [], []
    with torch.no_grad():
        for x in xs:
            before = counters.snapshot()
            outs.append(model(x, cache).clone())
            after = counters.snapshot()
            calls.append({k: after[k] - before[k] for k in ("captures", "replays")})
            calls[-1]["calls"] = sum(
                after[k] - before[k] for k in ("captures", "replays", "uncaptured_runs")
            )
    return outs, calls


def _dynamic_plan(backend):
    return next(p for p in backend.plans if any(r.startswith("dynamic:") for r in _reasons(p)))


def _reasons(plan):
    return {r for piece in plan.eager for r in piece.reasons}


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_growing_cache_runs_eagerly_and_the_rest_replays_every_step(runner):
    torch.manual_seed(0)
    model = Decoder().eval()
    want, _ = _decode(model)
    backend = fxsplit.Backend(runner=runner, capture="emulate", input_binding="copy")
    got, calls = _decode(torch.compile(model, backend=backend))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    late = calls[REPLAYS_FROM:]
    assert sum(c["calls"] for c in late) > 0
    assert all(c["replays"] == c["calls"] for c in late), calls
    plan = _dynamic_plan(backend)
    # the cache's length makes the work over it eager; its matmul + softmax + matmul is
    # attention too, found by its shape
    assert _reasons(plan) == {
        "dynamic:cache.keys.size(1)",
        "preset:eager_attention",
        "region:attention",
    }
    assert [p.kind for p in plan.pieces] == ["captured", "eager", "captured"], plan.format()
    # the cache is an input of the eager piece only: never copied into fxsplit's buffers
    for runtime in backend.runtimes:
        if runtime.split.plan is not plan:
            continue
        for piece in runtime.pieces:
            assert not any("cache" in s.source for s in piece.specs), piece.name


def test_an_unused_host_value_of_a_step_size_is_dropped_not_left_between_pieces():
    backend = fxsplit.Backend(capture="off")
    _decode(torch.compile(Decoder().eval(), backend=backend), steps=3)
    split = next(s for s in backend.compiled if s.steps.symbols)
    assert split.steps.dropped  # the numel() the model read and threw away
    assert not any(n.name in split.steps.dropped for n in split.graph_module.graph.nodes)


def test_every_captured_key_reads_only_the_token_count():
    """The property behind the rule: in a graph with step sizes, no captured piece's capture key
    reads one (else it would meet a new key every step)."""
    backend = fxsplit.Backend(capture="emulate")
    _decode(torch.compile(Decoder().eval(), backend=backend), steps=4)
    checked = 0
    for runtime in backend.runtimes:
        steps = runtime.split.steps
        nodes = {n.name: n for n in runtime.split.graph_module.graph.nodes}
        for piece in runtime.pieces:
            for spec in piece.specs:
                found = symbols(nodes[spec.name].meta.get("example_value"))
                assert not found & set(steps.symbols), (piece.name, spec.name)
                checked += 1
    assert checked


def test_host_int_growing_every_step_runs_eagerly():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, n):
            return self.lin(self.lin(x) * n).relu()

    model = Scale().eval()
    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 8)
    replays = 0
    with torch.no_grad():
        for n in range(1, 10):
            before = counters.snapshot()["replays"]
            assert torch.equal(compiled(x, n), model(x, n))
            replays = counters.snapshot()["replays"] - before
    assert replays == 2  # the projections before and after; the multiply by n is eager
    assert _reasons(backend.plans[-1]) == {"dynamic:n"}


class Table(nn.Module):
    """Reads a runner argument whose width is symbolic under dynamic=True but never changes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, table):
        return self.lin(x) + table.float().sum(-1, keepdim=True)


def test_dynamic_true_keeps_argument_sizes_captured_but_not_a_caches():
    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(Table(), backend=backend, dynamic=True)
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(3, 8), torch.ones(3, 5, dtype=torch.int32))
    assert [p.kind for p in backend.plans[0].pieces] == ["captured"]
    assert counters.snapshot()["replays"] == 1
    torch._dynamo.reset()
    backend = fxsplit.Backend(capture="off")
    _decode(torch.compile(Decoder().eval(), backend=backend, dynamic=True), steps=2)
    assert "dynamic:cache.keys.size(1)" in _reasons(backend.plans[-1])


def test_token_count_stays_captured_and_keys_on_it():
    model = Decoder().eval()
    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(model.out, backend=backend)
    with torch.no_grad():
        for tokens in (3, 4, 3, 4, 3, 4, 3):
            x = torch.randn(tokens, 8)
            assert torch.equal(compiled(x), model.out(x))
    assert all(p.kind == "captured" for p in backend.plans[-1].pieces)
    assert counters.snapshot()["replays"] == 2  # 4 and 3 warm up, capture, then replay


def test_describe_speaks_the_models_terms():
    assert describe("L['kwargs']['cache'].layers[0].keys.size()[2]") == (
        "cache.layers[0].keys.size(2)"
    )
    assert describe("L['x'].stride()[1]") == "x.stride(1)"
    assert describe("L['n']") == "n"
    assert describe("G['step']") == "G['step']"


class Grow(nn.Module):
    def forward(self, x, n):
        return (x * n).relu() + 1


def test_watch_warns_once_naming_the_piece_and_what_changed(caplog):
    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(Grow(), backend=backend, dynamic=True)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for n in range(2, 2 + 2 * replay_watch.NEW_KEYS):
            compiled(x, n)
    mine = [str(w.message) for w in seen if "new capture key" in str(w.message)]
    assert len(mine) == 1, mine
    assert "graph_0: piece_0 met 8 new capture keys in a row and replayed none" in mine[0]
    assert "n (2, 3, 4, ..., 9) changed every time" in mine[0]
    assert "compile without dynamic=True" in mine[0]
    with caplog.at_level(logging.INFO, logger="fxsplit"):
        backend.reset()
    assert "fxsplit graph_0: 1 captured piece, 16 calls: 0 replays (0 %)" in caplog.text


def test_watch_stays_silent_for_a_piece_that_replayed_before_its_new_keys():
    """A piece that replayed once has a key that repeats: later new keys (a workload with many
    sizes) are no reason to warn, however many."""
    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(Grow(), backend=backend, dynamic=True)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for n in (2, 2, 2, *range(3, 3 + 2 * replay_watch.NEW_KEYS)):
            compiled(x, n)
    assert counters.snapshot()["replays"] == 1
    assert not [w for w in seen if "new capture key" in str(w.message)]


def test_watch_names_the_token_count_and_capture_sizes():
    backend = fxsplit.Backend(capture="emulate")
    lin = nn.Linear(8, 8)
    compiled = torch.compile(lin, backend=backend, dynamic=True)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for tokens in range(2, 2 + replay_watch.NEW_KEYS):
            compiled(torch.randn(tokens, 8))
    mine = [str(w.message) for w in seen if "new capture key" in str(w.message)]
    assert len(mine) == 1 and "the token count args[0].size(0)" in mine[0], mine
    assert "capture_sizes" in mine[0]


def test_watch_stays_silent_where_pieces_replay():
    backend = fxsplit.Backend(capture="emulate")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, calls = _decode(torch.compile(Decoder().eval(), backend=backend))
    late = calls[REPLAYS_FROM:]
    assert sum(c["calls"] for c in late) > 0
    assert all(c["replays"] == c["calls"] for c in late), calls  # silent because they replay
    assert replay_watch.summary("g", {"p": {"k": {"replays": 3, "captures": 1}}}) == (
        "fxsplit g: 1 captured piece, 4 calls: 3 replays (75 %), 1 capture, 0 uncaptured runs"
    )
    assert replay_watch.summary("g", {}) is None


class Sampled(nn.Module):
    """Draws a mask over the grown cache, then more random numbers before using it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache, draw):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        mask = draw(cache.keys.shape[1])
        noise = torch.rand_like(x)
        return (cache.keys * mask[None, :, None]).sum(1) + self.lin(noise)


def _equals_eager_step_by_step(model: nn.Module, capture: str = "emulate", *extra) -> None:
    """Decode 6 steps over a fresh :class:`GrowingCache` (same seed) eagerly and compiled:
    every step equal, and under emulated capture some piece replayed."""

    def run(fn):
        torch.manual_seed(0)
        cache = GrowingCache()
        with torch.no_grad():
            return [fn(torch.randn(1, 1, 8), cache, *extra).clone() for _ in range(6)]

    want = run(model)
    got = run(torch.compile(model, backend=fxsplit.Backend(capture=capture)))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if capture == "emulate":
        assert counters.snapshot()["replays"] > 0


@pytest.mark.parametrize(
    "draw",
    [
        lambda n: torch.full((n,), 0.5).bernoulli(),
        lambda n: torch.nn.functional.dropout(torch.ones(n), 0.5),
    ],
    ids=["bernoulli", "dropout"],
)
def test_random_work_over_a_step_size_keeps_its_place_in_the_random_stream(draw):
    """Work that feeds only step-size nodes moves next to them; a random op moved past another
    draws the other's numbers."""
    _equals_eager_step_by_step(Sampled().eval(), "emulate", draw)


CAPTURE_SIZES = [2 * k for k in range(1, replay_watch.NEW_KEYS + 3)]  # more than NEW_KEYS


def test_watch_stays_silent_over_sizes_captured_up_front():
    """``Backend.capture`` meets one new key per size by design, each replayed later."""
    model = nn.Linear(8, 8)
    backend = fxsplit.Backend(capture="emulate", capture_sizes=CAPTURE_SIZES, eager_regions=[])
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend.capture(compiled, {s: (torch.randn(s, 8),) for s in CAPTURE_SIZES})
        with torch.no_grad():
            for size in CAPTURE_SIZES:
                x = torch.randn(size, 8)
                assert torch.equal(compiled(x), model(x))
    assert counters.snapshot()["replays"] == len(CAPTURE_SIZES)


def test_watch_stays_silent_over_a_warm_up_of_the_capture_sizes():
    """An engine warming every capture size in turn: the token count is bounded by the sizes."""
    model = nn.Linear(8, 8)
    backend = fxsplit.Backend(capture="emulate", capture_sizes=CAPTURE_SIZES, eager_regions=[])
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        for _ in range(2):
            for size in CAPTURE_SIZES:
                compiled(torch.randn(size, 8))
        # a third round replays every size: the warm-up and capture rounds were that, no churn
        before = counters.snapshot()["replays"]
        for size in CAPTURE_SIZES:
            x = torch.randn(size, 8)
            assert torch.equal(compiled(x), model(x)), size
    assert counters.snapshot()["replays"] - before == len(CAPTURE_SIZES)


def test_watch_still_warns_after_sizes_captured_up_front():
    """Keys met up front do not count; keys met later that never repeat do."""
    backend = fxsplit.Backend(capture="emulate")
    compiled = torch.compile(Grow(), backend=backend, dynamic=True)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        backend.capture(compiled, {n: (x, n) for n in range(100, 100 + replay_watch.NEW_KEYS)})
        assert not [w for w in seen if "new capture key" in str(w.message)]
        assert counters.snapshot()["captures"] == replay_watch.NEW_KEYS  # one per key met
        for n in range(2, 2 + replay_watch.NEW_KEYS):
            compiled(x, n)
    mine = [str(w.message) for w in seen if "new capture key" in str(w.message)]
    assert len(mine) == 1 and "n (2, 3, 4, ..., 9) changed every time" in mine[0], mine


class Rewritten(nn.Module):
    """Positions over the grown cache, read before an in-place write to them and used after."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        positions = torch.arange(cache.keys.shape[1], dtype=torch.float32)
        doubled = positions * 2
        positions[1:].add_(1)  # through a view
        return self.lin((cache.keys * (positions + doubled)[None, :, None]).sum(1))


def test_work_feeding_step_size_nodes_never_moves_past_a_write_to_what_it_reads():
    _equals_eager_step_by_step(Rewritten().eval(), "emulate")


class RewrittenThroughAlias(nn.Module):
    """As :class:`Rewritten`, the write going through an alias made by an op that also reads a
    tensor of the step (``positions.view_as(x)``, ``positions.to(x)``): the alias is no pure
    work of host values, yet it shares the positions' memory."""

    def __init__(self, alias):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.alias = alias

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        positions = torch.arange(cache.keys.shape[1], dtype=torch.float32)
        doubled = positions * 2
        self.alias(positions, cache.keys[0, :, 0]).add_(1)
        return self.lin((cache.keys * (positions + doubled)[None, :, None]).sum(1))


@pytest.mark.parametrize(
    "alias",
    [
        lambda positions, like: positions.view_as(like),
        lambda positions, like: positions.to(like),
        lambda positions, like: positions.type_as(like),
    ],
    ids=["view_as", "to", "type_as"],
)
@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_work_feeding_step_size_nodes_never_moves_past_a_write_through_an_alias(alias, capture):
    _equals_eager_step_by_step(RewrittenThroughAlias(alias).eval(), capture)


class Normalised(nn.Module):
    """Running statistics over the grown cache, read before the norm updates them and used
    after: ``batch_norm`` and ``instance_norm`` write them, their schemas do not say so."""

    def __init__(self, norm):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = norm

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        mean = torch.zeros(cache.keys.shape[1])
        before = mean + 1
        normed = self.norm(cache.keys, mean, torch.ones(cache.keys.shape[1]))
        return self.lin((normed * (before + mean)[None, :, None]).sum(1))


@pytest.mark.parametrize(
    "norm",
    [
        lambda x, mean, var: nn.functional.batch_norm(x, mean, var, training=True, momentum=0.5),
        lambda x, mean, var: nn.functional.instance_norm(x, mean, var, momentum=0.5),
    ],
    ids=["batch_norm", "instance_norm"],
)
def test_work_feeding_step_size_nodes_never_moves_past_a_write_its_schema_hides(norm):
    _equals_eager_step_by_step(Normalised(norm).eval(), "emulate")


class DefaultDtype(nn.Module):
    """Positions over the grown cache made before a global setter (``set_default_dtype``) and
    used after it: the setter is a Python call in the graph, no grad or autocast switch, yet
    ``arange(n) * 0.1`` gives another dtype past it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        positions = torch.arange(cache.keys.shape[1]) * 0.1
        torch.set_default_dtype(torch.float64)
        wide = torch.arange(cache.keys.shape[1]) * 0.1
        torch.set_default_dtype(torch.float32)
        mixed = (cache.keys * positions[None, :, None]).sum(1) + wide.sum().float()
        return self.lin(mixed)


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_work_feeding_step_size_nodes_never_moves_past_a_global_setter(capture):
    _equals_eager_step_by_step(DefaultDtype().eval(), capture)
    assert torch.get_default_dtype() == torch.float32


class AutocastBlock(nn.Module):
    """Weights over the grown cache computed before an autocast block and used inside it:
    ``mm`` autocasts, so the same work inside the block gives bfloat16's rounding, not the full
    precision eager computed it in."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        a = torch.arange(cache.keys.shape[1], dtype=torch.float32)[:, None] * 0.37 + 0.11
        weights = torch.mm(a, a.t()).sum(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = (cache.keys * weights[None, :, None]).sum(1)
        return self.lin(mixed)


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_work_feeding_step_size_nodes_never_moves_into_an_autocast_block(capture):
    _equals_eager_step_by_step(AutocastBlock().eval(), capture)


# User ops whose Python bodies have effects no schema declares: one draws from the default
# generator, one bumps a host counter that the other reads.
_COUNTER = [0]


@torch.library.custom_op("fxsplit_test_moves::noisy_positions", mutates_args=())
def noisy_positions(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + torch.rand(n)


@noisy_positions.register_fake
def _(n):
    return torch.empty(n)


@torch.library.custom_op("fxsplit_test_moves::counted_positions", mutates_args=())
def counted_positions(n: int) -> torch.Tensor:
    _COUNTER[0] += 1
    return torch.arange(n, dtype=torch.float32) * _COUNTER[0]


@counted_positions.register_fake
def _(n):
    return torch.empty(n)


@torch.library.custom_op("fxsplit_test_moves::scaled_by_count", mutates_args=())
def scaled_by_count(x: torch.Tensor) -> torch.Tensor:
    _COUNTER[0] += 1
    return x * _COUNTER[0]


@scaled_by_count.register_fake
def _(x):
    return torch.empty_like(x)


class UserOpBeforeAnEffect(nn.Module):
    """Positions over the grown cache made by a user's op, then an effect (a random draw, a
    counter bump), then work using the positions: the user's op must keep its place before
    the effect (moved next to its user, it draws the other's numbers or reads another count)."""

    def __init__(self, make, effect):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.make, self.effect = make, effect

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        positions = self.make(cache.keys.shape[1])
        h = self.lin(self.effect(x))
        return h + (cache.keys * positions[None, :, None]).sum(1)


@pytest.mark.parametrize(
    ("make", "effect"),
    [
        (noisy_positions, torch.rand_like),
        (noisy_positions, lambda x: nn.functional.dropout(x, 0.5, training=True)),
        (counted_positions, scaled_by_count),
    ],
    ids=["draws_before_rand_like", "draws_before_dropout", "counts_before_another_op"],
)
@pytest.mark.parametrize("capture", ["off", "emulate"])
def test_a_users_op_never_moves_past_an_effect(make, effect, capture):
    _COUNTER[0] = 0
    model = UserOpBeforeAnEffect(make, effect).eval()

    def run(fn):
        torch.manual_seed(0)
        _COUNTER[0] = 0
        cache = GrowingCache()
        with torch.no_grad():
            return [fn(torch.randn(1, 1, 8), cache).clone() for _ in range(6)]

    want = run(model)
    # the counting op reads a Python counter: captured, a replay would multiply by the
    # capture's count (the emulator raises HostValueChangedError): it runs eagerly
    eager = ["fxsplit_test_moves::scaled_by_count"] if effect is scaled_by_count else []
    backend = fxsplit.Backend(capture=capture, splitting_ops=eager)
    got = run(torch.compile(model, backend=backend))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if capture == "emulate":
        assert counters.snapshot()["replays"] > 0


class WritesThroughOut(nn.Module):
    """Pure-looking work over the cache's length that writes a buffer built from host values,
    which another op reads before the work's own user: ``torch.add(..., out=buf)`` (a torch
    function names no overload; its functional ones write nothing) and ``batch_norm`` in
    training mode (its schema declares no write of its running statistics)."""

    def __init__(self, write):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.write = write

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        n = cache.keys.shape[1]
        buf = torch.zeros(n)
        r = self.write(torch.arange(2 * n, dtype=torch.float32).reshape(2, n), buf)
        seen = self.lin(x).sum() + buf.sum()  # reads buf after the write
        return (cache.keys * r[0][None, :, None]).sum(1) + seen


def _add_out(z, buf):
    return torch.add(z[0], 1.0, out=buf)[None]


def _batch_norm(z, buf):
    return torch.batch_norm(z, None, None, buf, torch.ones_like(buf), True, 0.5, 1e-5, False)


@pytest.mark.parametrize("write", [_add_out, _batch_norm], ids=["out", "batch_norm"])
@pytest.mark.parametrize("capture", ["off", "emulate"])
def test_work_writing_a_buffer_never_moves_past_a_reader_of_it(write, capture):
    _equals_eager_step_by_step(WritesThroughOut(write).eval(), capture)


class TwoTokenInputs(nn.Module):
    """An engine's step: token ids and their positions, each marked dynamic on its own (as vLLM
    marks them), so Dynamo gives the two leading dims a symbol each."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.inv_freq = nn.Buffer(torch.rand(width))

    def forward(self, input_ids, positions):
        # the rotary's tables over the positions, applied where no shape ties the two counts
        # (vLLM applies them in a custom op)
        angles = positions[:, None].float() * self.inv_freq
        return self.embed(input_ids), angles.cos()


def _two_inputs(size_input):
    model = TwoTokenInputs().eval()
    backend = fxsplit.Backend(capture="emulate", size_input=size_input)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for tokens in (3, 4, 3, 4, 3, 4, 3):
            ids, positions = torch.arange(tokens) % 16, torch.arange(tokens) + 5
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
            for got, want in zip(compiled(ids, positions), model(ids, positions), strict=True):
                assert torch.equal(got, want)
    return backend


def test_every_named_size_input_is_the_token_count():
    assert "dynamic:positions.size(0)" in _reasons(_two_inputs(None).plans[0])
    counters.reset()
    backend = _two_inputs(["input_ids", "positions"])
    assert [p.kind for p in backend.plans[0].pieces] == ["captured"]
    assert counters.snapshot()["replays"] == 3  # 3 and 4 warm up, are captured, then replay
