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
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from fp8rl.data.grading import CORRECT_REWARD

from .items import ModelItem, ModelScore

__all__ = ["Scorer", "combined", "mix_rewards", "model_metrics", "needs_model", "pairwise_scores"]

Scorer = Callable[[list[ModelItem]], list[ModelScore]]
"""Scores model items in order: a :class:`~fp8rl.rewards.model.RewardModel`'s ``score``, or the reward replicas'."""


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
    took and its items per second, the share of samples the gate let through (``scores`` None: gated out), and with
    ``reward.model.agreement`` the FP8 model's agreement with itself in bf16."""
    asked = [s for s in scores if s is not None]
    scored = [s.score for s in asked if s.score is not None]
    out = {"reward/rule_mean": statistics.fmean(rules) if rules else 0.0,
           "reward/gate_open_fraction": len(asked) / len(scores) if scores else 0.0,
           "reward/model_scored": float(len(scored)), "reward/model_unscored": float(len(asked) - len(scored)),
           "reward/judge_tokens": float(sum(s.tokens for s in asked)),
           "reward/judge_unparsable_samples": float(sum(s.unparsable for s in asked)),
           "reward/model_seconds": seconds,
           "reward/model_items_per_s": len(asked) / seconds if seconds > 0 else 0.0}
    compared = [s for s in asked if s.compared]
    if compared:  # reward.model.agreement: the FP8 model against itself in bf16, on the step's items
        out["reward/model_agreement"] = sum(s.score == s.reference for s in compared) / len(compared)
        both = [abs(s.score - s.reference) for s in compared if s.score is not None and s.reference is not None]
        if both:
            out["reward/model_abs_diff_mean"] = statistics.fmean(both)
    if scored:
        out.update({"reward/model_mean": statistics.fmean(scored),
                    "reward/model_std": statistics.pstdev(scored), "reward/model_min": min(scored),
                    "reward/model_max": max(scored)})
    return out


def pairwise_scores(groups: Sequence[Sequence[int]], n: int, score: Scorer, items: Sequence[ModelItem]
                    ) -> list[ModelScore | None]:
    """``reward.model.pairwise``: every ordered pair ``(i, j)`` of distinct members of each group judged once (the
    judge reads ``i`` as ``{response}`` and ``j`` as ``{other}``, its score the chance that ``i`` is the better), and
    member ``i``'s score the mean, over the comparisons it was in that were scored, of its wins — ``s(i, j)`` as the
    first and ``1 - s(j, i)`` as the second (both orders: a judge's preference for a position cancels). Unscored
    when none of its comparisons was; a lone member is unscored (nothing to compare with). ``n``: how many samples
    there are (None for those in no group)."""
    order = [(i, j) for g in groups for i in g for j in g if i != j]
    got = score([replace(items[i], other=items[j].response) for i, j in order]) if order else []
    wins: dict[int, list[float]] = {i: [] for g in groups for i in g}
    spent: dict[int, list[int]] = {i: [0, 0] for i in wins}  # tokens, unparsable of the comparisons it leads
    errors: dict[int, str] = {}
    for (i, j), s in zip(order, got, strict=True):
        spent[i][0] += s.tokens
        spent[i][1] += s.unparsable
        if s.score is None:
            errors.setdefault(i, s.error)
            continue
        wins[i].append(s.score)
        wins[j].append(1.0 - s.score)
    out: list[ModelScore | None] = [None] * n
    for i, w in wins.items():
        out[i] = ModelScore(statistics.fmean(w), "", *spent[i]) if w else \
            ModelScore(None, errors.get(i, "no other response in its group to compare with"), *spent[i])
    return out


def mix_rewards(items: Sequence[ModelItem], rules: Sequence[float], score: Scorer, *, gate: bool, rule_weight: float,
                model_weight: float, pairwise: bool = False, group: int = 1
                ) -> tuple[list[float | None], dict[str, float]]:
    """The step's rewards and ``reward/*`` metrics from each sample's model item and rule reward (in the step's
    prompt-major order, ``group`` samples per prompt), the model's scores coming from ``score`` (in process, or the
    reward replicas): only the samples the gate lets through are scored — each alone, or with ``pairwise`` against
    the others of its group that the gate let through (:func:`pairwise_scores`) — and :func:`combined` makes each
    reward (None: unscored, left out of the step)."""
    ask = [k for k, r in enumerate(rules) if needs_model(r, gate=gate)]
    t = time.perf_counter()
    if pairwise:
        groups = [[k for k in ask if k // group == g] for g in range(-(-len(rules) // group))]
        scores = pairwise_scores([g for g in groups if g], len(rules), score, items)
    else:
        got = score([items[k] for k in ask]) if ask else []
        scores = [None] * len(rules)
        for k, s in zip(ask, got, strict=True):
            scores[k] = s
    metrics = model_metrics(rules, scores, time.perf_counter() - t)
    return [combined(r, s, gate=gate, rule_weight=rule_weight, model_weight=model_weight)
            for r, s in zip(rules, scores, strict=True)], metrics
