"""Loss aggregation modes (token-mean, seq-mean-token-mean, Dr. GRPO's seq-mean-token-sum-norm) against
hand-computed losses and gradients, micro-batch splits that add up to the whole batch, and the entropy metric."""

from __future__ import annotations

import pytest
import torch

from fp8rl.rl import LOSS_AGG_MODES, LossConfig, LossNorm, policy_loss

ATOL = 1e-6  # float32 sums of a few O(1) terms (as in test_loss.py)

# two sequences: row 0 has 1 generated token (advantage +1), row 1 has 3 (advantage -1); on-policy, so every
# ratio and IS weight is 1 and each token's loss is exactly -A
MASK = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float32)
ADV = torch.tensor([1.0, -1.0])
# (loss, d loss / d curr per token) by hand
#   token-mean:  (-1 + 3) / 4 tokens = 0.5; each token -A / 4
#   seq-mean-token-mean: mean(-1 / 1, 3 / 3) = 0; row 0's token -A / (1 * 2), row 1's -A / (3 * 2)
#   seq-mean-token-sum-norm (norm 4): mean(-1 / 4, 3 / 4) = 0.25; each token -A / (4 * 2)
EXPECTED = {
    "token-mean": (0.5, [[-1 / 4, 0, 0], [1 / 4, 1 / 4, 1 / 4]]),
    "seq-mean-token-mean": (0.0, [[-1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6]]),
    "seq-mean-token-sum-norm": (0.25, [[-1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8]]),
}


def _cfg(mode: str) -> LossConfig:
    return LossConfig(loss_agg_mode=mode, loss_agg_norm_tokens=4 if mode == "seq-mean-token-sum-norm" else None)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_each_mode_matches_the_hand_computed_loss_and_gradient(mode: str) -> None:
    lp = torch.full((2, 3), -1.0)
    curr = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(curr, lp, lp, ADV, MASK, _cfg(mode))
    loss.backward()
    want_loss, want_grad = EXPECTED[mode]
    assert abs(float(loss.detach()) - want_loss) < ATOL
    assert abs(metrics["pg_loss"] - want_loss) < ATOL
    assert torch.allclose(curr.grad, torch.tensor(want_grad), atol=ATOL)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_counts_add_up_to_the_whole_batch(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    b, t = 6, 5
    mask = (torch.rand(b, t, generator=g) < 0.7).float()
    mask[2] = 0  # a row with no generated token counts in no denominator
    prev, gen = torch.randn(b, t, generator=g) - 2, torch.randn(b, t, generator=g) * 0.01 - 2
    adv = torch.randn(b, generator=g)
    base = prev + 0.05 * torch.randn(b, t, generator=g)
    whole = base.clone().requires_grad_(True)
    full, _ = policy_loss(whole, prev, gen, adv, mask, _cfg(mode))
    full.backward()
    parts = base.clone().requires_grad_(True)
    norm = LossNorm.of(mask)
    assert (norm.tokens, norm.sequences) == (int(mask.sum()), 5)
    total = sum(policy_loss(parts[s], prev[s], gen[s], adv[s], mask[s], _cfg(mode), num_tokens=norm.tokens,
                            num_sequences=norm.sequences)[0] for s in (slice(0, 2), slice(2, 3), slice(3, 6)))
    total.backward()
    assert abs(float(total.detach()) - float(full.detach())) < ATOL
    assert torch.allclose(parts.grad, whole.grad, atol=ATOL)


def test_sum_norm_needs_its_constant_and_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="needs loss_agg_norm_tokens"):
        LossConfig(loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        LossConfig(loss_agg_mode="sequence-mean")
    with pytest.raises(ValueError, match="num_sequences must be the finite global count"):
        lp = torch.zeros(2, 3)
        policy_loss(lp, lp, lp, ADV, MASK, _cfg("seq-mean-token-mean"), num_sequences=1)


def test_entropy_is_reported_as_the_token_mean_over_generated_tokens() -> None:
    lp = torch.zeros(2, 3)
    ent = torch.tensor([[0.5, 9.0, 9.0], [1.0, 2.0, 3.0]])  # off-mask values are never read
    _, m = policy_loss(lp, lp, lp, ADV, MASK, LossConfig(), entropy=ent)
    assert abs(m["entropy"] - (0.5 + 1 + 2 + 3) / 4) < ATOL
    assert "entropy" not in policy_loss(lp, lp, lp, ADV, MASK, LossConfig())[1]
