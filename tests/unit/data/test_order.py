"""fp8rl.data.order: a job visits its problems epoch by epoch, each epoch a permutation that is a pure function of
(seed, epoch) — the same after a controller restart — or in file order."""

from __future__ import annotations

import pytest

from fp8rl.data import EpochBatches, Problem, epoch_permutation

PROBLEMS = [Problem(f"{i} + 1 =", str(i + 1)) for i in range(10)]


def answers(batch: list[Problem]) -> list[int]:
    return [int(p.answer) - 1 for p in batch]


def test_an_epochs_order_is_a_seeded_permutation_fixed_across_runs():
    first = list(epoch_permutation(10, 3, 0))
    assert sorted(first) == list(range(10)) and first != list(range(10))
    epoch_permutation.cache_clear()  # a restarted controller computes it afresh
    assert list(epoch_permutation(10, 3, 0)) == first
    # pinned: the order is Random(str).random() driven, which Python keeps the same across versions
    assert first == [9, 5, 7, 3, 8, 0, 6, 1, 4, 2]
    assert list(epoch_permutation(10, 3, 1)) != first and list(epoch_permutation(10, 4, 0)) != first
    with pytest.raises(ValueError):
        epoch_permutation(0, 0, 0)


def test_batches_cover_each_epoch_once_and_change_order_each_epoch():
    b = EpochBatches(PROBLEMS, per_batch=4, seed=3, shuffle=True)
    again = EpochBatches(list(PROBLEMS), per_batch=4, seed=3, shuffle=True)
    seen = [i for step in range(5) for i in answers(b(step))]  # 20 positions: epochs 0 and 1
    assert [answers(b(s)) for s in range(5)] == [answers(again(s)) for s in range(5)]  # pure in (problems, seed, b)
    assert seen[:10] == list(epoch_permutation(10, 3, 0)) and seen[10:] == list(epoch_permutation(10, 3, 1))
    assert sorted(seen[:10]) == sorted(seen[10:]) == list(range(10)) and seen[:10] != seen[10:]
    assert b.epoch(2) == 0 and b.epoch(3) == 1  # batch 2 straddles epochs 0 and 1
    assert answers(EpochBatches(PROBLEMS, 4, seed=4)(0)) != answers(b(0))


def test_without_shuffle_batches_cycle_in_file_order():
    b = EpochBatches(PROBLEMS, per_batch=4, seed=3, shuffle=False)
    assert [answers(b(s)) for s in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    with pytest.raises(ValueError, match="no problems"):
        EpochBatches([], 4)


def test_refills_are_seeded_draws_outside_the_steps_own_batch():
    """Dynamic sampling's refills (EpochBatches.refill): never the step's own problems (file order would otherwise
    bring them back every len/n batches), distinct within a draw, and a pure function of (seed, step, round)."""
    problems = [Problem(f"q{i}", str(i)) for i in range(64)]
    ordered = EpochBatches(problems, 8, seed=3, shuffle=False)
    for step in range(30):
        own = {p.prompt for p in ordered(step)}
        for round_ in range(1, 4):
            got = ordered.refill(step, round_)
            assert len(got) == 8 and len({p.prompt for p in got}) == 8 and not own & {p.prompt for p in got}
            assert got == EpochBatches(problems, 8, seed=3, shuffle=False).refill(step, round_)
    assert ordered.refill(0, 1) != ordered.refill(0, 2) and ordered.refill(0, 1) != ordered.refill(1, 1)
    assert EpochBatches(problems, 8, seed=4, shuffle=False).refill(0, 1) != ordered.refill(0, 1)
    tiny = EpochBatches(problems[:5], 8, seed=0)  # smaller than a batch: every problem, once
    assert sorted(p.prompt for p in tiny.refill(0, 1)) == [f"q{i}" for i in range(5)]
