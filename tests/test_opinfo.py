"""PyTorch's OpInfo database through emulated capture: every op with float32 CPU samples (its
first sample), out of place and, where it has one, in place on an input, compiled with fxsplit
(``fullgraph=True``, ``capture="emulate"``, ``on_capture_error="raise"``) and called on fresh
input values each time (warm-up, capture, two replays).

Each case ends in one of these outcomes, recorded per case and printed at the end of the module
(``-s`` shows it):

- ``replayed``: every call gave eager's numbers, left the inputs as eager leaves them, and every
  captured piece of the plan replayed on both replay calls (``Backend.stats``);
- ``eager: <reasons>``: the same, with the op itself in an eager piece, for the reasons the plan
  gives (``unsafe:aten::nonzero``: a counted, reasoned refusal); the pieces around it that the
  plan captures must replay as above. A plan that captures a piece which never replays fails
  the test: a build that never captures (``capture="off"``, a capture that silently runs
  uncaptured) cannot pass;
- ``refused``: ``CaptureRefusedError`` (``on_capture_error="raise"``), only where PyTorch's
  functionalization cannot run the aliasing analysis on the op (``polygamma_``, whose functional
  form takes its arguments in another order);
- ``CaptureError``: the emulator refused to capture the op (what CUDA capture rejects);
- ``Dynamo-refused`` (skipped): Dynamo itself refuses the program, by its own exception types
  (a graph break under ``fullgraph``, an unsupported op, fake-tensor propagation failing);
- ``Dynamo-wrong`` (skipped): Dynamo with its own ``"eager"`` backend already differs from eager,
  so fxsplit is not what changed the numbers;
- ``wrong``, ``crash`` and ``never replayed`` fail the test: a number differs from eager (and
  from Dynamo's own backend), fxsplit raised (``BackendCompilerFailed``, ``BindingError``, an
  error inside a piece, ...), or a captured piece did not replay.

"Eager's numbers" is bit for bit (NaN equal to NaN), as docs/reliability.md says, except
for the ops in :data:`OTHER_PATH_UNDER_A_DISPATCH_MODE`, where the emulator itself changes the
computation: it records through a TorchDispatchMode, under which composite ops that branch on
``isTensorSubclassLike`` take another path (``linalg.svdvals`` and ``linalg.eigvalsh`` then
compute the vectors too, and round differently in the last bit; ``linalg.cond`` and the nuclear
norm go through ``svdvals``). Those outputs must still agree to 1e-4 relative; a stale or
misbound input differs by far more. The full sweep (torch 2.13) finds no other op off in a bit.

CI runs every ``OPINFO_STRIDE``-th op (``FXSPLIT_OPINFO_STRIDE``, default 8); ``1`` runs all:
``FXSPLIT_OPINFO_STRIDE=1 python3 -m pytest tests/test_opinfo.py -q -s``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import fxsplit
from fxsplit.facts import op_facts
from tests.replays import replays

common = pytest.importorskip("torch.testing._internal.common_methods_invocations")

STRIDE = int(os.environ.get("FXSPLIT_OPINFO_STRIDE", "8"))
OPS = [op for op in common.op_db if torch.float32 in op.supported_dtypes("cpu")]
CASES = [
    (op, variant)
    for op in OPS[::STRIDE]
    for variant in ("op", "inplace")
    if variant == "op" or op.inplace_variant is not None
]


def _allocates(op) -> bool:
    """Whether the OpInfo entry is an aten op that only allocates (``empty``, ``new_empty``,
    ...): its values are whatever the memory held."""
    packet = getattr(torch.ops.aten, op.name, None)
    return isinstance(packet, torch._ops.OpOverloadPacket) and any(
        getattr(packet, overload) in op_facts.ALLOCATIONS for overload in packet.overloads()
    )


def _first_sample(op):
    samples = op.sample_inputs("cpu", torch.float32, requires_grad=False)
    return next(iter(samples), None)


def _fresh_like(value, seed):
    """Same shape, dtype and layout; new values for floating tensors (indices stay valid)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        noise = torch.randn(value.shape, generator=torch.Generator().manual_seed(seed))
        return (value + noise.to(value.dtype) * 0.25).clone()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh_like(v, seed + i) for i, v in enumerate(value))
    return value


