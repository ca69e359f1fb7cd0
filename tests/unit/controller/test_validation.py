"""pass@k's unbiased estimator against hand-computed cases, and one validation's bookkeeping over a scripted
backend (a unit double: which samples are right is fixed, so every number can be worked out by hand; the real
rollout engine validates in tests/e2e/test_loop.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from fp8rl.controller.validation import EVAL_STEP_BASE, pass_at_k, pass_ks, validate
from fp8rl.data import Problem


def test_pass_at_k_hand_computed() -> None:
    # n=4 samples, c=1 right: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 1, 4) == 1.0
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert math.isclose(pass_at_k(5, 2, 2), 0.7)
    assert pass_at_k(8, 0, 3) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    assert pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1] and pass_ks(0) == []


@dataclass(frozen=True)
class _S:
    right: bool


class _Scripted:
    """Problem i's samples: greedy right iff i is even; of k sampled ones, the first i are right."""

    def __init__(self) -> None:
        self.calls = []

    def generate(self, prompts, version, *, step, n, temperature):
        self.calls.append((version, step, n, temperature))
        if temperature == 0.0:
            return [(i, _S(i % 2 == 0)) for i in range(len(prompts))]
        return [(i, _S(j < i)) for i in range(len(prompts)) for j in range(n)]

    def score(self, pairs):
        return [1.0 if s.right else 0.0 for _, s in pairs]


def test_validate_counts_greedy_pass_at_j_and_mean_at_k() -> None:
    problems = [Problem(f"q{i}", "1") for i in range(3)]
    b = _Scripted()
    r = validate(b, problems, [[1]] * 3, 7, k=4, temperature=0.7)
    assert b.calls == [(7, EVAL_STEP_BASE + 7, 1, 0.0), (7, EVAL_STEP_BASE + 7, 4, 0.7)]
    assert r.greedy_accuracy == 2 / 3  # problems 0 and 2
    assert r.correct == (0, 1, 2)
    assert r.mean_at_k == 3 / 12
    # pass@2 per problem: c=0 → 0; c=1 → 1/2; c=2 → 1 - C(2,2)/C(4,2) = 5/6
    assert math.isclose(r.pass_at[2], (0 + 0.5 + 5 / 6) / 3)
    assert math.isclose(r.pass_at[1], r.mean_at_k) and math.isclose(r.pass_at[4], 2 / 3)
    assert set(r.metrics()) == {"val_accuracy", "val/pass@1", "val/pass@2", "val/pass@4", "val/mean@4",
                                "val_weight_version"}
    greedy_only = validate(_Scripted(), problems, [[1]] * 3, 7, k=0, temperature=0.7)
    assert greedy_only.metrics() == {"val_accuracy": 2 / 3, "val_weight_version": 7.0}
    with pytest.raises(ValueError):
        validate(_Scripted(), problems, [[1]] * 2, 7, k=1, temperature=1.0)


def test_combined_parts_equal_one_validation_of_all_problems() -> None:
    problems = [Problem(f"q{i}", "1") for i in range(5)]
    whole = validate(_Scripted(), problems, [[1]] * 5, 3, k=4, temperature=1.0)
    # the scripted backend's answers depend on the problem's index in its call: split so each part sees 0..n-1
    a = validate(_Scripted(), problems[:3], [[1]] * 3, 3, k=4, temperature=1.0)
    b = validate(_Scripted(), problems[:2], [[1]] * 2, 3, k=4, temperature=1.0)
    both = type(a).combine([a, b])
    assert both.correct == a.correct + b.correct and both.problems == 5
    assert both.greedy_right == a.greedy_right + b.greedy_right and both.greedy_accuracy == both.greedy_right / 5
    assert math.isclose(both.pass_at[2], sum(pass_at_k(4, c, 2) for c in both.correct) / 5)
    assert whole.problems == 5
    with pytest.raises(ValueError):
        type(a).combine([a, validate(_Scripted(), problems[:2], [[1]] * 2, 4, k=4, temperature=1.0)])


def test_a_validation_served_by_a_newer_version_reports_that_version() -> None:
    """Asynchronous GRPO lets a replica serve a newer version than asked: the result names the one measured."""

    @dataclass(frozen=True)
    class _V:
        right: bool
        weight_version: int

    class _Newer(_Scripted):
        def generate(self, prompts, version, *, step, n, temperature):
            return [(i, _V(s.right, version + 1)) for i, s in super().generate(prompts, version, step=step, n=n,
                                                                              temperature=temperature)]

    r = validate(_Newer(), [Problem("q", "1")], [[1]], 3, k=2, temperature=1.0)
    assert r.version == 4 and r.metrics()["val_weight_version"] == 4.0
