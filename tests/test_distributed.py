"""Tensor parallel on torch.distributed (gloo, CPU): spawned ranks, emulated capture.

The checks run once, in two ranks spawned by :func:`fxsplit.tools.tp_demo.spawn` (see
``tests/distributed_workers.py``), which kills them and fails after a hard timeout, so a hang
(ranks whose collectives do not match) fails instead of blocking CI; each test reads its
check's result on both ranks. The timeout is :data:`TIMEOUT_S` on an idle machine, scaled by
``FXSPLIT_TEST_TIMEOUT_SCALE`` and the load (``tests/timeouts.py``): a busy machine is slow,
not hung.
"""

from __future__ import annotations

import pytest
import torch

from tests.timeouts import scaled

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch is built without torch.distributed"
)

# The spawn and every check take about 45-65 s on 2 idle cores.
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def ranks():
    from fxsplit.tools.tp_demo import spawn
    from tests import distributed_workers

    return spawn(distributed_workers.every_check, 2, timeout_s=scaled(TIMEOUT_S))


def _results(ranks, check: str) -> list:
    assert all(isinstance(r, dict) for r in ranks), ranks
    results = [r[check] for r in ranks]
    errors = [r for r in results if isinstance(r, str)]
    assert not errors, errors
    return results


def test_tp2_decode_under_v1_and_v2_equals_the_single_process_model_with_replays_on_both_ranks(
    ranks,
):
    from fxsplit.tools import tp_demo

    results = _results(ranks, "decode")
    for rank, result in enumerate(results):
        for row in result["rows"]:
            assert row["exact"], (rank, row)  # bit for bit the eager tensor-parallel model
            assert row["diff"] <= tp_demo.ATOL, (rank, row)
        for runner in tp_demo.RUNNERS:
            replays = sum(r["replays"] for r in result["rows"] if r["runner"] == runner)
            assert replays > 0, (rank, runner)
    per_step = [[(r["captures"], r["replays"]) for r in result["rows"]] for result in results]
    assert per_step[0] == per_step[1]
    assert results[0]["plans"] == results[1]["plans"]


def test_collective_in_a_captured_piece_replays_eagers_numbers_with_and_without_verify(ranks):
    results = _results(ranks, "replay_collective")
    for result in results:
        for verify in (False, True):
            run = result[f"verify={verify}"]
            # Sums across ranks run in another order than in one process.
            assert max(run["diffs"]) < 1e-4, run
            assert run["replays"] > 0, run
    # Same keys in the same order on every rank; each piece's sizes largest first.
    order = results[0]["capture_order"]
    assert order == results[1]["capture_order"]
    for piece in {piece for _, piece, _ in order}:
        sizes = [int(key.strip("(,)")) for _, p, key in order if p == piece]
        assert sizes == [6, 4, 2], (piece, order)


def test_divergent_split_on_one_rank_raises_the_agreement_error_on_both_ranks(ranks):
    results = _results(ranks, "diverge")
    for kind, message, groups, piece in results:
        assert kind == "RankMismatchError", message
        assert groups == [[0], [1]], message
        assert piece.startswith("piece_"), message
        assert "ranks 0: " in message and "ranks 1: " in message, message
        assert f"First piece that differs: {piece}" in message, message
        assert "check_ranks=False" in message, message


@pytest.mark.parametrize("way", ["option", "inductor_failed"])
def test_ranks_running_a_piece_differently_raise_the_agreement_error_on_both_ranks(ranks, way):
    """compile_pieces differing per rank, or Inductor failing on one rank only: the piece runs
    as an Inductor artifact on one rank and as generated Python on the other."""
    for result in _results(ranks, "diverge_compiled"):
        kind, message, groups, _ = result[way]
        assert kind == "RankMismatchError", message
        assert groups == [[0], [1]], message
        assert "runs as inductor" in message and "runs as python" in message, message


def test_tp2_llama_prefill_with_its_attention_op_split_equals_the_single_process_model(ranks):
    for result in _results(ranks, "llama_prefill"):
        assert all(result["exact"]), result
        assert max(result["diffs"]) < 1e-4, result
        assert result["replays"] > 0, result


def test_a_size_the_group_does_not_divide_is_named(ranks):
    for errors in _results(ranks, "indivisible"):
        assert len(errors) == 2, errors
        assert all("tensor-parallel size 2 does not divide" in e for e in errors), errors
        assert "num_heads (attention heads) (3)" in errors[0], errors
        assert "num_heads (query heads) (3)" in errors[1], errors


def test_a_hang_fails_at_the_timeout_and_leaves_no_process():
    """A deliberate hang, stopped at a short fixed timeout whatever the load (the ranks never
    finish, so a busy machine cannot make this pass or fail). How long it takes:
    ``bench/tooling_time.py``."""
    import multiprocessing

    from fxsplit.tools.tp_demo import spawn
    from tests import distributed_workers

    with pytest.raises(TimeoutError, match="did not finish within 5 s"):
        spawn(distributed_workers.hang, 2, timeout_s=5.0)
    assert not multiprocessing.active_children()  # both ranks killed and reaped