class _Meta(tuple):
    """Shapes and dtypes only, for outputs whose values eager itself does not fix."""


def _metadata(value) -> _Meta:
    leaves = value if isinstance(value, (list, tuple)) else (value,)
    return _Meta(
        (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in leaves
    )


def _comparable(t: torch.Tensor) -> torch.Tensor:
    """A tensor torch.equal takes: dense, and complex32 widened."""
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.to(torch.complex64) if t.dtype == torch.complex32 else t


def _same(a, b, exact: bool = True) -> bool:
    """Equal values (NaN equal to NaN): bit for bit, or within 1e-4 relative when not exact."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
            return False
        a, b = _comparable(a), _comparable(b)
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not exact and (a.is_floating_point() or a.is_complex()):
            return torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
        if a.is_floating_point() or a.is_complex():
            return torch.equal(a.isnan(), b.isnan()) and torch.equal(
                a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)
            )
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y, exact) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_same(a[k], b[k], exact) for k in a)
        )
    return type(a) is type(b) and (a == b or a != a)


# Composite ops that take another path under a TorchDispatchMode (the emulator's recorder), by
# OpInfo name and variant: ``linalg_svdvals`` and ``linalg_eigvalsh`` compute the vectors too when
# their input is subclass-like (``_may_require_fw_or_bw_grad``), and ``linalg.cond`` and the
# nuclear norm go through ``svdvals``. Only these are compared within 1e-4 relative (the full
# sweep finds them, and nothing else, off in the last bits); every other op bit for bit.
OTHER_PATH_UNDER_A_DISPATCH_MODE = frozenset(
    {"linalg.svdvals.", "linalg.eigvalsh.", "linalg.cond.", "norm.nuc"}
)

NOT_BIT_EQUAL: list[str] = []
OUTCOMES: dict[str, str] = {}

# Dynamo's own refusals: a graph break under fullgraph, an op or construct it does not support,
# fake-tensor propagation failing on the sample.
DYNAMO_REFUSES = (
    torch._dynamo.exc.Unsupported,
    torch._dynamo.exc.UserError,
    torch._dynamo.exc.TorchRuntimeError,
    torch._dynamo.exc.UncapturedHigherOrderOpError,
    torch._dynamo.exc.InternalTorchDynamoError,
)


def _case_id(op, variant: str) -> str:
    return f"{op.name}.{op.variant_test_name}-{variant}"


def _params():
    for op, variant in CASES:
        yield pytest.param(op, variant, id=_case_id(op, variant))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    by_outcome: dict[str, list[str]] = {}
    for case, outcome in sorted(OUTCOMES.items()):
        by_outcome.setdefault(outcome, []).append(case)
    print(f"\nOpInfo sweep: {len(CASES)} cases")
    for outcome, cases in sorted(by_outcome.items()):
        shown = "" if outcome == "replayed" else f": {cases}"
        print(f"  {outcome}: {len(cases)}{shown}")
    print(f"  not bit-equal (within 1e-4, allowed only for these ops): {NOT_BIT_EQUAL}")


pytestmark = pytest.mark.usefixtures("fresh_capture_state")


@pytest.mark.parametrize(("op", "variant"), list(_params()))
def test_op_through_emulated_capture_gives_eager_numbers_or_capture_error(op, variant):
    case = _case_id(op, variant)
    sample = _first_sample(op)
    if sample is None:
        OUTCOMES[case] = "no sample"
        pytest.skip("no float32 CPU sample")
    fn = op.op if variant == "op" else op.inplace_variant

    def model(x, args, kwargs):
        return fn(x, *args, **kwargs)

    backend = fxsplit.Backend(capture="emulate", on_capture_error="raise")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            inputs = _fresh_like((sample.input, sample.args, sample.kwargs), 100 * step)
            mine = _clone_tree(inputs)
            try:
                torch.manual_seed(step)  # random ops draw the same numbers on both sides
                expected = model(*inputs)
                torch.manual_seed(step)
                again = model(*_clone_tree(mine))
            except Exception:
                OUTCOMES[case] = "eager raises"
                pytest.skip("eager raises on this sample")
            if _allocates(op) or not _same(expected, again):  # values unspecified
                expected = _metadata(expected)
            try:
                torch.manual_seed(step)
                got = compiled(*mine)
            except fxsplit.CaptureError as error:
                OUTCOMES[case] = "CaptureError"
                assert step == 1, f"CaptureError on call {step}, not the capture step: {error}"
                return
            except fxsplit.CaptureRefusedError as error:
                # A one-op program is refused only where PyTorch's functionalization cannot
                # run the aliasing analysis on the op (polygamma_'s argument order): loud.
                OUTCOMES[case] = "refused"
                assert "aliasing analysis failed" in str(error), error
                return
            except DYNAMO_REFUSES as error:
                OUTCOMES[case] = "Dynamo-refused"
                pytest.skip(f"Dynamo refuses: {type(error).__name__}: {str(error)[:300]}")
            except Exception as error:
                OUTCOMES[case] = "crash"
                raise AssertionError(f"{case} step {step}: fxsplit raised {error!r}") from error
            if isinstance(expected, _Meta):
                got = _metadata(got)
            exact = f"{op.name}.{op.variant_test_name}" not in OTHER_PATH_UNDER_A_DISPATCH_MODE
            if not (_same(expected, got) and _same(inputs, mine)):
                NOT_BIT_EQUAL.append(case)
            if not (_same(expected, got, exact) and _same(inputs, mine, exact)):
                if _dynamo_differs(model, sample, step, isinstance(expected, _Meta)):
                    OUTCOMES[case] = "Dynamo-wrong"
                    pytest.skip("Dynamo's own eager backend differs from eager too")
                OUTCOMES[case] = "wrong"
            assert _same(expected, got, exact), f"{op.name} step {step}: output differs"
            assert _same(inputs, mine, exact), f"{op.name} step {step}: inputs differ"
    OUTCOMES[case] = _capture_outcome(backend, case)


def _capture_outcome(backend, case: str) -> str:
    """``replayed``, or ``eager: <reasons>`` where the plan keeps the op eager; asserts that every
    piece the plan captures replayed on both replay calls (calls 2 and 3)."""
    pieces = [(plan.graph_id, p) for plan in backend.plans for p in plan.pieces]
    counts = replays(backend)  # a piece whose capture holds no kernel runs as its Python
    short = {piece: n for piece, n in counts.items() if n < 2}
    if not counts and any(p.kind == "captured" for _, p in pieces):
        return "no kernel: runs as its Python"
    if short or not pieces:
        OUTCOMES[case] = "never replayed"
    assert pieces, f"{case}: the backend made no piece"
    assert not short, (
        f"{case}: captured pieces replayed fewer than twice in 2 replay calls: {short}"
    )
    reasons = sorted({r for _, p in pieces if p.kind == "eager" for r in p.reasons})
    assert all(p.reasons for _, p in pieces if p.kind == "eager"), (
        f"{case}: an eager piece says no why"
    )
    return f"eager: {', '.join(reasons)}" if reasons else "replayed"


def _dynamo_differs(model, sample, step: int, metadata_only: bool) -> bool:
    """Whether ``torch.compile(model, backend="eager")`` also differs from eager on call
    ``step``'s inputs (the same fresh values the fxsplit call got)."""
    torch._dynamo.reset()
    reference = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        for i in range(step + 1):
            inputs = _fresh_like((sample.input, sample.args, sample.kwargs), 100 * i)
            mine = _clone_tree(inputs)
            torch.manual_seed(i)
            expected = model(*inputs)
            torch.manual_seed(i)
            got = reference(*mine)
    if metadata_only:
        expected, got = _metadata(expected), _metadata(got)
    return not (_same(expected, got, exact=False) and _same(inputs, mine, exact=False))


def _clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tree(v) for v in value)
    return value
