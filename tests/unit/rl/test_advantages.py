"""grpo_advantages against hand-computed group baselines (LOO and plain)."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.rl import grpo_advantages

ATOL_ADV = 1e-6  # float32 output of float64 math: well under one float32 ulp of O(1) values
EPS = 1e-6


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_all_equal_rewards_give_exactly_zero(leave_one_out: bool) -> None:
    # 0.1 and 0.7 are not representable in binary: a naive mean leaves rounding residue.
    rewards = torch.tensor([0.1] * 5 + [0.7] * 5 + [1.0] * 5, dtype=torch.float32)
    adv = grpo_advantages(rewards, 5, leave_one_out=leave_one_out)
    assert torch.equal(adv, torch.zeros(15))


def test_loo_two_groups_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 9.0])
    # Group 0 = [1, 0, 0]:
    #   j=0: others [0, 0]  -> b=0,   std=0       -> A = 1 - 0 (no division)
    #   j=1: others [1, 0]  -> b=0.5, std=sqrt(.5) -> A = -0.5 / (sqrt(.5) + eps)
    #   j=2: same as j=1.
    # Group 1 = [2, 4, 9]:
    #   j=0: others [4, 9] -> b=6.5, std=sqrt(12.5)
    #   j=1: others [2, 9] -> b=5.5, std=sqrt(24.5)
    #   j=2: others [2, 4] -> b=3,   std=sqrt(2)
    expected = torch.tensor(
        [
            1.0,
            -0.5 / (math.sqrt(0.5) + EPS),
            -0.5 / (math.sqrt(0.5) + EPS),
            (2 - 6.5) / (math.sqrt(12.5) + EPS),
            (4 - 5.5) / (math.sqrt(24.5) + EPS),
            (9 - 3.0) / (math.sqrt(2.0) + EPS),
        ]
    )
    adv = grpo_advantages(rewards, 3)
    torch.testing.assert_close(adv, expected, atol=ATOL_ADV, rtol=0)


def test_plain_group_mean_and_bessel_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, Bessel var = 4 * 0.25 / 3 = 1/3.
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    adv = grpo_advantages(rewards, 4, leave_one_out=False)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]), atol=ATOL_ADV, rtol=0)


def test_no_std_normalisation_is_reward_minus_baseline() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0])
    torch.testing.assert_close(
        grpo_advantages(rewards, 3, normalize_std=False),
        torch.tensor([1.0, -0.5, -0.5]),
        atol=ATOL_ADV,
        rtol=0,
    )
    torch.testing.assert_close(
        grpo_advantages(rewards, 3, leave_one_out=False, normalize_std=False),
        torch.tensor([2 / 3, -1 / 3, -1 / 3]),
        atol=ATOL_ADV,
        rtol=0,
    )


def test_loo_group_of_two_has_undefined_std_and_is_not_divided() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2)
    assert torch.equal(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_dtype_kept_and_no_grad() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64, requires_grad=True)
    adv = grpo_advantages(rewards, 2)
    assert adv.dtype == torch.float64 and not adv.requires_grad
    assert grpo_advantages(torch.tensor([1, 0, 0, 1]), 2).dtype == torch.float32


@pytest.mark.parametrize(
    ("rewards", "group_size", "kwargs", "match"),
    [
        (torch.zeros(7), 3, {}, "not a positive multiple of group_size=3"),
        (torch.zeros(4), 1, {}, "group_size must be >= 2"),
        (torch.zeros(4), 0, {"leave_one_out": False}, "group_size must be >= 1"),
        (torch.zeros(2, 4), 4, {}, "must be 1-D"),
        (torch.tensor([0.0, float("nan"), 1.0, 0.0]), 2, {}, "non-finite"),
        (torch.tensor([0.0, float("inf"), 1.0, 0.0]), 2, {}, "non-finite"),
        (torch.zeros(0), 2, {}, "not a positive multiple"),
    ],
)
def test_invalid_inputs_raise(rewards: torch.Tensor, group_size: int, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, group_size, **kwargs)
