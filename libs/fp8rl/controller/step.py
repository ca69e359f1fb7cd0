"""One GRPO step, weight version v → v+1, written once: the in-process loop and the controller both run it.

The phases (DESIGN §2), in order, over a :class:`StepBackends`:

    rollout    ``generate``: G samples of every prompt of the step, every one pinned to v
    reward     ``score``: one *graded* reward per sample (a backend that cannot grade one raises)
    train      ``train``: the trainer's logprobs of the sampled tokens, the mismatch metrics, loss and
               optimizer step → v+1, published (the backend reports its logprobs / train / publish times)
    calibrate  ``calibrate``: the QKV scales of v+1 on this step's sequences (FP8 KV cache only)
    refit      ``await_refit``: until the rollout side holds v+1 (weights and scales together)

:func:`first_half` runs rollout → reward → train and returns the step's record so far, which the
controller saves before anything else (so a restart finishes an already trained step instead of
training it twice); :func:`finish` runs calibrate → refit on such a record. :func:`run_step` is both.
:func:`first_half` is :func:`rollout_phase` (generate + score, at the version the samples are pinned to)
then :func:`train_phase` (at the version the trainer holds): asynchronous GRPO
(:mod:`fp8rl.controller.pipeline`) runs the same two on different threads, with the two versions apart.

Batches, seeds and advantages come from the :class:`StepPlan` — pure functions of the job and the step
index — so a step run again (after a restart, by the loop or by the controller) draws the same samples.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fp8rl.data import Problem

from .plan import group_advantages, reward_summary

__all__ = ["PHASES", "StepBackends", "StepPlan", "Trained", "finish", "first_half", "rollout_phase", "run_step",
           "train_phase"]

PHASES = ("rollout", "reward", "logprobs", "train", "publish", "calibrate", "refit")


class StepPlan(Protocol):
    """What a step needs to know of its job (``fp8rl.controller.plan.JobPlan`` is one)."""

    group: int  # G, samples per prompt
    fp8_kv: bool  # whether every version needs calibrated QKV scales
    leave_one_out: bool  # GRPO baseline without the sample itself
    temperature: float  # sampling temperature of the step's rollouts
    max_weight_lag: int  # how many versions a trained sample may be older than the trainer's (0: synchronous)

    def batch(self, step: int) -> list[Problem]: ...

    def prompts(self, problems: Sequence[Problem]) -> list[list[int]]: ...


@dataclass(frozen=True)
class Trained:
    """What the train phase reports: the new version, its metrics, and how long each part took."""

    new_version: int
    metrics: dict[str, float]
    times: dict[str, float] = field(default_factory=dict)  # logprobs, train, publish


class StepBackends(Protocol):
    """The five things a step asks of the engines or services; samples have ``token_ids``, ``logprobs``,
    ``weight_version``."""

    def generate(self, prompts: list[list[int]], version: int, *, step: int, n: int,
                 temperature: float) -> list[tuple[int, Any]]:
        """``n`` samples per prompt at ``version``, prompt-major, as ``(prompt index, sample)``."""

    def score(self, pairs: list[tuple[Problem, Any]]) -> list[float]:
        """One graded reward per ``(problem, sample)``."""

    def train(self, version: int, step: int, rows: list[tuple[list[int], Any, float]], *,
              max_weight_lag: int = 0) -> Trained:
        """Train on ``(prompt ids, sample, advantage)`` rows, expecting the trainer at ``version``; a sample's
        ``weight_version`` may be at most ``max_weight_lag`` older (else the trainer refuses the batch)."""

    def calibrate(self, version: int, sequences: list[list[int]]) -> None:
        """Calibrate and publish the QKV scales of ``version`` on ``sequences`` (prompt + response)."""

    def await_refit(self, version: int) -> dict[str, float]:
        """Until the rollout side holds ``version``; returns metrics of the refit (e.g. replicas fenced)."""


def rollout_phase(plan: StepPlan, b: StepBackends, step: int, version: int,
                  check: Callable[[], None] = lambda: None) -> dict:
    """rollout → reward of step ``step``, every sample pinned to ``version``: ``{"step", "problems", "prompts",
    "samples", "rewards", "phase_times", "started_unix"}`` (held in memory, not saved)."""
    t0, times = time.time(), {}
    check()
    problems = plan.batch(step)
    prompts = plan.prompts(problems)
    t = time.perf_counter()
    samples = b.generate(prompts, version, step=step, n=plan.group, temperature=plan.temperature)
    times["rollout"] = time.perf_counter() - t
    check()
    t = time.perf_counter()
    rewards = b.score([(problems[i], s) for i, s in samples])
    times["reward"] = time.perf_counter() - t
    return {"step": step, "problems": problems, "prompts": prompts, "samples": samples, "rewards": rewards,
            "phase_times": times, "started_unix": t0}


def train_phase(plan: StepPlan, b: StepBackends, rollout: dict, version: int,
                check: Callable[[], None] = lambda: None) -> dict:
    """train on a :func:`rollout_phase` record with the trainer at ``version``. Returns the step's record so
    far: JSON-able, with the step's ``sequences`` for calibration."""
    check()
    step, prompts, samples, rewards = rollout["step"], rollout["prompts"], rollout["samples"], rollout["rewards"]
    adv = group_advantages(rewards, plan.group, plan.leave_one_out)
    trained = b.train(version, step, [(prompts[i], s, a) for (i, s), a in zip(samples, adv, strict=True)],
                      max_weight_lag=plan.max_weight_lag)
    times = {**rollout["phase_times"], **trained.times}
    served = {s.weight_version for _, s in samples}
    return {"step": step, "weight_version": version, "new_version": trained.new_version, **reward_summary(rewards),
            "metrics": {**trained.metrics, "response_len": statistics.fmean(len(s.token_ids) for _, s in samples)},
            "served_version": min(served) if len(served) == 1 else -1, "rollout_version": min(served, default=-1),
            "phase_times": times, "started_unix": rollout["started_unix"],
            "sequences": [prompts[i] + list(s.token_ids) for i, s in samples]}


def first_half(plan: StepPlan, b: StepBackends, step: int, version: int,
               check: Callable[[], None] = lambda: None) -> dict:
    """rollout → reward → train of step ``step`` from ``version`` (:func:`rollout_phase` then
    :func:`train_phase`); ``check`` runs between phases (it may raise to stop)."""
    return train_phase(plan, b, rollout_phase(plan, b, step, version, check), version, check)


def finish(plan: StepPlan, b: StepBackends, partial: dict, check: Callable[[], None] = lambda: None
           ) -> tuple[dict[str, float], dict[str, float]]:
    """calibrate → refit of a trained step's record; returns ``(phase times, refit metrics)``."""
    v1, times = partial["new_version"], dict(partial["phase_times"])
    check()
    t = time.perf_counter()
    if plan.fp8_kv:
        b.calibrate(v1, partial["sequences"])
    # plus what the train phase already spent calibrating v1 (calibration.site trainer: inside TrainStep)
    times["calibrate"] = times.get("calibrate", 0.0) + time.perf_counter() - t
    t = time.perf_counter()
    metrics = b.await_refit(v1)
    times["refit"] = time.perf_counter() - t
    return times, metrics


def run_step(plan: StepPlan, b: StepBackends, step: int, version: int,
             check: Callable[[], None] = lambda: None) -> tuple[dict, dict[str, float], dict[str, float]]:
    """:func:`first_half` then :func:`finish`: ``(record, phase times, refit metrics)``."""
    partial = first_half(plan, b, step, version, check)
    times, metrics = finish(plan, b, partial, check)
    return partial, times, metrics
