"""Clipped policy-gradient (GRPO/PPO) loss with train/generation importance-sampling correction.

Three logprob sets per sampled token, all ``(B, T)``:

- ``gen``  — the rollout engine's logprob (FP8 numerics) when it sampled the token;
- ``prev`` — the trainer's logprob at the weights that generated the batch (no gradient);
- ``curr`` — the trainer's logprob now, the only one carrying gradient.

Per token, with ``r = exp(curr - prev)`` and advantage ``A``::

    pg   = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))     # PPO clipped surrogate
    pg   = min(pg, -A * c)            where A < 0 and dual clip c is set
    pg  *= w                          # IS correction, w from exp(prev - gen), no gradient
    loss_t = pg + kl_coef * (exp(ref - curr) - (ref - curr) - 1)    # k3 KL to the reference

and the tokens are aggregated per ``loss_agg_mode`` (verl's names) over the *global* batch:

- ``token-mean`` (default): ``sum(mask * loss_t) / num_tokens`` — every token weighs the same, whatever its
  sequence's length;
- ``seq-mean-token-mean``: each sequence's token mean, averaged over the sequences (GRPO as published: a
  token of a short response weighs more);
- ``seq-mean-token-sum-norm`` (Dr. GRPO): each sequence's token *sum* divided by a constant
  ``loss_agg_norm_tokens`` (the generation budget), averaged over the sequences — no length bias either way.

Sequences count when they hold at least one generated token.

Why ``prev`` and ``gen`` both exist: FP8 rollout and BF16/FP8 training disagree slightly on every
token, so the batch is off-policy for the trainer even before the first update. The clipped ratio
handles the trainer's own drift (``curr`` vs ``prev``); ``w`` corrects the engine mismatch
(``prev`` vs ``gen``). The KL term is not IS-weighted (it regularises ``curr`` towards ``ref``,
independent of how the sample was drawn). Precision: everything is computed in at least float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8rl.rl.metrics import masked_log_ratio, raw_importance_weights, validate_token_tensors

__all__ = ["IS_MODES", "LOSS_AGG_MODES", "LossConfig", "LossNorm", "importance_weights", "policy_loss"]

IS_MODES = ("none", "token", "tis", "icepop", "seq_mask_tis")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossNorm:
    """The denominators of one optimizer update's loss, counted over its *global* batch (every micro-batch and
    rank passes the same): generated tokens, and sequences holding at least one."""

    tokens: int
    sequences: int

    @classmethod
    def of(cls, loss_mask: torch.Tensor) -> LossNorm:
        """The counts of a ``(B, T)`` 0/1 loss mask."""
        return cls(tokens=int(loss_mask.sum()), sequences=int((loss_mask.sum(dim=-1) > 0).sum()))


def _check_number(name: str, value: object) -> float:
    """Return ``value`` as float, or raise ``ValueError`` naming the field if not a finite real."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"LossConfig.{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LossConfig:
    """Policy-loss hyper-parameters; validated on construction (``ValueError`` names the field).

    Every IS range must contain 1.0, so an exactly on-policy token (``w == 1``) keeps weight 1.
    """

    clip_eps_low: float = 0.2
    """Lower PPO clip: ratio clipped below at ``1 - clip_eps_low``; in ``[0, 1)``."""
    clip_eps_high: float = 0.2
    """Upper PPO clip: ratio clipped above at ``1 + clip_eps_high``; ``>= 0`` (asymmetric allowed)."""
    dual_clip_c: float | None = None
    """Dual clip: for ``A < 0`` the per-token loss is capped at ``-A * c``; ``None`` (off) or ``> 1``."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy; ``>= 0``; ``> 0`` requires ``ref_logprobs``."""
    is_mode: str = "token"
    """IS correction: one of :data:`IS_MODES` (``none``, ``token``, ``tis``, ``icepop``, ``seq_mask_tis``)."""
    tis_cap: float = 2.0
    """``tis`` mode: upper truncation C of ``w``; ``>= 1``."""
    tis_min: float = 0.0
    """``tis`` mode: lower truncation of ``w``; ``0 <= tis_min <= 1``."""
    icepop_lo: float = 0.5
    """``icepop`` mode: tokens with ``w < icepop_lo`` get weight 0; ``0 <= icepop_lo <= 1``."""
    icepop_hi: float = 5.0
    """``icepop`` mode: tokens with ``w > icepop_hi`` get weight 0; ``>= 1``."""
    seq_mask_lo: float = 0.999
    """``seq_mask_tis`` mode: sequences whose geometric-mean ratio is below this are dropped; ``(0, 1]``."""
    seq_mask_hi: float = 1.002
    """``seq_mask_tis`` mode: sequences whose geometric-mean ratio is above this are dropped; ``>= 1``."""
    loss_agg_mode: str = "token-mean"
    """How token losses make the loss: one of :data:`LOSS_AGG_MODES` (see the module doc)."""
    loss_agg_norm_tokens: int | None = None
    """``seq-mean-token-sum-norm``: the constant a sequence's token sum is divided by (> 0, required there)."""

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"LossConfig.loss_agg_mode must be one of {list(LOSS_AGG_MODES)}, "
                             f"got {self.loss_agg_mode!r}")
        n = self.loss_agg_norm_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"LossConfig.loss_agg_norm_tokens must be a positive int or None, got {n!r}")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and n is None:
            raise ValueError("LossConfig.loss_agg_mode 'seq-mean-token-sum-norm' needs loss_agg_norm_tokens (the "
                             "generation budget each sequence's token sum is divided by)")
        lo = _check_number("clip_eps_low", self.clip_eps_low)
        if not 0.0 <= lo < 1.0:
            raise ValueError(f"LossConfig.clip_eps_low must be in [0, 1), got {lo}")
        if _check_number("clip_eps_high", self.clip_eps_high) < 0.0:
            raise ValueError(f"LossConfig.clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.dual_clip_c is not None and _check_number("dual_clip_c", self.dual_clip_c) <= 1.0:
            raise ValueError(f"LossConfig.dual_clip_c must be > 1 (or None), got {self.dual_clip_c}")
        if _check_number("kl_coef", self.kl_coef) < 0.0:
            raise ValueError(f"LossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.is_mode not in IS_MODES:
            raise ValueError(f"LossConfig.is_mode must be one of {list(IS_MODES)}, got {self.is_mode!r}")
        for lo_name, hi_name, lo_min, strict in (
            ("tis_min", "tis_cap", 0.0, False),
            ("icepop_lo", "icepop_hi", 0.0, False),
            ("seq_mask_lo", "seq_mask_hi", 0.0, True),
        ):
            lo_v = _check_number(lo_name, getattr(self, lo_name))
            hi_v = _check_number(hi_name, getattr(self, hi_name))
            too_low = lo_v <= lo_min if strict else lo_v < lo_min
            if too_low or not lo_v <= 1.0 <= hi_v:
                bound = ">" if strict else ">="
                raise ValueError(
                    f"LossConfig needs {lo_name} {bound} {lo_min} and {lo_name} <= 1 <= {hi_name} "
                    f"(an on-policy token must keep weight 1), got {lo_name}={lo_v}, {hi_name}={hi_v}"
                )


def _corrected_weights(
    prev_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """IS weights after ``cfg.is_mode``'s correction, and which masked tokens the mode dropped.

    Args:
        prev_logprobs, gen_logprobs: ``(B, T)`` float.
        mask: ``(B, T)`` bool (validated).
        cfg: loss configuration.

    Returns:
        ``(weights, dropped)``: ``(B, T)`` detached weights (0 off-mask) and ``(B, T)`` bool,
        True where icepop / seq_mask_tis forced a generated token's weight to 0.
    """
    w = raw_importance_weights(prev_logprobs, gen_logprobs, mask)  # (B, T), 0 off-mask
    dropped = torch.zeros_like(mask)
    if cfg.is_mode == "none":
        w = mask.to(w.dtype)
    elif cfg.is_mode == "tis":
        # clamp would lift off-mask zeros to tis_min, so re-mask afterwards.
        w = torch.where(mask, w.clamp(cfg.tis_min, cfg.tis_cap), torch.zeros_like(w))
    elif cfg.is_mode == "icepop":
        keep = (w >= cfg.icepop_lo) & (w <= cfg.icepop_hi)  # (B, T); NaN-free since w is finite
        dropped = mask & ~keep
        w = torch.where(keep, w, torch.zeros_like(w))
    elif cfg.is_mode == "seq_mask_tis":
        log_w = masked_log_ratio(prev_logprobs.detach(), gen_logprobs.detach(), mask)  # (B, T)
        count = mask.sum(dim=-1).clamp(min=1).to(log_w.dtype)  # (B,)
        g = torch.exp(log_w.sum(dim=-1) / count)  # (B,) geometric-mean ratio per sequence
        # NaN/Inf log-ratios make g NaN/Inf/0, which fails the comparison: the sequence is dropped.
        keep_seq = (g >= cfg.seq_mask_lo) & (g <= cfg.seq_mask_hi)  # (B,)
        dropped = mask & ~keep_seq.unsqueeze(-1)  # (B, T)
        w = torch.where(keep_seq.unsqueeze(-1), w, torch.zeros_like(w))
    # "token": plain untruncated w, as the reference's shipped FP8 recipes use.
    return w, dropped


def importance_weights(
    prev_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """Per-token IS weights correcting trainer/rollout mismatch, per ``cfg.is_mode``.

    ``w = exp(prev - gen)`` (detached; NaN/Inf → 0; 0 off-mask), then:

    - ``none``: 1 on every generated token;
    - ``token``: ``w``;
    - ``tis``: ``clamp(w, tis_min, tis_cap)``;
    - ``icepop``: ``w`` where ``icepop_lo <= w <= icepop_hi``, else 0;
    - ``seq_mask_tis``: per sequence ``g = exp(mean_t(prev - gen))`` over generated tokens; a
      sequence with ``g`` outside ``[seq_mask_lo, seq_mask_hi]`` gets 0 on every token, a kept
      one the raw ``w``.

    Args:
        prev_logprobs: ``(B, T)`` trainer logprobs at the generating weights.
        gen_logprobs: ``(B, T)`` rollout-engine logprobs.
        mask: ``(B, T)`` bool or 0/1 mask of generated tokens.
        cfg: loss configuration (``is_mode`` and its bounds).

    Returns:
        ``(B, T)`` weights, at least float32, no autograd history, 0 where ``mask`` is 0.

    Raises:
        ValueError: shapes differ or the mask is not 0/1.
    """
    m = validate_token_tensors(mask, prev_logprobs=prev_logprobs, gen_logprobs=gen_logprobs)
    return _corrected_weights(prev_logprobs, gen_logprobs, m, cfg)[0]


def _resolve_count(name: str, what: str, value: int | float | torch.Tensor | None, local: int) -> float:
    """A loss denominator: this call's count ``local``, or the caller's global count ``value`` (validated)."""
    if value is None:
        return float(local)
    n = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
    if not math.isfinite(n) or n < local:
        raise ValueError(f"{name} must be the finite global count of {what}, >= this call's {local}; got {n}")
    return n


def _token_scale(m: torch.Tensor, cfg: LossConfig, num_sequences, dtype: torch.dtype) -> torch.Tensor:
    """``(B, T)`` weight of each token's loss under the sequence-mean modes (0 off-mask)."""
    per_seq = m.sum(dim=-1)  # (B,)
    seqs = _resolve_count("num_sequences", "sequences with generated tokens", num_sequences, int((per_seq > 0).sum()))
    if cfg.loss_agg_mode == "seq-mean-token-mean":
        row = 1.0 / (per_seq.clamp(min=1).to(dtype) * max(seqs, 1.0))  # (B,)
    else:  # seq-mean-token-sum-norm
        row = torch.full(per_seq.shape, 1.0 / (cfg.loss_agg_norm_tokens * max(seqs, 1.0)), dtype=dtype,
                         device=m.device)
    return torch.where(m, row.unsqueeze(-1).expand_as(m), torch.zeros((), dtype=dtype, device=m.device))


def policy_loss(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: int | float | torch.Tensor | None = None,
    num_sequences: int | float | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped, IS-corrected policy-gradient loss, aggregated per ``cfg.loss_agg_mode`` over the global batch.

    Micro-batching: pass the *global* generated-token count of the whole batch as ``num_tokens``
    (and, for the sequence-mean modes, its count of sequences with generated tokens as ``num_sequences``;
    :class:`LossNorm` counts both) to every micro-batch call. Each call then returns its share of the
    full-batch loss (token-mean: ``sum(mask * loss_t) / global_count``), so the sum of the micro-batch losses
    (and of their gradients, when accumulated) equals the full-batch loss. Left ``None``, the counts are
    this call's.

    Args:
        curr_logprobs: ``(B, T)`` trainer logprobs under the weights being optimised (grad flows).
        prev_logprobs: ``(B, T)`` trainer logprobs at the generating weights (treated as constant).
        gen_logprobs: ``(B, T)`` rollout-engine logprobs of the same tokens.
        advantages: ``(B,)`` per sequence or ``(B, T)`` per token; treated as constant.
        mask: ``(B, T)`` bool or 0/1; 1 on generated tokens. Off-mask entries of every tensor are
            never read (they may be ``-inf`` or NaN padding).
        cfg: loss configuration.
        ref_logprobs: ``(B, T)`` reference-policy logprobs; required when ``cfg.kl_coef > 0``.
        num_tokens: global generated-token count (see above); must be >= this call's count.
        num_sequences: global count of sequences with generated tokens (sequence-mean modes only).
        entropy: ``(B, T)`` the policy's entropy at each token's position (no gradient), reported as the
            token mean ``entropy``; None leaves it out.

    Returns:
        ``(loss, metrics)``. ``loss`` is a 0-dim tensor connected to ``curr_logprobs``'s graph
        (0 when there are no tokens). ``metrics`` holds python floats: ``pg_loss`` and ``kl``
        (this call's share of them, aggregated like the loss — token-mean: over ``num_tokens`` — so
        micro-batch values add up; 0 when not computed), and over this call's generated tokens: ``clip_fraction``
        (PPO clip active: the token's gradient is 0), ``dual_clip_fraction``, ``ratio_mean``,
        ``is_weight_mean`` (after the mode's correction), ``is_masked_fraction`` (tokens zeroed
        by icepop / seq_mask_tis), ``num_tokens`` (this call's count), and ``entropy`` when given.

    Raises:
        ValueError: a shape mismatch (names the tensors and shapes), non-0/1 mask, non-finite
            advantages on generated tokens, ``kl_coef > 0`` without ``ref_logprobs``, or an
            invalid ``num_tokens``.
    """
    m = validate_token_tensors(
        mask,
        curr_logprobs=curr_logprobs,
        prev_logprobs=prev_logprobs,
        gen_logprobs=gen_logprobs,
        ref_logprobs=ref_logprobs,
    )
    batch, seq = m.shape
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((batch,), (batch, seq)):
        shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(
            f"shape mismatch: advantages has shape {shape} but mask has shape {(batch, seq)}; "
            f"advantages must be (B,) = ({batch},) or (B, T) = ({batch}, {seq})"
        )
    use_kl = cfg.kl_coef > 0.0
    if use_kl and ref_logprobs is None:
        raise ValueError(f"LossConfig.kl_coef={cfg.kl_coef} > 0 needs ref_logprobs (B, T); got None")

    dtype = torch.promote_types(torch.promote_types(curr_logprobs.dtype, prev_logprobs.dtype), torch.float32)
    zero = torch.zeros((), dtype=dtype, device=curr_logprobs.device)
    adv = advantages.detach().to(dtype)
    adv = adv.unsqueeze(-1).expand(batch, seq) if adv.dim() == 1 else adv  # (B, T)
    adv = torch.where(m, adv, zero)
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("advantages hold NaN/Inf on generated tokens")

    # Off-mask log-ratio is 0 before exp, so padding can never put Inf/NaN into the backward pass.
    log_ratio = masked_log_ratio(curr_logprobs, prev_logprobs.detach(), m)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_unclipped = -adv * ratio  # (B, T)
    pg_clipped = -adv * ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)  # (B, T)
    # Strict '>' : on ties (ratio inside the clip range) the unclipped branch carries the gradient.
    clip_active = m & (pg_clipped > pg_unclipped)  # (B, T)
    pg = torch.where(clip_active, pg_clipped, pg_unclipped)  # (B, T) == max of the two
    dual_active = torch.zeros_like(m)
    if cfg.dual_clip_c is not None:
        cap = -adv * cfg.dual_clip_c  # (B, T), constant: capped tokens get no gradient
        dual_active = m & (adv < 0) & (pg > cap)
        pg = torch.where(dual_active, cap, pg)

    weights, dropped = _corrected_weights(prev_logprobs, gen_logprobs, m, cfg)  # (B, T) each
    pg = pg * weights.to(dtype)
    per_token = pg
    k3 = None
    if use_kl:
        ref_minus_curr = masked_log_ratio(ref_logprobs.detach(), curr_logprobs, m).to(dtype)  # (B, T)
        k3 = torch.expm1(ref_minus_curr) - ref_minus_curr  # (B, T), >= 0
        per_token = per_token + cfg.kl_coef * k3

    local = int(m.sum())
    denom = _resolve_count("num_tokens", "generated tokens", num_tokens, local)
    if cfg.loss_agg_mode == "token-mean":
        total = torch.where(m, per_token, zero).sum()
        # No tokens: multiply by 0 rather than return a fresh constant, so backward() still works.
        loss = total / denom if denom > 0 else total * 0.0

        def share(x: torch.Tensor) -> float:  # this call's share of the batch value of a per-token term
            return float(torch.where(m, x, zero).sum()) / denom if denom > 0 else 0.0
    else:
        scale = _token_scale(m, cfg, num_sequences, dtype)  # (B, T), 0 off-mask
        loss = torch.where(m, per_token * scale, zero).sum()

        def share(x: torch.Tensor) -> float:
            return float(torch.where(m, x * scale, zero).sum())

    with torch.no_grad():

        def masked_sum(x: torch.Tensor) -> float:
            return float(torch.where(m, x, zero).sum())

        def frac(flags: torch.Tensor) -> float:
            return float((flags & m).sum()) / local if local else 0.0

        metrics = {
            "pg_loss": share(pg),
            "kl": share(k3) if k3 is not None else 0.0,
            "clip_fraction": frac(clip_active),
            "dual_clip_fraction": frac(dual_active),
            "ratio_mean": masked_sum(ratio) / local if local else 1.0,
            "is_weight_mean": masked_sum(weights) / local if local else 1.0,
            "is_masked_fraction": frac(dropped),
            "num_tokens": float(local),
        }
        if entropy is not None:
            metrics["entropy"] = masked_sum(entropy.detach().to(dtype)) / local if local else 0.0
    return loss, metrics
