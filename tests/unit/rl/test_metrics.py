"""Mismatch metrics against hand-computed per-token values."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.rl import MAX_ABS_LOGPROB_DIFF, max_abs_logprob_diff, mismatch_metrics, token_mult_prob_error

ATOL_METRIC = 1e-6  # float32 per-token exp/log on O(1) values, averaged over a few tokens
ATOL_JS_IDENTICAL = 1e-10  # identical inputs: only logaddexp(a, a) - log 2 rounding, squared


def _k3(x: float) -> float:
    """exp(x) - 1 - x, the k3 term for log-ratio x."""
    return math.exp(x) - 1.0 - x


def _pair() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows; row 0 has three generated tokens, row 1 only padding full of garbage."""
    train = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.3)], [float("-inf"), 3.0, float("nan")]])
    gen = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.3)], [0.0, float("inf"), -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    return train, gen, mask


def test_identical_logprobs_are_exact() -> None:
    lp = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) - 2.0
    mask = torch.ones(3, 5, dtype=torch.bool)
    assert token_mult_prob_error(lp, lp.clone(), mask).item() == 1.0
    m = mismatch_metrics(lp, lp.clone(), mask)
    assert m[MAX_ABS_LOGPROB_DIFF] == 0.0
    assert m["token_mult_prob_error"] == 1.0
    assert m["gen_kl_k3"] == 0.0 and m["gen_kl_k3_reverse"] == 0.0
    assert abs(m["gen_js"]) < ATOL_JS_IDENTICAL
    assert m["is_weight_mean"] == 1.0 and m["is_weight_max"] == 1.0
    assert m["is_frac_outside"] == 0.0 and m["is_weight_mean_truncated"] == 1.0
    assert m["num_tokens"] == 15.0


def test_hand_computed_pair_ignores_padding_garbage() -> None:
    train, gen, mask = _pair()
    # Per-token d = train - gen = [ln 2, -ln 2, 0];  w = [2, 0.5, 1].
    ln2 = math.log(2.0)
    expected_err = (2.0 + 2.0 + 1.0) / 3
    assert token_mult_prob_error(train, gen, mask).item() == pytest.approx(expected_err, abs=ATOL_METRIC)

    m = mismatch_metrics(train, gen, mask, is_lo=0.5, is_hi=1.5)
    # JS proxy, token 0: p=.5, q=.25, mix=.375 -> 0.5*k3(ln .75) + 0.5*k3(ln 1.5); token 1 mirrors it.
    js_tok = 0.5 * _k3(math.log(0.375 / 0.5)) + 0.5 * _k3(math.log(0.375 / 0.25))
    expected = {
        MAX_ABS_LOGPROB_DIFF: ln2,
        "token_mult_prob_error": expected_err,
        "gen_kl_k3": (_k3(ln2) + _k3(-ln2)) / 3,
        "gen_kl_k3_reverse": (_k3(-ln2) + _k3(ln2)) / 3,
        "gen_js": 2 * js_tok / 3,
        "is_weight_mean": 3.5 / 3,
        "is_weight_max": 2.0,
        "is_frac_outside": 1 / 3,  # only w=2 > 1.5; 0.5 sits on the (inclusive) lower bound
        "is_weight_mean_truncated": (1.5 + 0.5 + 1.0) / 3,
        "num_tokens": 3.0,
        "num_nonfinite": 0.0,
    }
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=ATOL_METRIC), key


