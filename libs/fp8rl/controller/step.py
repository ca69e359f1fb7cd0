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
from fp8rl.rl.shaping import truncated

from .pictures import step_pictures
from .plan import graded_advantages, reward_summary

__all__ = ["PHASES", "StepBackends", "StepPlan", "Trained", "finish", "first_half", "generate_phase", "rollout_phase",
           "run_step", "score_phase", "train_phase"]

PHASES = ("rollout", "reward", "logprobs", "train", "publish", "calibrate", "refit")


class StepPlan(Protocol):
    """What a step needs to know of its job (``fp8rl.controller.plan.JobPlan`` is one)."""

    group: int  # G, samples per prompt
    fp8_kv: bool  # whether every version needs calibrated QKV scales
    leave_one_out: bool  # GRPO baseline without the sample itself
    normalize_rewards: bool  # advantages divided by the group's reward std
    temperature: float  # sampling temperature of the step's rollouts
    max_weight_lag: int  # how many versions a trained sample may be older than the trainer's (0: synchronous)
    max_gen_rounds: int  # dynamic sampling: most generation rounds per step (1: off)
    overlong_filtering: bool  # truncated responses left out of the loss
    dropped_prompts: dict[str, int]  # problems data.max_prompt_tokens dropped: {"train": n, "validation": m}

    def batch(self, step: int) -> list[Problem]: ...

    def prompts(self, problems: Sequence[Problem]) -> list[list[int]]: ...

    def shaped_rewards(self, rewards: Sequence[float], samples: Sequence) -> list[float]: ...

    def refill(self, step: int, round_: int) -> list[Problem]: ...

    def refill_index(self, step: int, round_: int) -> int: ...


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

    def calibrate(self, version: int, sequences: list[list[int]], *, pictures: dict | None = None) -> None:
        """Calibrate and publish the QKV scales of ``version`` on ``sequences`` (prompt + response); ``pictures``: a
        vision-language step's, per sequence (:func:`fp8rl.controller.pictures.step_pictures`; passed only when
        the step has pictures)."""

    def await_refit(self, version: int) -> dict[str, float]:
        """Until the rollout side holds ``version``; returns metrics of the refit (e.g. replicas fenced)."""


def _generate_round(plan: StepPlan, b: StepBackends, problems: list[Problem], index: int, version: int, times: dict,
                    check: Callable[[], None]) -> tuple[list[Problem], list[list[int]], list]:
    """Generate ``problems`` (a step's own batch, or a dynamic-sampling refill) at ``version``, seeded as step
    ``index``: ``(problems, prompts, samples)``; the time spent is added to ``times``."""
    check()
    # multi-turn on the stack: the openings come from the environment workers (no environment code here)
    prompts = b.prompts_of(problems) if hasattr(b, "prompts_of") else plan.prompts(problems)
    t = time.perf_counter()
    more = {"problems": problems} if getattr(b, "wants_problems", False) else {}  # multi-turn: the tasks
    samples = b.generate(prompts, version, step=index, n=plan.group, temperature=plan.temperature, **more)
    times["rollout"] = times.get("rollout", 0.0) + time.perf_counter() - t
    return problems, prompts, samples


def _score_round(b: StepBackends, problems: list[Problem], samples: list, times: dict,
                 check: Callable[[], None]) -> tuple[list[float], dict[str, float]]:
    """Grade a round's samples: ``(rewards, the backend's reward/* metrics of them)``; the time spent is added to
    ``times``."""
    check()
    t = time.perf_counter()
    rewards = b.score([(problems[i], s) for i, s in samples])
    # a reward model's reward/* (its score distribution, unscored samples, judge tokens), read at once: the
    # asynchronous pipeline scores on a thread of its own
    metrics = dict(getattr(b, "reward_metrics", None) or {})
    times["reward"] = times.get("reward", 0.0) + time.perf_counter() - t
    return rewards, metrics


def _sample_round(plan: StepPlan, b: StepBackends, problems: list[Problem], index: int, version: int, times: dict,
                  check: Callable[[], None]) -> tuple[list[Problem], list[list[int]], list, list[float]]:
    """Generate and grade a round: ``(problems, prompts, samples, rewards)``."""
    problems, prompts, samples = _generate_round(plan, b, problems, index, version, times, check)
    return problems, prompts, samples, _score_round(b, problems, samples, times, check)[0]


