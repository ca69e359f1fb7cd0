"""Chaos: a service SIGKILLed mid-job and restarted by its own command line on a *new* port (``--port 0``).

Nobody tells the controller the new address: every service registers a role lease in Redis and the
controller resolves each role there at every call. For each role — rollout replica, calibrator, reward
service, controller — the job must then complete with every step recorded exactly once, on consecutive
weight versions, and the fault must show in the step records (``retries`` and ``phase_times.outage``, or
``replica_fenced`` for the replica whose lease ran out). The killed service is restarted only once the
controller has seen the fault (its log says so), so the recovery path is what is tested, not a race.

Rewards that cannot be graded are never trained on: a job whose grader always fails ends ``failed`` with
the trainer's version unchanged, and a grader that fails each item once is retried and the job succeeds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from fp8rl.rpc import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from fp8rl.rpc.channel import make_channel
from fp8rl.sdk import Fp8rlClient

from .conftest import REPO, tiny_job

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

WATCH_S = 180.0
READY_S = 180.0  # a restarted role imports torch and loads its model on two shared cores
STEPS = 5

TEST_GRADERS = """
import hashlib
import os
from pathlib import Path
from fp8rl.data import register_grader

def broken(response, answer):
    raise RuntimeError("this grader always fails")

def once_flaky(response, answer):  # fails an item the first time it sees it, then grades it by exact match
    seen = Path(os.environ["CHAOS_FLAKY_DIR"]) / hashlib.sha1(f"{response}|{answer}".encode()).hexdigest()
    if not seen.exists():
        seen.touch()
        raise RuntimeError("first look at this item")
    return float(response.strip() == answer.strip())

