"""DAPO's pieces in a step (fp8rl.controller.step): dynamic sampling's refill and its bound, overlong filtering,
reward shaping and advantages without std normalisation, over a scripted backend (a unit double whose rewards
are fixed per prompt, so the kept groups can be named by hand; a real loop job runs them in
tests/e2e/test_loop.py)."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.controller.plan import group_advantages
from fp8rl.controller.step import first_half
from fp8rl.data import Problem
from fp8rl.rl.shaping import overlong_penalty


@dataclass(frozen=True)
class _Sample:
    token_ids: tuple
    logprobs: tuple
    weight_version: int
    finish_reason: str


class _Plan:
    group, fp8_kv, leave_one_out, temperature, max_weight_lag = 2, False, False, 1.0, 0
    normalize_rewards, overlong_filtering = True, False
    total = 10
    dropped_prompts = {"train": 2, "validation": 0}

    def __init__(self, rounds: int, informative: set[str], shaping: bool = False) -> None:
        self.max_gen_rounds, self.informative, self.shaping = rounds, informative, shaping

    def batch(self, index):
        return [Problem(f"p{index}-{i}", "1") for i in range(3)]

    def prompts(self, problems):
        return [[int(p.prompt.split("-")[1]) + 1] for p in problems]

    def shaped_rewards(self, rewards, samples):
        if not self.shaping:
            return list(rewards)
        return [r + overlong_penalty(len(s.token_ids), 4, 2, 1.0) for r, (_, s) in zip(rewards, samples, strict=True)]

    def refill_index(self, step, round_):
        return self.total + step * (self.max_gen_rounds - 1) + round_ - 1

    def refill(self, step, round_):
        return self.batch(self.refill_index(step, round_))


class _Backends:
    """Prompt p's two samples get rewards (1, 0) when p is in ``informative``, else (1, 1); sample j has j + 1
    tokens and sample 1 of every prompt is cut off (finish_reason "length")."""

    def __init__(self, plan: _Plan) -> None:
        self.plan, self.generated, self.trained = plan, [], None

    def generate(self, prompts, version, *, step, n, temperature):
        self.generated.append(step)
        return [(i, _Sample(tuple(range(j + 1)), (0.0,) * (j + 1), version, "length" if j else "stop"))
                for i in range(len(prompts)) for j in range(n)]

    def score(self, pairs):
        return [0.0 if (p.prompt in self.plan.informative and len(s.token_ids) == 2) else 1.0 for p, s in pairs]

    def train(self, version, step, rows, *, max_weight_lag=0):
        from fp8rl.controller.step import Trained

        self.trained = rows
        return Trained(version + 1, {})


def test_dynamic_sampling_refills_until_the_step_has_its_groups() -> None:
    plan = _Plan(rounds=4, informative={"p0-1", "p10-0", "p10-2", "p11-1"})
    b = _Backends(plan)
    rec = first_half(plan, b, 0, 0)
    # round 1: batch 0 keeps p0-1; round 2: batch refill_index(0, 1) = 10 keeps p10-0, p10-2 → 3 groups, done
    assert b.generated == [0, 10]
    assert [r[0] for r in b.trained[::2]] == [[2], [1], [3]]  # prompts of p0-1, p10-0, p10-2
    m = rec["metrics"]
    assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/groups_drawn"], m["dynamic_sampling/groups_kept"],
            m["dynamic_sampling/groups_dropped"], m["dynamic_sampling/filled"]) == (2.0, 6.0, 3.0, 3.0, 1.0)
    assert rec["reward_mean"] == 5 / 6  # the step's own batch (round 1): one 0 of six rewards


def test_dynamic_sampling_stops_at_its_bound_and_trains_on_what_it_kept() -> None:
    plan = _Plan(rounds=2, informative={"p11-2", "p12-0"})
    b = _Backends(plan)
    rec = first_half(plan, b, 1, 0)
    # step 1's batch, then one refill (refill_index(1, 1) = 11; the bound is 2 rounds, so batch 12 is never drawn)
    assert b.generated == [1, 11]
    assert [r[0] for r in b.trained] == [[3], [3]]  # the one group kept: p11-2
    assert rec["metrics"]["dynamic_sampling/filled"] == 0.0 and rec["metrics"]["dynamic_sampling/groups_kept"] == 1
    none_plan = _Plan(rounds=3, informative=set())
    nb = _Backends(none_plan)
    none = first_half(none_plan, nb, 0, 0)
    assert nb.generated == [0, 10, 11] and len(nb.trained) == 6  # nothing kept: the step's own groups, advantage 0
    assert all(a == 0.0 for *_, a in nb.trained) and none["metrics"]["dynamic_sampling/groups_kept"] == 0.0


def test_overlong_filtering_leaves_cut_off_samples_out_after_they_shaped_the_baseline() -> None:
    plan = _Plan(rounds=1, informative={"p0-0"})
    plan.overlong_filtering = True
    b = _Backends(plan)
    rec = first_half(plan, b, 0, 0)
    assert len(b.trained) == 3 and all(len(s.token_ids) == 1 for _, s, _ in b.trained)
    # p0-0's group is (1, 0): its kept sample's advantage is computed with the cut-off one in the group
    assert b.trained[0][2] > 0
    assert rec["metrics"]["overlong/truncated_fraction"] == 0.5
    assert rec["metrics"]["overlong/filtered_samples"] == 3.0


def test_reward_shaping_feeds_the_advantages_but_not_the_reported_accuracy() -> None:
    plan = _Plan(rounds=1, informative=set(), shaping=True)  # every reward 1; sample 1 has 2 tokens of a budget 4
    b = _Backends(plan)
    rec = first_half(plan, b, 0, 0)
    assert rec["reward_mean"] == 1.0 and rec["accuracy"] == 1.0
    # shaped: (1 + 0, 1 + 0) since 2 tokens <= 4 - 2; no penalty, equal rewards: zero advantages
    assert all(a == 0.0 for *_, a in b.trained)


def test_advantages_without_std_normalisation_are_the_plain_differences() -> None:
    r = [1.0, 0.0, 0.0, 0.0]
    assert group_advantages(r, 4, leave_one_out=False, normalize_std=False) == [0.75, -0.25, -0.25, -0.25]
    normed = group_advantages(r, 4, leave_one_out=False, normalize_std=True)
    assert abs(normed[0] - 0.75 / 0.5) < 1e-5  # std of (1, 0, 0, 0), Bessel: 0.5


def test_the_dropped_prompt_counts_ride_in_every_step_record() -> None:
    plan = _Plan(rounds=1, informative=set())
    rec = first_half(plan, _Backends(plan), 0, 0)
    assert rec["metrics"]["data/dropped_prompts/train"] == 2.0
    assert rec["metrics"]["data/dropped_prompts/validation"] == 0.0


def test_dr_grpo_jobs_agree_with_a_deployment_by_their_effective_constant() -> None:
    """seq-mean-token-sum-norm's constant is bound to the deployed trainer by its value, however it was set: unset it
    follows max_new_tokens, so a job is refused exactly when the two constants differ, and the fix it names works."""
    from fp8rl.config import parse_job_config
    from fp8rl.controller.plan import deployment_mismatch

    def job(**extra) -> object:
        gen = {"max_new_tokens": extra.pop("max_new_tokens", 8)}
        return parse_job_config({"policy": {"model": "/m", "generation": gen},
                                 "loss": {"loss_agg_mode": "seq-mean-token-sum-norm", **extra}})

    deployed = job()  # unset: 8, the budget
    assert deployment_mismatch(job(loss_agg_norm_tokens=8, max_new_tokens=16), deployed) is None
    why = deployment_mismatch(job(max_new_tokens=16), deployed)
    assert why and "set loss.loss_agg_norm_tokens: 8" in why
    assert deployment_mismatch(job(loss_agg_norm_tokens=9), deployed) is not None
    plain = parse_job_config({"policy": {"model": "/m", "generation": {"max_new_tokens": 16}}})
    assert deployment_mismatch(plain, parse_job_config({"policy": {"model": "/m"}})) is None  # token-mean: no constant
