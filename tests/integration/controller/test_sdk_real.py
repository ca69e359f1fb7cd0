"""The SDK's main calls against the real controller (a stack started by ``deploy.launcher up``, conftest.py).

tests/unit/sdk/test_client.py drives the same calls against a test double, which also covers what a
double does best (injected outages, server restarts mid-watch, deadlines); here they meet the real
JobService and its runner: a real 1-step job is submitted, watched, listed, got and cancelled, and the
controller's own refusals come back as the SDK's typed errors. Each test stands alone (its own jobs,
unique ids, assertions relative to what it submitted) and leaves no job in flight.
"""

from __future__ import annotations

import uuid

import pytest
import yaml

from fp8rl.config import ConfigError
from fp8rl.rpc import controller_pb2
from fp8rl.sdk import AlreadyExists, Fp8rlClient, Fp8rlError, InvalidArgument, JobInfo, NotFound, PhaseTimes, StepReport

pytestmark = pytest.mark.integration

WATCH_S = 60.0


def _client(stack) -> Fp8rlClient:
    return Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=30)


def _id(what: str) -> str:
    return f"sdk-{what}-{uuid.uuid4().hex[:8]}"


def test_submit_watch_get_list_cancel_a_real_job(stack, tmp_path):
    job_file = tmp_path / "one-step.yaml"
    job_file.write_text(stack.job_yaml(steps=1))
    with _client(stack) as c:
        ran = c.submit_job(job_file, job_id=_id("ran"))  # from a path, validated locally first
        queued = c.submit_job(stack.job_yaml(steps=50), job_id=_id("queued"))  # one job runs at a time
        assert not c.get_job(ran).is_terminal  # so `queued` waits behind it while it is cancelled
        cancelled = c.cancel_job(queued, reason="sdk test")
        assert isinstance(cancelled, JobInfo) and (cancelled.job_id, cancelled.state, cancelled.step,
                                                   cancelled.total_steps) == (queued, "cancelled", 0, 50)

        reports = list(c.watch(ran, timeout_s=WATCH_S))
        assert [(r.job_id, r.step, r.state) for r in reports] == [(ran, 0, "succeeded")]
        r = reports[0]
        assert isinstance(r, StepReport) and isinstance(r.phase_times, PhaseTimes) and r.is_terminal
        assert r.phase_times.total > 0 and 0 <= r.phase_times.calibrate_share <= 1
        assert r.token_mult_prob_error == r.metrics["token_mult_prob_error"] > 0
        assert r.max_abs_logprob_diff == r.metrics["mismatch/max_abs_logprob_diff"] >= 0.0
        assert [x.step for x in c.watch(ran, from_step=0)] == [0]  # a finished job replays its reports
        assert list(c.watch(ran, from_step=1)) == [] and list(c.watch(queued)) == []

        info = c.get_job(ran)
        assert (info.job_id, info.state, info.step, info.total_steps, info.error) == (ran, "succeeded", 1, 1, "")
        assert info.is_terminal and info.created_unix <= info.updated_unix
        listed = [j.job_id for j in c.list_jobs()]
        assert listed.index(queued) < listed.index(ran)  # newest first
        assert [j.job_id for j in c.list_jobs(limit=1)] == [queued]
        assert ran in [j.job_id for j in c.list_jobs(state="succeeded")]
        assert queued not in [j.job_id for j in c.list_jobs(state="succeeded")]
        assert c.cancel_job(ran) == info  # cancelling a finished job leaves it as it is


def test_the_real_controllers_refusals_are_typed_errors(stack):
    with _client(stack) as c:
        for call in (lambda: c.get_job("no-such-job"), lambda: c.cancel_job("no-such-job"),
                     lambda: list(c.watch("no-such-job"))):
            with pytest.raises(NotFound, match="no-such-job") as err:
                call()
            assert err.value.code == "NOT_FOUND"

        taken = c.submit_job(stack.job_yaml(steps=1), job_id=_id("taken"))
        with pytest.raises(AlreadyExists, match=taken):
            c.submit_job(stack.job_yaml(steps=1), job_id=taken)
        assert [r.state for r in c.watch(taken, timeout_s=WATCH_S)] == ["succeeded"]  # leave nothing in flight
        before = c.list_jobs()

        unknown = yaml.safe_load(stack.job_yaml())
        unknown["grpo"]["bogus_key"] = 3
        with pytest.raises(ConfigError, match="grpo.bogus_key"):  # refused locally, before any RPC
            c.submit_job(yaml.safe_dump(unknown))
        bad = controller_pb2.SubmitJobRequest(job_yaml="job: {name: x, stepz: 3}\n")  # past local validation
        with pytest.raises(InvalidArgument, match="job.stepz"):
            c._call("SubmitJob", c._stub.SubmitJob, bad, 30, idempotent=False)
        other = yaml.safe_load(stack.job_yaml())
        other["policy"]["model"] = "tiny-arith"  # valid, but not what the services were started with
        with pytest.raises(Fp8rlError, match="policy.model") as err:
            c.submit_job(yaml.safe_dump(other))
        assert err.value.code == "FAILED_PRECONDITION"
        with pytest.raises(InvalidArgument, match="not one of"):
            c.list_jobs(state="bogus")
        assert c.list_jobs() == before  # none of the refused submissions was enqueued
