"""Property: moving the work that feeds step-size nodes (:func:`fxsplit.passes.step_sizes.find`)
never changes a number.

Every example is a small program over tensors of the grown cache's length ``n``: values made
from ``n`` alone (what moves), aliases of them (views, and aliases made by ops that read another
tensor too: ``view_as``, ``to``, ``type_as``), pure work, writes to any of them (in-place methods,
``out=``, item assignment, through a slice, ``batch_norm``'s running statistics that its schema
does not declare), a global setter (``set_default_dtype``) and effects (random ops, a user's op
that draws from the generator or bumps a host counter) between work and its use; values may be
made by a user's op with such an effect. Every value feeds the output, so all of it depends on
the cache's length and may move next to its first user. Under both ``"off"`` and ``"emulate"``
the compiled model returns exactly what eager returns on every step.

A second property opens a grad-mode or autocast block (``no_grad``, ``enable_grad``,
``autocast`` to bfloat16) between work and its first user, the block running to the program's
end: work made before the block computes as it did before it (``mm``, which autocast runs in
bfloat16, among it), and what the model returns has eager's values, dtype and ``requires_grad``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit import counters

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("fresh_capture_state"),
    pytest.mark.filterwarnings("ignore:.*is in any region:fxsplit.FxsplitWarning"),
]

MAKE = ("arange", "promoted", "ones", "set_default_dtype", "noisy", "counted")
ALIAS = ("view_as", "to", "type_as", "reshape", "slice_all", "unsqueeze")
PURE = ("double", "plus_one", "cumsum", "tanh", "sum_of_two", "promoted", "batch_norm")
WRITE = ("add_", "mul_", "setitem", "copy_", "clamp_", "relu_", "out", "tail_add_", "index_fill_")
EFFECT = ("rand_like", "dropout", "bernoulli", "noisy_like", "count")
# the pure work of the switch property: autocast runs mm in bfloat16
SWITCHED_PURE = (*PURE, "mm")
# a block opened between work and its first user, running to the program's end
SWITCHES = {
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}

# A user's ops whose Python bodies have effects no schema declares.
_COUNTER = [0]


@torch.library.custom_op("fxsplit_test_move_property::noisy", mutates_args=())
def _noisy(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + torch.rand(n)


@_noisy.register_fake
def _(n):
    return torch.empty(n)


@torch.library.custom_op("fxsplit_test_move_property::counted", mutates_args=())
def _counted(n: int) -> torch.Tensor:
    _COUNTER[0] += 1
    return torch.arange(n, dtype=torch.float32) * _COUNTER[0]


@_counted.register_fake
def _(n):
    return torch.empty(n)


@torch.library.custom_op("fxsplit_test_move_property::noisy_like", mutates_args=())
def _noisy_like(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand_like(x)


@_noisy_like.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("fxsplit_test_move_property::count", mutates_args=())
def _count(x: torch.Tensor) -> torch.Tensor:
    _COUNTER[0] += 1
    return x * _COUNTER[0]


@_count.register_fake
def _(x):
    return torch.empty_like(x)


def _make(kind, n):
    if kind == "arange":
        return torch.arange(n, dtype=torch.float32)
    if kind == "promoted":  # the default dtype decides the product's
        return torch.arange(n) * 0.1
    if kind == "ones":
        return torch.ones(n) * 2
    if kind == "noisy":
        return _noisy(n)
    if kind == "counted":
        return _counted(n)
    torch.set_default_dtype(torch.float64)
    wide = torch.arange(n) * 0.1
    torch.set_default_dtype(torch.float32)
    return wide.float()


def _alias(kind, a, like):
    return {
        "view_as": lambda: a.view_as(like),
        "to": lambda: a.to(like),
        "type_as": lambda: a.type_as(like),
        "reshape": lambda: a.reshape(-1),
        "slice_all": lambda: a[:],
        "unsqueeze": lambda: a.unsqueeze(0)[0],
    }[kind]()


def _pure(kind, a, b, keys):
    if kind == "batch_norm":  # writes ``a``, its running mean
        normed = nn.functional.batch_norm(keys, a, torch.ones_like(a), training=True, momentum=0.5)
        return normed.sum((0, 2))
    return {
        "double": lambda: a * 2,
        "plus_one": lambda: a + 1,
        "cumsum": lambda: a.cumsum(0),
        "tanh": lambda: a.tanh(),
        "sum_of_two": lambda: a + b,
        "promoted": lambda: a.to(torch.int64) * 0.1,  # in the default dtype
        # scaled off integers, which bfloat16 holds exactly
        "mm": lambda: torch.mm(a.float()[:, None] * 0.37, b.float()[None, :] + 0.11).sum(1),
    }[kind]()


def _write(kind, a, b, x):
    if kind == "add_":
        a.add_(1)
    elif kind == "mul_":
        a.mul_(3)
    elif kind == "setitem":
        a[0] = 5.0
    elif kind == "copy_":
        a.copy_(b)
    elif kind == "clamp_":
        a.clamp_(max=2.0)
    elif kind == "relu_":
        nn.functional.relu(a, inplace=True)
    elif kind == "out":
        torch.add(b, 1, out=a)
    elif kind == "tail_add_":
        a[1:].add_(x.sum())
    else:
        a.index_fill_(0, (x[0, 0, :1] * 0).long(), -1.0)


def _effect(kind, like):
    return {
        "rand_like": lambda: torch.rand_like(like),
        "dropout": lambda: nn.functional.dropout(like + 1, 0.5, training=True),
        "bernoulli": lambda: torch.full_like(like, 0.5).bernoulli(),
        "noisy_like": lambda: _noisy_like(like),
        "count": lambda: _count(like + 1),
    }[kind]()


class Program(nn.Module):
    """Runs ``program`` (a list of instructions) over the cache's length after growing it; with
    ``switch`` (one of ``SWITCHES``), the instructions from index ``at`` on inside that block."""

    def __init__(self, program, switch: str | None = None, at: int = 0):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.program = program
        self.switch, self.at = switch, at

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.lin(x)], dim=1)
        n = cache.keys.shape[1]
        like = cache.keys[0, :, 0]
        values = []
        if self.switch is None:
            self._run(self.program, values, n, like, x, cache)
        else:
            self._run(self.program[: self.at], values, n, like, x, cache)
            with SWITCHES[self.switch]():
                self._run(self.program[self.at :], values, n, like, x, cache)
        total = sum(values)
        return self.lin((cache.keys * total[None, :, None]).sum(1))

    @staticmethod
    def _run(program, values, n, like, x, cache):
        for group, kind, i, j in program:
            a, b = (values[i % len(values)], values[j % len(values)]) if values else (None, None)
            if group == "make" or not values:
                values.append(_make(kind if group == "make" else "arange", n))
            elif group == "alias":
                values.append(_alias(kind, a, like))
            elif group == "pure":
                values.append(_pure(kind, a, b, cache.keys))
            elif group == "effect":
                values.append(_effect(kind, like))
            elif a is not b or kind not in ("copy_", "out"):  # never a copy into itself
                _write(kind, a, b, x)


class Cache:
    def __init__(self):
        self.keys = torch.zeros(1, 2, 8)


def _instruction(group, kinds):
    return st.tuples(st.just(group), st.sampled_from(kinds), st.integers(0, 7), st.integers(0, 7))


# The hazard first: a value, work reading it, an alias of it, then a write to that alias (or a
# write its schema hides, or a setter); or a value, an effect, then work reading the value;
# more instructions after.
WRITE_HAZARD = st.tuples(
    _instruction("make", MAKE),
    st.tuples(st.just("pure"), st.sampled_from(PURE[:-1]), st.just(0), st.just(0)),
    st.tuples(st.just("alias"), st.sampled_from(ALIAS), st.just(0), st.just(0)),
    st.one_of(
        st.tuples(st.just("write"), st.sampled_from(WRITE), st.just(2), st.integers(0, 2)),
        st.tuples(st.just("pure"), st.just("batch_norm"), st.just(0), st.just(0)),
        st.tuples(st.just("make"), st.just("set_default_dtype"), st.just(0), st.just(0)),
    ),
)
EFFECT_HAZARD = st.tuples(
    _instruction("make", MAKE),
    _instruction("effect", EFFECT),
    st.tuples(st.just("pure"), st.sampled_from(PURE[:-1]), st.just(0), st.just(0)),
)
HAZARD = st.one_of(WRITE_HAZARD, EFFECT_HAZARD)
PROGRAMS = st.builds(
    lambda hazard, more: [*hazard, *more],
    HAZARD,
    st.lists(
        st.one_of(
            _instruction("make", MAKE),
            _instruction("alias", ALIAS),
            _instruction("pure", PURE),
            _instruction("write", WRITE),
            _instruction("effect", EFFECT),
        ),
        max_size=6,
    ),
)


# The hazard of a switch: a value and work reading it (``mm`` among it), then a block opening
# before the work's first user; more instructions inside the block.
SWITCH_HAZARD = st.tuples(
    _instruction("make", MAKE),
    st.tuples(
        st.just("pure"),
        st.one_of(st.just("mm"), st.sampled_from(PURE[:-1])),  # mm as often as the rest
        st.just(0),
        st.just(0),
    ),
    st.tuples(st.just("pure"), st.sampled_from(SWITCHED_PURE[:-2]), st.just(1), st.just(1)),
)
SWITCH_PROGRAMS = st.builds(
    lambda hazard, more: [*hazard, *more],
    SWITCH_HAZARD,
    st.lists(
        st.one_of(
            _instruction("make", MAKE),
            _instruction("alias", ALIAS),
            _instruction("pure", SWITCHED_PURE),
            _instruction("write", WRITE),
            _instruction("effect", EFFECT),
        ),
        max_size=5,
    ),
)


def _same(a, b):
    return a.dtype == b.dtype and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def _equals_eager(model: nn.Module, capture: str) -> None:
    """Six decode steps of ``model`` over a fresh :class:`Cache`, eagerly and compiled, from
    the same seed: every step the same values and dtype; under ``"emulate"`` something
    replayed."""

    def run(fn):
        torch.manual_seed(0)
        _COUNTER[0] = 0
        cache = Cache()
        with torch.no_grad():
            return [fn(torch.randn(1, 1, 8), cache).clone() for _ in range(6)]

    want = run(model)
    torch._dynamo.reset()
    counters.reset()
    got = run(torch.compile(model, backend=fxsplit.Backend(capture=capture)))
    assert all(_same(a, b) for a, b in zip(got, want, strict=True))
    if capture == "emulate":
        assert counters.snapshot()["replays"] > 0


@settings(max_examples=max(settings.default.max_examples // 5, 1))
@given(program=PROGRAMS, capture=st.sampled_from(["off", "emulate"]))
# the kinds found so far: a write through an alias made by an op that reads another tensor
# too, a write the schema hides (a setter between work and its use: tests/test_step_sizes.py)
@example(
    [
        ("make", "arange", 0, 0),
        ("pure", "double", 0, 0),
        ("alias", "view_as", 0, 0),
        ("write", "add_", 2, 0),
    ],
    "off",
)
@example([("make", "arange", 0, 0), ("pure", "double", 0, 0), ("pure", "batch_norm", 0, 0)], "off")
# a user's op that draws, moved past a random op, drew that op's numbers
@example([("make", "noisy", 0, 0), ("effect", "rand_like", 0, 0), ("pure", "double", 0, 0)], "off")
def test_moved_work_never_changes_a_number(program, capture):
    _equals_eager(Program(program).eval(), capture)


@settings(max_examples=max(settings.default.max_examples // 5, 1))
@given(
    program=SWITCH_PROGRAMS,
    switch=st.sampled_from(sorted(SWITCHES)),
    capture=st.sampled_from(["off", "emulate"]),
)
# work moved into the block: mm computed in bfloat16 (tests/test_step_sizes.py, AutocastBlock)
@example(
    [("make", "arange", 0, 0), ("pure", "mm", 0, 0), ("pure", "double", 1, 1)], "autocast", "off"
)
def test_moved_work_never_crosses_a_grad_or_autocast_switch(program, switch, capture):
    """Work made before the block and first used inside it stays before it: inside an autocast
    block ``mm`` rounds to bfloat16. (A grad-mode switch changes no number of the work that
    moves, built from host values and constants alone; its draws hold the pass to the same
    rule.)"""
    _equals_eager(Program(program, switch, at=2).eval(), capture)