def generate_phase(plan: StepPlan, b: StepBackends, step: int, version: int,
                   check: Callable[[], None] = lambda: None) -> dict:
    """The first half of :func:`rollout_phase` without dynamic sampling: step ``step``'s samples at ``version``,
    not yet graded (``{"step", "problems", "prompts", "samples", "phase_times", "started_unix"}``);
    :func:`score_phase` grades them. Asynchronous GRPO runs the two on different threads, so a step is graded
    while the next one generates."""
    if plan.max_gen_rounds > 1:
        raise ValueError("dynamic sampling grades each round before it draws the next: use rollout_phase")
    return _first_round(plan, b, step, version, check)


def _first_round(plan: StepPlan, b: StepBackends, step: int, version: int, check: Callable[[], None]) -> dict:
    t0, times = time.time(), {}
    problems, prompts, samples = _generate_round(plan, b, plan.batch(step), step, version, times, check)
    return {"step": step, "problems": problems, "prompts": prompts, "samples": samples, "phase_times": times,
            "started_unix": t0}


def score_phase(plan: StepPlan, b: StepBackends, generated: dict, check: Callable[[], None] = lambda: None) -> dict:
    """The second half: a :func:`generate_phase` record graded, as :func:`rollout_phase` returns it."""
    times = dict(generated["phase_times"])
    rewards, stats = _score_round(b, generated["problems"], generated["samples"], times, check)
    return _graded(plan, generated, rewards, stats, times)


def _graded(plan: StepPlan, generated: dict, rewards: list, stats: dict, times: dict) -> dict:
    samples = generated["samples"]
    if samples and hasattr(samples[0][1], "end_reason"):  # multi-turn trajectories: turns, tools, env time
        from fp8rl.envs.trajectory import trajectory_metrics

        stats.update(trajectory_metrics([s for _, s in samples], times.get("rollout")))
    return {**generated, "rewards": rewards, "shaped": plan.shaped_rewards(rewards, samples),
            "summary": reward_summary(rewards), "stats": stats, "phase_times": times}


def rollout_phase(plan: StepPlan, b: StepBackends, step: int, version: int,
                  check: Callable[[], None] = lambda: None) -> dict:
    """rollout → reward of step ``step``, every sample pinned to ``version``: ``{"step", "problems", "prompts",
    "samples", "rewards", "shaped", "summary", "stats", "phase_times", "started_unix"}`` (held in memory, not
    saved).

    ``rewards`` are the graded rewards, ``shaped`` the ones advantages are computed from (plus DAPO's overlong
    penalty when the job shapes rewards). With dynamic sampling (``plan.max_gen_rounds > 1``) groups whose shaped
    rewards are all equal are dropped and refill batches (:meth:`StepPlan.refill_index`) drawn, round by round,
    until the step's number of groups is kept or the rounds run out; the record then holds the kept groups only
    (the first ones, in draw order; all of the first round's when none was kept, so the step still trains, on zero
    advantages). ``summary`` (reward_mean, accuracy) is over the step's own batch, the first round.
    """
    if plan.max_gen_rounds == 1:
        return score_phase(plan, b, generate_phase(plan, b, step, version, check), check)
    first = _first_round(plan, b, step, version, check)
    times = first["phase_times"]
    rewards, stats = _score_round(b, first["problems"], first["samples"], times, check)
    ro = _graded(plan, first, rewards, stats, times)  # the step's own batch: summary and stats are of it
    problems, prompts, samples, shaped = ro["problems"], ro["prompts"], ro["samples"], ro["shaped"]
    want, g = len(problems), plan.group
    rounds = [(problems, prompts, samples, rewards, shaped)]
    kept = _informative_groups(shaped, g)
    drawn = len(problems)
    while len(kept) < want and len(rounds) < plan.max_gen_rounds:
        r = len(rounds)
        more = _sample_round(plan, b, plan.refill(step, r), plan.refill_index(step, r), version, times, check)
        rounds.append((*more, plan.shaped_rewards(more[3], more[2])))
        kept += [drawn + k for k in _informative_groups(rounds[-1][4], g)]
        drawn += len(more[0])
    chosen = kept[:want] or list(range(len(problems)))
    flat = [tuple(x for r in rounds for x in r[j]) for j in range(5)]  # problems, prompts, samples, ... of all
    # drawn = kept + dropped (all-equal rewards) + surplus (informative, past the step's quota)
    ro["stats"].update({"dynamic_sampling/rounds": float(len(rounds)), "dynamic_sampling/groups_drawn": float(drawn),
                        "dynamic_sampling/groups_kept": float(len(kept[:want])),
                        "dynamic_sampling/groups_dropped": float(drawn - len(kept)),
                        "dynamic_sampling/groups_surplus": float(len(kept) - len(kept[:want])),
                        "dynamic_sampling/filled": float(len(kept) >= want)})
    return {**ro, "problems": [flat[0][k] for k in chosen], "prompts": [flat[1][k] for k in chosen],
            "samples": [(new, flat[2][k * g + j][1]) for new, k in enumerate(chosen) for j in range(g)],
            "rewards": [flat[3][k * g + j] for k in chosen for j in range(g)],
            "shaped": [flat[4][k * g + j] for k in chosen for j in range(g)], "phase_times": times}


