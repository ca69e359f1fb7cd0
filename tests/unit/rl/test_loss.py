"""Policy loss and IS corrections against hand-computed per-token values and autograd."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fp8rl.rl import IS_MODES, LossConfig, importance_weights, policy_loss

ATOL_LOSS = 1e-6  # float32 sums of a few O(1) terms
ATOL_GRAD = 1e-6
ATOL_W = 1e-6


def _rand(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------- LossConfig


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"is_mode must be one of \['none', 'token', 'tis'"):
        LossConfig(is_mode="tokens")
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        LossConfig(dual_clip_c=1.0)
    with pytest.raises(ValueError, match="clip_eps_low must be in"):
        LossConfig(clip_eps_low=1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.5)
    with pytest.raises(ValueError, match="kl_coef must be a finite number"):
        LossConfig(kl_coef=float("nan"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossConfig().kl_coef = 0.1  # type: ignore[misc]


# ---------------------------------------------------------------------------- importance weights


@pytest.mark.parametrize("mode", IS_MODES)
def test_identical_logprobs_give_unit_weights(mode: str) -> None:
    lp = _rand((3, 4), seed=1) - 3.0
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    w = importance_weights(lp, lp.clone(), mask, LossConfig(is_mode=mode))
    assert torch.equal(w, mask)  # exactly 1 on generated tokens, 0 elsewhere
    assert not w.requires_grad


def test_tis_never_exceeds_cap() -> None:
    prev, gen = _rand((16, 32), seed=2, scale=2.0), _rand((16, 32), seed=3, scale=2.0)
    mask = torch.ones(16, 32)
    cfg = LossConfig(is_mode="tis", tis_cap=2.0, tis_min=0.1)
    w = importance_weights(prev, gen, mask, cfg)
    raw = torch.exp(prev - gen)
    assert float(w.max()) <= cfg.tis_cap and float(w.min()) >= cfg.tis_min
    assert bool((raw > cfg.tis_cap).any())  # the random draw did exercise the cap
    inside = (raw >= cfg.tis_min) & (raw <= cfg.tis_cap)
    torch.testing.assert_close(w[inside], raw[inside], atol=ATOL_W, rtol=0)


def test_icepop_zeroes_out_of_range_tokens() -> None:
    raw = torch.tensor([[0.3, 0.6, 1.0, 4.5, 7.0]])
    gen = torch.full_like(raw, -2.0)
    prev = gen + raw.log()
    mask = torch.ones_like(raw)
    cfg = LossConfig(is_mode="icepop", icepop_lo=0.5, icepop_hi=5.0)
    w = importance_weights(prev, gen, mask, cfg)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.6, 1.0, 4.5, 0.0]]), atol=ATOL_W, rtol=0)

    curr = prev.clone().requires_grad_()
    _, metrics = policy_loss(curr, prev, gen, torch.ones(1), mask, cfg)
    assert metrics["is_masked_fraction"] == pytest.approx(2 / 5)


def test_seq_mask_tis_drops_out_of_bounds_sequence_only() -> None:
    gen = torch.full((2, 4), -1.0)
    # Row 0: log-ratios [5e-4, -5e-4, 1e-3] -> g = exp(1e-3 / 3) ~ 1.00033, inside [0.999, 1.002];
    #        its 4th position is padding holding -inf, which must not count.
    # Row 1: log-ratios [1e-2, 0, 0, 0]     -> g = exp(2.5e-3) ~ 1.0025 > 1.002: dropped.
    delta = torch.tensor([[5e-4, -5e-4, 1e-3, 0.0], [1e-2, 0.0, 0.0, 0.0]])
    prev = gen + delta
    prev[0, 3] = float("-inf")
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    w = importance_weights(prev, gen, mask, LossConfig(is_mode="seq_mask_tis"))
    expected = torch.tensor([[math.exp(5e-4), math.exp(-5e-4), math.exp(1e-3), 0.0], [0.0] * 4])
    torch.testing.assert_close(w, expected, atol=ATOL_W, rtol=0)  # kept row: raw token weights

    curr = prev.clone().requires_grad_()
    _, metrics = policy_loss(curr, prev, gen, torch.ones(2), mask, LossConfig(is_mode="seq_mask_tis"))
    assert metrics["is_masked_fraction"] == pytest.approx(4 / 7)


# ---------------------------------------------------------------------------- surrogate


def test_clipped_tokens_get_zero_gradient() -> None:
    prev = torch.full((1, 4), -1.0)
    gen = prev.clone()
    # Tokens: (A>0, r=1.5: clipped), (A>0, r=1.1: free), (A<0, r=0.5: clipped), (A<0, r=1.5: free).
    ratios = torch.tensor([[1.5, 1.1, 0.5, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -2.0, -2.0]])
    curr = (prev + ratios.log()).requires_grad_()
    mask = torch.ones(1, 4)
    loss, metrics = policy_loss(curr, prev, gen, adv, mask, LossConfig(is_mode="none"))
    loss.backward()
    # Per-token loss: clipped tokens -A*clip(r), free ones -A*r; d/dcurr of -A*r is -A*r.
    expected_loss = (-1.0 * 1.2 - 1.0 * 1.1 + 2.0 * 0.8 + 2.0 * 1.5) / 4
    expected_grad = torch.tensor([[0.0, -1.1, 0.0, 3.0]]) / 4
    assert loss.item() == pytest.approx(expected_loss, abs=ATOL_LOSS)
    torch.testing.assert_close(curr.grad, expected_grad, atol=ATOL_GRAD, rtol=0)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 1.5) / 4, abs=ATOL_LOSS)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    prev = torch.zeros(1, 1)
    curr = torch.full((1, 1), 2.0, requires_grad=True)  # ratio e^2 ~ 7.39
    adv = torch.tensor([-1.0])
    loss_free, _ = policy_loss(curr, prev, prev, adv, torch.ones(1, 1), LossConfig())
    assert loss_free.item() == pytest.approx(math.exp(2.0), abs=ATOL_LOSS)
    loss, metrics = policy_loss(curr, prev, prev, adv, torch.ones(1, 1), LossConfig(dual_clip_c=3.0))
    assert loss.item() == pytest.approx(3.0, abs=ATOL_LOSS)
    assert metrics["dual_clip_fraction"] == 1.0
    loss.backward()
    assert curr.grad.item() == 0.0


def test_kl_term_hand_computed() -> None:
    curr = torch.full((1, 2), -1.0, requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2.0), -1.0]])  # ref - curr = [ln 2, 0]
    cfg = LossConfig(kl_coef=0.5)
    loss, metrics = policy_loss(
        curr, curr.detach(), curr.detach(), torch.zeros(1), torch.ones(1, 2), cfg, ref_logprobs=ref
    )
    k3 = 2.0 - math.log(2.0) - 1.0
    assert metrics["kl"] == pytest.approx(k3 / 2, abs=ATOL_LOSS)
    assert loss.item() == pytest.approx(0.5 * k3 / 2, abs=ATOL_LOSS)  # A = 0: only the KL term
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(curr, curr.detach(), curr.detach(), torch.zeros(1), torch.ones(1, 2), cfg)


def test_microbatches_with_global_count_sum_to_full_batch() -> None:
    b, t = 6, 7
    prev = _rand((b, t), seed=4, scale=0.5) - 2.0
    gen = prev + _rand((b, t), seed=5, scale=0.3)
    ref = prev + _rand((b, t), seed=6, scale=0.1)
    curr = (prev + _rand((b, t), seed=7, scale=0.3)).requires_grad_()
    adv = _rand((b,), seed=8)
    mask = (torch.rand((b, t), generator=torch.Generator().manual_seed(9)) > 0.3).float()
    mask[:, 0] = 1.0
    cfg = LossConfig(is_mode="tis", kl_coef=0.01, dual_clip_c=3.0)

    full, _ = policy_loss(curr, prev, gen, adv, mask, cfg, ref_logprobs=ref)
    (full_grad,) = torch.autograd.grad(full, curr)
    total = int(mask.sum())
    parts = [
        policy_loss(curr[s], prev[s], gen[s], adv[s], mask[s], cfg, ref_logprobs=ref[s], num_tokens=total)[0]
        for s in (slice(0, 3), slice(3, 6))
    ]
    summed = parts[0] + parts[1]
    (summed_grad,) = torch.autograd.grad(summed, curr)
    assert summed.item() == pytest.approx(full.item(), abs=ATOL_LOSS)
    torch.testing.assert_close(summed_grad, full_grad, atol=ATOL_GRAD, rtol=0)
    # A micro-batch alone, without the global count, is its own mean: not the same number.
    alone, _ = policy_loss(curr[:3], prev[:3], gen[:3], adv[:3], mask[:3], cfg, ref_logprobs=ref[:3])
    assert alone.item() != pytest.approx(parts[0].item(), abs=ATOL_LOSS)


def test_empty_mask_gives_zero_connected_loss_and_ignores_padding() -> None:
    curr = torch.tensor([[float("-inf"), 0.0]], requires_grad=True)
    prev = torch.tensor([[0.0, float("nan")]])
    loss, metrics = policy_loss(curr, prev, prev, torch.ones(1), torch.zeros(1, 2), LossConfig())
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_tokens"] == 0.0
    assert torch.equal(curr.grad, torch.zeros(1, 2))


def test_bad_shapes_and_counts_raise() -> None:
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    cfg = LossConfig()
    with pytest.raises(ValueError, match=r"curr_logprobs has shape \(2, 4\) but mask has shape \(2, 3\)"):
        policy_loss(torch.zeros(2, 4), lp, lp, torch.ones(2), mask, cfg)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        policy_loss(lp, lp, lp, torch.ones(3), mask, cfg)
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(3, 3\)"):
        policy_loss(lp, lp, lp, torch.ones(2), mask, LossConfig(kl_coef=0.1), ref_logprobs=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="num_tokens must be"):
        policy_loss(lp, lp, lp, torch.ones(2), mask, cfg, num_tokens=5)
    with pytest.raises(ValueError, match="NaN/Inf"):
        policy_loss(lp, lp, lp, torch.tensor([1.0, float("nan")]), mask, cfg)
    with pytest.raises(ValueError, match=r"gen_logprobs has shape \(3, 2\)"):
        importance_weights(lp, torch.zeros(3, 2), mask, cfg)
