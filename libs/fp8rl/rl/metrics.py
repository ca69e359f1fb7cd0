"""Train/generation mismatch metrics, masked to generated tokens.

The rollout engine samples token ``y_t`` and reports its logprob ``gen`` under the engine's
numerics (FP8 weights, FP8 KV cache...). The trainer recomputes the same token's logprob
``train`` (a.k.a. ``prev_logprobs``: the trainer at the weights that generated the batch, before
the update). Every metric here compares the two per token and averages over tokens where
``mask`` is 1 (generated tokens; prompt and padding positions are 0 and never read — they may
hold garbage such as ``-inf``).

With ``d = train - gen`` per token:

- ``mismatch/max_abs_logprob_diff = max(|d|)`` on the raw logprobs: the *exactness* figure. A step is exact
  (trainer bitwise the rollout) only when it is 0.0. The means below cannot decide that: in FP32
  ``exp(|d|)`` rounds to 1 for ``|d|`` below ~6e-8 and ``expm1(d) - d`` to 0 below ~1e-7 (issue 47).
- ``token_mult_prob_error = mean(exp(|d|))`` — 1.0 means (near-)identical; ~1.01 is a healthy BF16 run.
- ``gen_kl_k3 = mean(exp(d) - 1 - d)`` and ``gen_kl_k3_reverse = mean(exp(-d) - 1 + d)``: the k3
  KL estimator (Schulman) in both directions; below ~1e-3 is considered fine.
- ``gen_js``: a symmetric Jensen–Shannon-style proxy (see :func:`mismatch_metrics`).
- IS weights ``w = exp(d)`` (no gradient; NaN/Inf → 0): mean, max, fraction outside
  ``[is_lo, is_hi]`` before truncation, and mean after truncation to ``[0, is_hi]``.

Precision: all per-token math is done in at least float32 (bf16 inputs are upcast: a bf16
logprob near -5 has an ulp of 0.03, i.e. a 3% error in ``exp``, larger than the mismatch being
measured). Means are over *this call's* masked tokens; for a global figure across micro-batches,
weight each call's values by its ``num_tokens``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "validate_token_tensors",
    "masked_log_ratio",
    "raw_importance_weights",
    "MAX_ABS_LOGPROB_DIFF",
    "max_abs_logprob_diff",
    "token_mult_prob_error",
    "token_mult_prob_error_stderr",
    "mismatch_metrics",
    "MISMATCH_PROMISE",
    "mismatch_promise",
]


# What each recipe promises for ``token_mult_prob_error`` (1.0 = identical), keyed by (recipe, the
# rollout's kv_cache_dtype), as ``(median over a run's steps, any single step)``. Sources: REFERENCE
# "Mismatch metrics" (healthy BF16 ~1.01; FP8 recipes gated at median < 1.1) and DESIGN §4 (1.03–1.05
# the usual acceptable bound); measured values are from models whose dims are whole FP8 blocks.
#   bf16 / fp8_e2e, auto — both engines run the same linears on the same master weights; only the
#       decode-vs-prefill FP32 summation order differs (measured 1.000000–1.000004): the BF16 level.
#   fp8_e2e, fp8 — the rollout alone keeps K/V in E4M3 (2**-4 relative rounding of every key and
#       value), so each token's logprob moves a little: the 1.05 bound for the median (measured
#       1.019 on tiny-arith over 32 steps). A single step's mean is pulled up by its few worst
#       tokens: on the 24–32-token steps of the integration tests' random checkpoint the 99.9th
#       percentile is 1.055 (bootstrap over 2,961 tokens), so one step may reach 1.1 (the
#       reference's FP8 gate). Long trained runs show rarer spikes past that (1.62 once in 128
#       steps): runs are gated on the median, as the reference does.
#   fp8_gen_only — FP8 linears on the rollout side only (E4M3 rounding of every weight and
#       activation, felt by the rollout alone): the reference's FP8 gate, 1.1, for runs and steps
#       (measured 1.052 on a ~200-token step of a random 128-wide model, both ISAs).
MISMATCH_PROMISE: dict[tuple[str, str], tuple[float, float]] = {
    ("bf16", "auto"): (1.01, 1.01),
    ("bf16", "fp8"): (1.05, 1.1),
    ("fp8_e2e", "auto"): (1.01, 1.01),
    ("fp8_e2e", "fp8"): (1.05, 1.1),
    ("fp8_gen_only", "auto"): (1.1, 1.1),
    ("fp8_gen_only", "fp8"): (1.1, 1.1),
}


def mismatch_promise(recipe: str, kv_cache_dtype: str = "auto", *, over: str = "median") -> float:
    """The ``token_mult_prob_error`` a healthy run of ``recipe`` stays at or under (see MISMATCH_PROMISE).

    Args:
        recipe: ``bf16`` | ``fp8_gen_only`` | ``fp8_e2e``.
        kv_cache_dtype: the rollout's KV cache, ``auto`` | ``fp8``.
        over: ``median`` (over a run's steps: the gate for a run) or ``step`` (any one step).

    Raises:
        ValueError: an unknown recipe, kv_cache_dtype or ``over`` (each named).
    """
    if over not in ("median", "step"):
        raise ValueError(f"over must be 'median' or 'step', got {over!r}")
    try:
        median, step = MISMATCH_PROMISE[(recipe, kv_cache_dtype)]
    except KeyError:
        recipes = sorted({r for r, _ in MISMATCH_PROMISE})
        raise ValueError(f"no mismatch promise for recipe={recipe!r}, kv_cache_dtype={kv_cache_dtype!r} "
                         f"(recipes: {', '.join(recipes)}; kv_cache_dtype: auto | fp8)") from None
    return median if over == "median" else step


def validate_token_tensors(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """Check that every named ``(B, T)`` tensor matches ``mask``; return the mask as bool.

    Args:
        mask: ``(B, T)`` bool or 0/1 numeric mask selecting generated tokens.
        **tensors: per-token tensors keyed by the name used in error messages; ``None`` values
            are skipped (optional inputs).

    Returns:
        ``(B, T)`` bool mask.

    Raises:
        ValueError: ``mask`` is not 2-D or holds values other than 0/1; a named tensor is not
            a floating tensor of the mask's shape.
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a 2-D (B, T) tensor, got {shape}")
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(mask.shape):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"shape mismatch: {name} has shape {shape} but mask has shape {tuple(mask.shape)}; "
                f"{name} must be (B, T) like mask"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor of logprobs, got dtype {t.dtype}")
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1 (generated-token selector)")
    return mask != 0


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least float32; float64 if any input is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def masked_log_ratio(num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``num - den`` where ``mask`` else 0, in at least float32. ``(B, T)``; keeps autograd."""
    dtype = _compute_dtype(num, den)
    diff = num.to(dtype) - den.to(dtype)  # (B, T)
    # where() (not multiply) so -inf/NaN padding never leaks into sums or gradients.
    return torch.where(mask, diff, torch.zeros((), dtype=dtype, device=diff.device))


def raw_importance_weights(
    prev_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Uncorrected IS weights ``w = exp(prev - gen)``, detached, NaN/Inf → 0, masked positions 0.

    Args:
        prev_logprobs: ``(B, T)`` trainer logprobs of the sampled tokens.
        gen_logprobs: ``(B, T)`` rollout-engine logprobs of the same tokens.
        mask: ``(B, T)`` bool mask (already validated).

    Returns:
        ``(B, T)`` weights in at least float32, no autograd history.
    """
    log_w = masked_log_ratio(prev_logprobs.detach(), gen_logprobs.detach(), mask)  # (B, T)
    w = torch.exp(log_w)  # (B, T)
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    return torch.where(mask, w, torch.zeros_like(w))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, empty: float) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; ``empty`` when the mask selects nothing. 0-dim tensor."""
    count = mask.sum()
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    if int(count) == 0:
        return torch.tensor(empty, dtype=x.dtype, device=x.device)
    return total / count.to(x.dtype)


def expected_reward_gain(before: list[float], after: list[float], n: int) -> tuple[float, float]:
    """``(mean(after) - mean(before), its standard error)`` for per-problem solve rates, each the mean of ``n``
    Bernoulli draws (as :meth:`fp8rl.loop.GRPOLoop.solve_rates` measures them): the SE of independent draws,
    ``sqrt(sum_i p_i (1 - p_i) / n) / N`` over both measurements' ``N`` problems each."""
    if len(before) != len(after) or not before:
        raise ValueError(f"expected reward gain needs the same problems before and after (got {len(before)} and "
                         f"{len(after)})")
    N = len(before)
    var = sum(p * (1 - p) / n for p in before + after)
    return (sum(after) - sum(before)) / N, var**0.5 / N


MAX_ABS_LOGPROB_DIFF = "mismatch/max_abs_logprob_diff"  # the step metric's name; exact iff it is 0.0


def max_abs_logprob_diff(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """``max(|train - gen|)`` over the tokens where ``mask`` is 1: 0.0 iff the two are bitwise equal there.

    The one exactness test of the repo (report, stack tiers, benches): computed on the raw values in float64 —
    no ``exp``, no mean — so a single token off by one float32 ulp (~1e-8 near -1) shows, where
    :func:`token_mult_prob_error` rounds it to exactly 1.0.

    Args:
        train_logprobs: ``(B, T)`` trainer logprobs of the sampled tokens.
        gen_logprobs: ``(B, T)`` rollout-engine logprobs of the same tokens.
        mask: ``(B, T)`` bool or 0/1 mask of generated tokens.

    Returns:
        The largest absolute difference, >= 0.0; 0.0 for an empty mask; NaN when a masked token's difference
        is NaN (e.g. ``-inf`` on both sides), so a broken engine is never called exact.

    Raises:
        ValueError: shapes differ or the mask is not 0/1.
    """
    m = validate_token_tensors(mask, train_logprobs=train_logprobs, gen_logprobs=gen_logprobs)
    d = (train_logprobs.detach().double() - gen_logprobs.detach().double())[m].abs()  # (num_tokens,)
    return float(d.max()) if d.numel() else 0.0


def token_mult_prob_error(
    train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``sum(mask * exp(|train - gen|)) / sum(mask)``: the multiplicative per-token probability error.

    Args:
        train_logprobs: ``(B, T)`` trainer logprobs of the sampled tokens.
        gen_logprobs: ``(B, T)`` rollout-engine logprobs of the same tokens.
        mask: ``(B, T)`` bool or 0/1 mask of generated tokens.

    Returns:
        0-dim tensor (at least float32), >= 1.0; exactly 1.0 for identical logprobs or an empty
        mask. Detached.

    Raises:
        ValueError: shapes differ or the mask is not 0/1.
    """
    m = validate_token_tensors(mask, train_logprobs=train_logprobs, gen_logprobs=gen_logprobs)
    d = masked_log_ratio(train_logprobs.detach(), gen_logprobs.detach(), m)  # (B, T)
    return _masked_mean(torch.exp(d.abs()), m, empty=1.0)


def token_mult_prob_error_stderr(
    train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[float, int, int]:
    """The standard error of :func:`token_mult_prob_error` over sequences, and its sample: ``(se, sequences,
    tokens)``.

    Tokens of one sequence are not independent draws (they share a prompt, a sampled path, a KV cache), so the
    sequence is the unit: with ``S_i`` the sum of ``exp(|Δlogp|)`` over sequence i's ``n_i`` tokens and ``R =
    ΣS_i / Σn_i`` (the statistic, a ratio estimator), ``se = sqrt(m/(m-1) · Σ(S_i − R·n_i)²) / Σn_i`` over the
    ``m`` sequences with at least one token (the delta-method variance of a ratio of cluster sums). NaN with
    fewer than two such sequences. Rows are the first dimension of ``(B, T)``."""
    m = validate_token_tensors(mask, train_logprobs=train_logprobs, gen_logprobs=gen_logprobs)
    d = masked_log_ratio(train_logprobs.detach(), gen_logprobs.detach(), m).double()
    w = m.double()
    n = w.sum(dim=1)
    s = (torch.exp(d.abs()) * w).sum(dim=1)
    keep = n > 0
    n, s = n[keep], s[keep]
    seqs, tokens = int(keep.sum()), int(n.sum())
    if seqs < 2:
        return math.nan, seqs, tokens
    r = s.sum() / n.sum()
    var = seqs / (seqs - 1) * ((s - r * n) ** 2).sum()
    return float(var.sqrt() / n.sum()), seqs, tokens


def mismatch_metrics(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_lo: float = 0.5,
    is_hi: float = 2.0,
) -> dict[str, float]:
    """All per-step mismatch figures between trainer and rollout logprobs, as python floats.

    ``gen_js`` — the per-token pair ``p = exp(train)``, ``q = exp(gen)`` only tells us the two
    probabilities of the sampled token, so the full-vocabulary Jensen–Shannon divergence is out of
    reach. We report the symmetric k3-style proxy against the mixture ``m = (p + q) / 2``::

        log m   = logaddexp(train, gen) - log 2
        k3(a)   = exp(log m - a) - 1 - (log m - a)          # >= 0, 0 iff a == log m
        gen_js  = mean_t( 0.5 * k3(train) + 0.5 * k3(gen) )

    It is symmetric in (train, gen), >= 0 and zero iff they agree; it is a drift monitor, not
    an unbiased JS estimator.

    Args:
        train_logprobs: ``(B, T)`` trainer logprobs (``prev``) of the sampled tokens.
        gen_logprobs: ``(B, T)`` rollout-engine logprobs of the same tokens.
        mask: ``(B, T)`` bool or 0/1 mask of generated tokens.
        is_lo: lower IS bound used for ``is_frac_outside``; ``0 <= is_lo < is_hi``.
        is_hi: upper IS bound, also the truncation cap of ``is_weight_mean_truncated``.

    Returns:
        dict with ``mismatch/max_abs_logprob_diff`` (:func:`max_abs_logprob_diff`: 0.0 iff exact),
        ``token_mult_prob_error``, ``gen_kl_k3``, ``gen_kl_k3_reverse``, ``gen_js``,
        ``is_weight_mean``, ``is_weight_max``, ``is_frac_outside``, ``is_weight_mean_truncated``,
        ``num_tokens`` (masked-token count) and ``num_nonfinite`` (masked tokens whose log-ratio
        was NaN/Inf; their IS weight is 0 and their KL/error terms are NaN/Inf on purpose, so a
        broken engine is visible). With an empty mask: error and IS means 1.0, KLs and max 0.0.

    Raises:
        ValueError: shapes differ, the mask is not 0/1, or the IS bounds are invalid.
    """
    if not (math.isfinite(is_lo) and math.isfinite(is_hi) and 0.0 <= is_lo < is_hi):
        raise ValueError(f"need finite 0 <= is_lo < is_hi, got is_lo={is_lo!r}, is_hi={is_hi!r}")
    m = validate_token_tensors(mask, train_logprobs=train_logprobs, gen_logprobs=gen_logprobs)
    with torch.no_grad():
        d = masked_log_ratio(train_logprobs, gen_logprobs, m)  # (B, T), train - gen
        w = raw_importance_weights(train_logprobs, gen_logprobs, m)  # (B, T)
        dtype = d.dtype
        zero = torch.zeros((), dtype=dtype, device=d.device)

        k3_fwd = torch.expm1(d) - d  # (B, T); expm1 keeps precision for tiny d
        k3_rev = torch.expm1(-d) + d  # (B, T)

        dt = train_logprobs.to(dtype)
        dg = gen_logprobs.to(dtype)
        # Mixture log-prob; masked positions are zeroed first so padding -inf cannot produce NaN.
        dt = torch.where(m, dt, zero)
        dg = torch.where(m, dg, zero)
        log_mix = torch.logaddexp(dt, dg) - math.log(2.0)  # (B, T)
        u_t = log_mix - dt
        u_g = log_mix - dg
        js = 0.5 * (torch.expm1(u_t) - u_t) + 0.5 * (torch.expm1(u_g) - u_g)  # (B, T)

        count = int(m.sum())
        w_masked = w[m]  # (num_tokens,)
        outside = (w_masked < is_lo) | (w_masked > is_hi)
        nonfinite = int((~torch.isfinite(d) & m).sum())

        if count == 0:
            return {
                MAX_ABS_LOGPROB_DIFF: 0.0,
                "token_mult_prob_error": 1.0,
                "gen_kl_k3": 0.0,
                "gen_kl_k3_reverse": 0.0,
                "gen_js": 0.0,
                "is_weight_mean": 1.0,
                "is_weight_max": 1.0,
                "is_frac_outside": 0.0,
                "is_weight_mean_truncated": 1.0,
                "num_tokens": 0.0,
                "num_nonfinite": 0.0,
            }
        return {
            MAX_ABS_LOGPROB_DIFF: max_abs_logprob_diff(train_logprobs, gen_logprobs, m),
            "token_mult_prob_error": float(_masked_mean(torch.exp(d.abs()), m, empty=1.0)),
            "gen_kl_k3": float(_masked_mean(k3_fwd, m, empty=0.0)),
            "gen_kl_k3_reverse": float(_masked_mean(k3_rev, m, empty=0.0)),
            "gen_js": float(_masked_mean(js, m, empty=0.0)),
            "is_weight_mean": float(w_masked.mean()),
            "is_weight_max": float(w_masked.max()),
            "is_frac_outside": float(outside.to(dtype).mean()),
            "is_weight_mean_truncated": float(w_masked.clamp(0.0, is_hi).mean()),
            "num_tokens": float(count),
            "num_nonfinite": float(nonfinite),
        }
