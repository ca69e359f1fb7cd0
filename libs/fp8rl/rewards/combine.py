"""How the rule grader's rewards and a reward model's scores make a step's rewards (``reward.combine``), and the
step's ``reward/*`` metrics of them — one function each, for the in-process loop and the controller alike.

Per sample, with rule reward ``r`` and model score ``m`` (both in [0, 1]):

- ``gate`` on and ``r`` not above :data:`~fp8rl.data.grading.CORRECT_REWARD`: the reward is 0, and the model is not
  asked (a gate saves the judge's work on what the rule already failed);
- otherwise ``(rule_weight * r + model_weight * m) / (rule_weight + model_weight)``;
- ``m`` unscored (the judge timed out, its output did not parse, its replica died — after the caller's retries):
  the reward is None, *ungraded*: the sample is left out of the step (its group's advantages computed without it),
  and counted in ``reward/model_unscored``. A policy answer the *rule* cannot parse still scores 0 (DESIGN §2): that
  is a verdict on the policy, not a failure of the grader.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from fp8rl.data.grading import CORRECT_REWARD

from .items import ModelScore

__all__ = ["combined", "model_metrics", "needs_model"]


def needs_model(rule: float, *, gate: bool) -> bool:
    """Whether a sample with rule reward ``rule`` is scored by the model (with ``gate``, only what the rule passes)."""
    return not gate or rule > CORRECT_REWARD


def combined(rule: float, score: ModelScore | None, *, gate: bool, rule_weight: float, model_weight: float
             ) -> float | None:
    """The sample's reward (module docstring); ``score`` None: the model was not asked (the gate closed)."""
    if not needs_model(rule, gate=gate):
        return 0.0
    if score is None or score.score is None:
        return None
    return (rule_weight * rule + model_weight * score.score) / (rule_weight + model_weight)


def model_metrics(rules: Sequence[float], scores: Sequence[ModelScore | None], seconds: float) -> dict[str, float]:
    """``reward/*`` of one step: the rule's mean, the model's score distribution (mean, std, min, max over the scored
    samples), how many it scored and left unscored, the judge's tokens and unparsable samples, the seconds the model
    took and its items per second, and the share of samples the gate let through (``scores`` None: gated out)."""
    asked = [s for s in scores if s is not None]
    scored = [s.score for s in asked if s.score is not None]
    out = {"reward/rule_mean": statistics.fmean(rules) if rules else 0.0,
           "reward/gate_open_fraction": len(asked) / len(scores) if scores else 0.0,
           "reward/model_scored": float(len(scored)), "reward/model_unscored": float(len(asked) - len(scored)),
           "reward/judge_tokens": float(sum(s.tokens for s in asked)),
           "reward/judge_unparsable_samples": float(sum(s.unparsable for s in asked)),
           "reward/model_seconds": seconds,
           "reward/model_items_per_s": len(asked) / seconds if seconds > 0 else 0.0}
    if scored:
        out.update({"reward/model_mean": statistics.fmean(scored),
                    "reward/model_std": statistics.pstdev(scored), "reward/model_min": min(scored),
                    "reward/model_max": max(scored)})
    return out
