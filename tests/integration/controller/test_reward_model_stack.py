"""A 3-step job rewarded by a judge on a launched stack with two reward replicas (issue 52; ``make test-rewards``).

The judge is the tiny-arith preset (FP8 linears, its verdict probability the score, and beside it the same judge in
bf16 for the agreement metric), served by both reward services;
the controller sends each chunk of a step's items (``reward.model.max_batch`` of them) to the replica with the
fewest in flight — after step 0 both have answered ScoreModel calls (their Prometheus counters). Then one replica is
killed (SIGKILL, its lease still live for up to its TTL): the items sent to it are scored again on the other, and the
job finishes with every step's samples scored — at least half of each step's, or the test fails.
"""

from __future__ import annotations

import os
import signal

import pytest
import yaml

from fp8rl.metrics import scrape

from .conftest import Stack, down, launcher, tiny_job, tiny_model

pytestmark = pytest.mark.rewards

STEPS, SAMPLES = 3, 4 * 2  # tiny_job: 4 prompts x 2 samples


def _score_model_calls(port: int) -> float:
    return sum(v for (name, labels), v in scrape(port).items() if name == "fp8rl_rpc_requests_total"
               and dict(labels).get("method", "").endswith("ScoreModel") and dict(labels).get("code") == "OK")


def test_a_judge_rewards_a_stack_job_across_two_replicas_and_survives_one_killed(tmp_path):
    from fp8rl.sdk import Fp8rlClient

    model_dir = tiny_model(tmp_path / "model")
    job = tiny_job(model_dir, steps=STEPS)
    job["reward"] = {"model": {"kind": "judge", "model": "tiny-arith", "precision": "fp8", "max_batch": 4,
                               "agreement": True,
                               "template": "{question}{response}=", "parse": "verdict_prob",
                               "verdicts": {"1": 1.0, "0": 0.0}}}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    up = launcher("up", "--job", str(job_file), "--run-dir", str(run_dir), "--ready-timeout", "180",
                  "--reward-replicas", "2", "--metrics")
    assert up.returncode == 0, up.stderr[-4000:]
    stack = Stack(run_dir, job_file, model_dir)
    try:
        reports = []
        with Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=30) as c:
            job_id = c.submit_job(job_file)
            for r in c.watch(job_id, timeout_s=600):
                reports.append(r)
                if r.step == 0:  # both replicas judged step 0; then one dies
                    calls = [_score_model_calls(stack.process(n)["metrics_port"]) for n in ("reward", "reward-1")]
                    assert all(k >= 1 for k in calls), calls
                    os.kill(stack.process("reward-1")["pid"], signal.SIGKILL)
            info = c.get_job(job_id)
        assert (info.state, info.error) == ("succeeded", ""), info.error
        assert [r.step for r in reports] == list(range(STEPS))
        for r in reports:
            m = r.metrics
            assert m["reward/model_scored"] >= SAMPLES / 2, (r.step, m)  # at least half of each step's judged
            assert m["reward/model_scored"] + m["reward/model_unscored"] == SAMPLES  # no gate: every sample asked
            assert 0.0 <= m["reward/model_mean"] <= 1.0 and m["reward/model_seconds"] > 0
            # the FP8 judge against itself in bf16 (agreement: on), carried back with each score
            assert 0.0 <= m["reward/model_agreement"] <= 1.0 and 0.0 <= m["reward/model_abs_diff_mean"] < 0.5
        # the same stack serves a job whose judge is the policy itself (follow_policy: the judge prompts go to the
        # rollout replica, at the version it holds; the random tiny policy writes no \\boxed{}: every sample is
        # unscored and counted, the step trains on none of them and still makes its version)
        follow = {**job, "job": {**job["job"], "steps": 1, "name": "follow"},
                  "reward": {"model": {"kind": "judge", "follow_policy": True, "template": "{question}{response}",
                                       "max_new_tokens": 4}}}
        (tmp_path / "follow.yaml").write_text(yaml.safe_dump(follow))
        with Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=30) as c:
            job_id = c.submit_job(tmp_path / "follow.yaml")
            followed = list(c.watch(job_id, timeout_s=300))
            info = c.get_job(job_id)
        assert (info.state, info.error) == ("succeeded", ""), info.error
        m = followed[0].metrics
        assert (m["reward/model_scored"], m["reward/model_unscored"]) == (0.0, SAMPLES)
        assert m["reward/judge_tokens"] >= SAMPLES and m["reward/judge_unparsable_samples"] >= SAMPLES
        # while the killed replica's lease outlives it (up to its TTL), a call to it fails over to the live one and
        # it is passed over for the rest of that step: at most that one replica is counted, never before the kill
        assert [r.metrics["reward/replicas_failed"] <= (r.step > 0) for r in reports] == [True] * STEPS
    finally:
        down(stack)
