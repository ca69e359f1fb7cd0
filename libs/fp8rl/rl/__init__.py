"""GRPO math: group-relative advantages, the clipped IS-corrected policy loss, mismatch metrics.

Pure PyTorch, no other fp8rl imports: engines and the loop call in, never the reverse.

- :mod:`fp8rl.rl.advantages` — :func:`grpo_advantages` (leave-one-out baseline by default).
- :mod:`fp8rl.rl.loss` — :class:`LossConfig`, :func:`importance_weights` (IS modes ``none``,
  ``token``, ``tis``, ``icepop``, ``seq_mask_tis``) and :func:`policy_loss` (token-mean,
  seq-mean-token-mean or Dr. GRPO's seq-mean-token-sum-norm aggregation over the global batch).
- :mod:`fp8rl.rl.shaping` — DAPO's overlong handling: the soft length penalty and which samples were truncated.
- :mod:`fp8rl.rl.metrics` — :func:`max_abs_logprob_diff` (0.0 iff exact), :func:`token_mult_prob_error` and
  :func:`mismatch_metrics` comparing trainer and rollout logprobs of the generated tokens.

Invariant: every function is a pure function of its tensors (no engine state, no randomness).
"""

from fp8rl.rl.advantages import grpo_advantages
from fp8rl.rl.loss import IS_MODES, LOSS_AGG_MODES, LossConfig, LossNorm, importance_weights, policy_loss
from fp8rl.rl.metrics import (
    MAX_ABS_LOGPROB_DIFF,
    MISMATCH_PROMISE,
    max_abs_logprob_diff,
    mismatch_metrics,
    mismatch_promise,
    token_mult_prob_error,
)

__all__ = [
    "IS_MODES",
    "LOSS_AGG_MODES",
    "MAX_ABS_LOGPROB_DIFF",
    "MISMATCH_PROMISE",
    "LossConfig",
    "LossNorm",
    "grpo_advantages",
    "importance_weights",
    "max_abs_logprob_diff",
    "mismatch_metrics",
    "mismatch_promise",
    "policy_loss",
    "token_mult_prob_error",
]
