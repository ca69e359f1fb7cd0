"""What the libraries take, built from config sections: the RL loss, the arithmetic task, the FP8
recipe of a role, the trainer's settings. Imported lazily (they pull in torch)."""

from __future__ import annotations

__all__ = ["arith_config", "loss_config"]


def loss_config(loss, max_new_tokens: int | None = None):
    """The :class:`fp8rl.rl.LossConfig` of a :class:`~fp8rl.config.schema.LossSection`; ``max_new_tokens`` (the
    generation budget) is ``seq-mean-token-sum-norm``'s constant when ``loss.loss_agg_norm_tokens`` is unset
    (the section checks itself without it: any budget stands in)."""
    if max_new_tokens is None:
        max_new_tokens = 1
    from fp8rl.rl import LossConfig

    isc = loss.importance_sampling
    sum_norm = loss.loss_agg_mode == "seq-mean-token-sum-norm"
    return LossConfig(
        clip_eps_low=loss.clip_eps_low, clip_eps_high=loss.clip_eps_high, dual_clip_c=loss.dual_clip_c,
        kl_coef=loss.kl_coef, is_mode=isc.mode, tis_cap=isc.tis_cap, tis_min=isc.tis_min,
        icepop_lo=isc.icepop_lo, icepop_hi=isc.icepop_hi, seq_mask_lo=isc.seq_mask_lo, seq_mask_hi=isc.seq_mask_hi,
        loss_agg_mode=loss.loss_agg_mode,
        loss_agg_norm_tokens=(loss.loss_agg_norm_tokens or max_new_tokens) if sum_norm else None,
    )


def arith_config(arith):
    """The :class:`fp8rl.data.ArithConfig` of a :class:`~fp8rl.config.schema.ArithSection`."""
    from fp8rl.data import ArithConfig

    return ArithConfig(max_operand=arith.max_operand, num_terms=arith.num_terms, ops=arith.ops,
                       word_problems=arith.word_problems)