def test_max_abs_logprob_diff_catches_a_difference_the_means_round_away() -> None:
    """Issue 47: one token's logprob 1e-8 off — in FP32 ``exp(|d|)`` rounds it to 1 and ``expm1(d) - d`` to 0,
    so the means call the step exact; the raw max does not."""
    train = torch.tensor([[-0.05, -1.5, -2.0]])  # (1, 3) float32, as the engines return them
    gen = train.clone()
    gen[0, 0] = float(train[0, 0].double() - 1e-8)  # float32 ulp near -0.05 is 3.7e-9: representable (3 ulps)
    d = float(train[0, 0].double() - gen[0, 0].double())
    assert d == pytest.approx(1e-8, rel=0.2)
    mask = torch.ones(1, 3)
    m = mismatch_metrics(train, gen, mask)
    assert m["token_mult_prob_error"] == 1.0 and m["gen_kl_k3"] == 0.0  # rounded away: the old verdict, "exact"
    assert max_abs_logprob_diff(train, gen, mask) == m[MAX_ABS_LOGPROB_DIFF] == d > 0.0
    assert max_abs_logprob_diff(train, gen, torch.tensor([[0, 1, 1]])) == 0.0  # the token outside the mask


def test_max_abs_logprob_diff_is_nan_for_a_broken_engine_and_zero_for_an_empty_mask() -> None:
    train, gen, mask = _pair()
    assert max_abs_logprob_diff(train, gen, torch.zeros_like(mask)) == 0.0  # padding garbage is never read
    both_inf = torch.full((1, 2), float("-inf"))
    assert math.isnan(max_abs_logprob_diff(both_inf, both_inf, torch.ones(1, 2)))  # -inf - -inf: not "exact"


def test_kl_directions_differ_on_asymmetric_input() -> None:
    train = torch.tensor([[math.log(0.9)]])
    gen = torch.tensor([[math.log(0.3)]])
    m = mismatch_metrics(train, gen, torch.ones(1, 1))
    assert m["gen_kl_k3"] == pytest.approx(_k3(math.log(3.0)), abs=ATOL_METRIC)
    assert m["gen_kl_k3_reverse"] == pytest.approx(_k3(-math.log(3.0)), abs=ATOL_METRIC)
    assert m["gen_kl_k3"] > m["gen_kl_k3_reverse"] > 0.0


def test_nonfinite_logprob_zeroes_weight_and_is_reported() -> None:
    train = torch.tensor([[-1.0, -1.0]])
    gen = torch.tensor([[-1.0, float("-inf")]])  # engine returned -inf for a sampled token
    m = mismatch_metrics(train, gen, torch.ones(1, 2))
    assert m["num_nonfinite"] == 1.0
    assert m["is_weight_max"] == 1.0 and m["is_weight_mean"] == 0.5  # inf weight became 0
    assert math.isinf(m["token_mult_prob_error"])  # a broken engine must stay visible


def test_empty_mask_and_bf16_inputs() -> None:
    lp = torch.zeros(2, 3)
    assert token_mult_prob_error(lp, lp - 1.0, torch.zeros(2, 3)).item() == 1.0
    assert mismatch_metrics(lp, lp, torch.zeros(2, 3))["num_tokens"] == 0.0
    err = token_mult_prob_error(lp.bfloat16(), (lp - 0.5).bfloat16(), torch.ones(2, 3))
    assert err.dtype == torch.float32
    assert err.item() == pytest.approx(math.exp(0.5), abs=ATOL_METRIC)


def test_bad_inputs_raise() -> None:
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"gen_logprobs has shape \(2, 4\)"):
        token_mult_prob_error(lp, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="only 0 and 1"):
        mismatch_metrics(lp, lp, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="is_lo < is_hi"):
        mismatch_metrics(lp, lp, torch.ones(2, 3), is_lo=2.0, is_hi=1.0)


def test_mismatch_promise_names_what_it_does_not_know():
    from fp8rl.rl import mismatch_promise

    assert mismatch_promise("fp8_e2e", "fp8") <= mismatch_promise("fp8_e2e", "fp8", over="step")
    assert mismatch_promise("bf16") < mismatch_promise("fp8_gen_only")  # FP8 on one side only disagrees more
    with pytest.raises(ValueError, match="recipe='fp4'"):
        mismatch_promise("fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        mismatch_promise("fp8_e2e", "int8")
    with pytest.raises(ValueError, match="over must be"):
        mismatch_promise("fp8_e2e", over="mean")