def _informative_groups(shaped: Sequence[float], group: int) -> list[int]:
    """Indices of the groups (``group`` consecutive rewards each) whose rewards are not all equal."""
    return [k for k in range(len(shaped) // group) if len(set(shaped[k * group:(k + 1) * group])) > 1]


def train_phase(plan: StepPlan, b: StepBackends, rollout: dict, version: int,
                check: Callable[[], None] = lambda: None) -> dict:
    """train on a :func:`rollout_phase` record with the trainer at ``version``. Returns the step's record so
    far: JSON-able, with the step's ``sequences`` for calibration."""
    check()
    step, prompts, samples = rollout["step"], rollout["prompts"], rollout["samples"]
    shaped = rollout.get("shaped", rollout["rewards"])
    adv = graded_advantages(shaped, plan.group, plan.leave_one_out, plan.normalize_rewards)
    # ungraded samples (an environment failed: reward None) are left out of the loss
    rows = [(_prompt(prompts, i, s), s, a) for (i, s), a in zip(samples, adv, strict=True) if a is not None]
    if not rows:  # every sample ungraded: the step still makes its version, on zero advantages (no policy gradient)
        rows = [(_prompt(prompts, i, s), s, 0.0) for i, s in samples]
    stats = dict(rollout.get("stats", {}))
    stats.update({f"data/dropped_prompts/{split}": float(n) for split, n in plan.dropped_prompts.items()})
    cut = [truncated(s.finish_reason) for _, s, _ in rows]
    stats["overlong/truncated_fraction"] = sum(cut) / len(cut) if cut else 0.0
    if plan.overlong_filtering:  # out of the loss, after their rewards shaped their groups' baselines
        kept = [r for r, c in zip(rows, cut, strict=True) if not c]
        stats["overlong/filtered_samples"] = float(len(rows) - len(kept))
        # every response cut off: train on all of them with zero advantage (no policy gradient; the step still
        # makes its version)
        rows = kept or [(p, s, 0.0) for p, s, _ in rows]
    trained = b.train(version, step, rows, max_weight_lag=plan.max_weight_lag)
    times = {**rollout["phase_times"], **trained.times}
    if "env/seconds" in stats:  # multi-turn: the environment's share of the step (rollout, reward, train phases)
        stats["env/share_of_step"] = stats["env/seconds"] / max(sum(times.values()), 1e-9)
    served = {s.weight_version for _, s in samples}
    summary = rollout.get("summary") or reward_summary(rollout["rewards"])
    return {"step": step, "weight_version": version, "new_version": trained.new_version, **summary,
            "metrics": {**trained.metrics, **stats,
                        "response_len": statistics.fmean(len(s.token_ids) for _, s in samples)},
            "served_version": min(served) if len(served) == 1 else -1, "rollout_version": min(served, default=-1),
            "phase_times": times, "started_unix": rollout["started_unix"],
            "sequences": [_prompt(prompts, i, s) + list(s.token_ids) for i, s in samples],
            **({"pictures": pictures} if (pictures := step_pictures(rollout["problems"], samples)) else {})}


def calibration_pictures(partial: dict) -> dict:
    """The ``pictures`` keyword of a step's ``calibrate`` call: the record's, when the step has pictures."""
    return {"pictures": partial["pictures"]} if partial.get("pictures") else {}


def _prompt(prompts: Sequence[Sequence[int]], i: int, sample: Any) -> list[int]:
    """The prompt a sample continues: a trajectory's own opening (each trajectory reset its environment), else its
    task's prompt."""
    return list(sample.prompt_ids) if hasattr(sample, "end_reason") else list(prompts[i])


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
        b.calibrate(v1, partial["sequences"], **calibration_pictures(partial))
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