register_grader("chaos_broken", broken)
register_grader("chaos_once_flaky", once_flaky)
"""


def _client(stack, target: str | None = None) -> Fp8rlClient:
    return Fp8rlClient(target or stack.target, token=stack.client_token, tls_ca="", timeout_s=30)


def _log_size(stack, name: str) -> int:
    return Path(stack.process(name)["log"]).stat().st_size


def _wait_log(stack, name: str, offset: int, needle: str, timeout: float = 90.0) -> None:
    path, deadline = Path(stack.process(name)["log"]), time.monotonic() + timeout
    while needle not in path.read_bytes()[offset:].decode(errors="replace"):
        assert time.monotonic() < deadline, f"{name}'s log never said {needle!r}:\n{path.read_text()[-3000:]}"
        time.sleep(0.1)


def _restart_on_new_port(stack, name: str, *, replica_id: str | None = None, env: dict | None = None) -> int:
    """Start ``name`` again from its recorded command (``--port 0``: a fresh port); record the new pid and port."""
    entry = stack.process(name)
    cmd = list(entry["cmd"])
    assert cmd[cmd.index("--port") + 1] == "0", cmd
    if replica_id is not None:
        cmd[cmd.index("--replica-id") + 1] = replica_id
    ready = Path(cmd[cmd.index("--ready-file") + 1])
    ready.unlink(missing_ok=True)  # a SIGKILLed service leaves its ready file behind
    with open(entry["log"], "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    deadline = time.monotonic() + READY_S
    while not ready.exists():
        assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{Path(entry['log']).read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{name} was not ready in {READY_S} s"
        time.sleep(0.1)
    port = json.loads(ready.read_text())["port"]
    info = stack.info
    rec = next(p for p in info["processes"] if p["name"] == name)
    rec.update(pid=proc.pid, port=port, cmd=cmd)
    if name == "controller":
        info["controller"] = f"127.0.0.1:{port}"
    (stack.run_dir / "stack.json").write_text(json.dumps(info))
    return port


def _kill(stack, name: str) -> int:
    entry = stack.process(name)
    os.kill(entry["pid"], signal.SIGKILL)
    return entry["port"]


def _wait_steps(stack, job_id: str, n: int) -> None:
    jobs, deadline = stack.jobs(), time.monotonic() + WATCH_S
    while jobs.get(job_id).steps_done < n:
        assert time.monotonic() < deadline, f"job {job_id} did not finish {n} steps"
        time.sleep(0.02)


def _finish(stack, job_id: str) -> list:
    with _client(stack) as c:
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        final = c.get_job(job_id)
    assert final.state == "succeeded", final.error
    assert [r.step for r in reports] == list(range(STEPS))  # none lost, none doubled
    base = reports[0].weight_version
    assert [r.weight_version for r in reports] == list(range(base, base + STEPS))
    return reports


def _submit(stack, job_id: str, max_weight_lag: int | None = None, **job) -> str:
    with _client(stack) as c:
        return c.submit_job(stack.job_yaml(max_weight_lag, steps=STEPS, checkpoint_every=0, **job), job_id=job_id)


# The rollout test kills the replica while it reports a Generate in flight; a 4-token Generate can end between
# that report and the SIGKILL (then the controller never meets the fault), so its job generates 40 tokens,
# widening the window tenfold (prompts of <= 16 tokens + 40 fit the test model's 64 positions).
LONG_GENERATE_TOKENS = 40


@pytest.mark.parametrize("role", ["reward", "calibrator"])
def test_a_stateless_role_killed_mid_job_is_found_on_its_new_port_and_the_step_is_retried(stack, role):
    # the calibrator is on every step's path only where it calibrates (calibration.site auto puts a synchronous
    # job's calibration in the trainer)
    job_id = _submit(stack, f"chaos-{role}", calibration_site="calibrator")
    _wait_steps(stack, job_id, 2)
    offset = _log_size(stack, "controller")
    old_port = _kill(stack, role)
    _wait_log(stack, "controller", offset, "retrying the step")  # the controller met the dead service
    assert _restart_on_new_port(stack, role) != old_port
    reports = _finish(stack, job_id)
    retried = [r for r in reports if r.metrics["retries"] > 0]
    assert retried, "no step recorded a retry"
    assert all(r.phase_times.outage > 0 for r in retried)
    assert all(r.phase_times.outage == 0 for r in reports if r.metrics["retries"] == 0)
    assert max(r.metrics["retries"] for r in reports) < 5  # the budget is per step: none ran out


@pytest.mark.parametrize("max_weight_lag", [None, 1], ids=["sync", "async-k1"])
def test_a_rollout_replica_killed_mid_generate_is_suspect_its_work_goes_to_its_successor_and_its_lease_fences(
        stack, max_weight_lag):
    job_id = _submit(stack, f"chaos-rollout-{max_weight_lag}", max_weight_lag, max_new_tokens=LONG_GENERATE_TOKENS)
    _wait_steps(stack, job_id, 2)
    (old_id,) = stack.refit().live_replicas("rollout")
    target = f"127.0.0.1:{stack.process('rollout-0')['port']}"
    with make_channel(target, token=stack.service_token, tls_ca="") as ch:
        status = rollout_pb2_grpc.RolloutServiceStub(ch).Status
        deadline = time.monotonic() + WATCH_S
        while status(rollout_pb2.RolloutStatusRequest(), timeout=10).generating < 1:  # mid-Generate
            assert time.monotonic() < deadline
            time.sleep(0.005)
    offset = _log_size(stack, "controller")
    old_port = _kill(stack, "rollout-0")
    _wait_log(stack, "controller", offset, "(this one is suspect)")
    # a new replica id: the dead one's lease is not replaced, it runs out (and is fenced) on its own
    new_id = f"rollout-restarted-{max_weight_lag}"
    assert _restart_on_new_port(stack, "rollout-0", replica_id=new_id) != old_port
    reports = _finish(stack, job_id)
    assert sum(r.metrics["replica_fenced"] for r in reports) >= 1  # the dead lease expired during the job
    fenced = [e for e in stack.refit().events() if e.type == "replica_fenced" and e.replica == old_id]
    assert [e.reason for e in fenced] == ["lease_expired"]
    assert set(stack.refit().live_replicas("rollout")) == {new_id}
    if max_weight_lag is not None:  # the bound held through the fault
        assert max(r.metrics["weight_lag_max"] for r in reports) <= max_weight_lag


def test_the_controller_killed_mid_job_comes_back_on_a_new_port_and_resumes(stack):
    job_id = _submit(stack, "chaos-controller")
    _wait_steps(stack, job_id, 2)
    old_port = _kill(stack, "controller")
    new_port = _restart_on_new_port(stack, "controller")
    assert new_port != old_port and stack.target.endswith(f":{new_port}")
    _finish(stack, job_id)


def _trainer_version(stack) -> int:
    target = f"127.0.0.1:{stack.process('trainer')['port']}"
    with make_channel(target, token=stack.service_token, tls_ca="") as ch:
        return trainer_pb2_grpc.TrainerServiceStub(ch).Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version


def test_ungraded_rewards_are_retried_and_never_trained_on(stack, tmp_path):
    """The reward service restarted with two test graders: one fails every item (the job fails at step 0,
    nothing trained), one fails each item once (scored again, the job succeeds)."""
    (tmp_path / "chaos_graders.py").write_text(TEST_GRADERS)
    (tmp_path / "flaky").mkdir()
    _kill(stack, "reward")
    entry = stack.process("reward")
    info = stack.info
    next(p for p in info["processes"] if p["name"] == "reward")["cmd"] = [*entry["cmd"], "--grader-module",
                                                                          "chaos_graders"]
    (stack.run_dir / "stack.json").write_text(json.dumps(info))
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    _restart_on_new_port(stack, "reward", env={"PYTHONPATH": path, "CHAOS_FLAKY_DIR": str(tmp_path / "flaky")})
    before = _trainer_version(stack)
    with _client(stack) as c:
        doc = tiny_job(stack.model_dir, steps=2, checkpoint_every=0)
        job_id = c.submit_job(yaml.safe_dump({**doc, "reward": {"grader": "chaos_broken"}}), job_id="ungraded")
        for _ in c.watch(job_id, timeout_s=WATCH_S):
            pass
        final = c.get_job(job_id)
        assert final.state == "failed" and "could not be graded in 3 tries" in final.error, final.error
        assert "always fails" in final.error
        assert _trainer_version(stack) == before  # no TrainStep ran on a placeholder reward

        job_id = c.submit_job(yaml.safe_dump({**doc, "reward": {"grader": "chaos_once_flaky"}}), job_id="flaky")
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        final = c.get_job(job_id)
    assert final.state == "succeeded", final.error
    assert [r.step for r in reports] == [0, 1] and _trainer_version(stack) == before + 2
