"""JobService end to end: a stack started by ``deploy.launcher up``, driven with the SDK, stopped by ``down``.

A 2-step job on a pristine stack (the trainer at v0, so its numbers must equal the in-process loop's),
rejected submissions, a cancelled job, a controller / Redis / trainer killed mid-job and restarted, and
``down``. Each test stands alone, in any order: it asks for the stack it needs (``stack`` or
``pristine_stack``, see conftest.py), checks versions relative to where its own job started, and
compares job lists with what it read before rather than with what earlier tests left.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import redis
import yaml

from fp8rl.config import ConfigError
from fp8rl.controller.jobstore import JobStore
from fp8rl.loop import LoopConfig, run
from fp8rl.metrics import scrape
from fp8rl.refit import RefitStore, connect
from fp8rl.rl.metrics import mismatch_promise
from fp8rl.rpc import controller_pb2, controller_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from fp8rl.rpc.channel import make_channel
from fp8rl.sdk import Fp8rlClient

from .conftest import REPO, alive, launcher, tiny_job, tiny_model

pytestmark = pytest.mark.integration

WATCH_S = 60.0


def _client(stack) -> Fp8rlClient:
    return Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=30)


def _submit_raw(stack, job_yaml: str) -> tuple[grpc.StatusCode, str]:
    stub = controller_pb2_grpc.JobServiceStub(make_channel(stack.target, token=stack.client_token, tls_ca=""))
    with pytest.raises(grpc.RpcError) as ei:
        stub.SubmitJob(controller_pb2.SubmitJobRequest(job_yaml=job_yaml), timeout=30)
    return ei.value.code(), ei.value.details()


def test_two_step_job_end_to_end_matches_the_in_process_loop(pristine_stack):
    stack = pristine_stack
    with _client(stack) as c:
        job_id = c.submit_job(stack.job_file)
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        info = c.get_job(job_id)
        assert [j.job_id for j in c.list_jobs()] == [job_id]
    assert (info.state, info.step, info.total_steps, info.error) == ("succeeded", 2, 2, "")
    assert [(r.step, r.weight_version, r.state) for r in reports] == [(0, 0, "running"), (1, 1, "succeeded")]
    for r in reports:
        print(f"step {r.step}: token_mult_prob_error {r.token_mult_prob_error:.5f}")
        assert 1.0 <= r.token_mult_prob_error <= mismatch_promise("fp8_e2e", "fp8", over="step")
        assert {"gen_kl_k3", "train/loss", "refit/fenced"} <= set(r.metrics)
        pt = r.phase_times
        assert min(pt.rollout, pt.reward, pt.train, pt.publish, pt.calibrate, pt.refit) > 0
        # one update per step on one trainer process: the train pass's forwards give the prev logprobs, no pass of
        # their own (fp8rl.engines.batch.train_on_batch)
        assert pt.logprobs == 0.0
        assert pt.total >= pt.rollout + pt.train + pt.calibrate
    assert sorted(p.name for p in (stack.run_dir / "checkpoints").iterdir()) == ["trainer-v000001.pt",
                                                                                "trainer-v000002.pt"]

    # The controller runs exactly the in-process loop's phases, data and seeds: same numbers.
    loop = run(LoopConfig.from_flags(model=str(stack.model_dir), recipe="fp8_e2e", kv_cache_dtype="fp8", steps=2,
                          prompts_per_step=4, group_size=2, max_tokens=4, lr=0.01, micro_batch_size=8,
                          calibration_max_sequences=4, eval_size=2, seed=0), progress=False)["steps"]
    for r, h in zip(reports, loop, strict=True):
        assert r.reward_mean == pytest.approx(h["reward_mean"])
        assert r.metrics["response_len"] == pytest.approx(h["response_len"])
        assert r.token_mult_prob_error == pytest.approx(h["token_mult_prob_error"], rel=1e-4)


def test_every_service_serves_prometheus_metrics_and_the_series_move_during_a_job(stack):
    """Scrape each process's /metrics (the launcher gave each --metrics-port 0) before and after a 1-step job
    and one refused submission: the counters each role owns moved by what the job did, nothing went down."""
    ports = {p["role"]: p["metrics_port"] for p in stack.info["processes"] if p["role"] != "redis"}
    assert set(ports) == {"trainer", "calibrator", "rollout", "reward", "controller"} and all(ports.values()), ports
    before = {role: scrape(port) for role, port in ports.items()}
    with _client(stack) as c:
        job_id = c.submit_job(stack.job_yaml(steps=1))
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        assert c.get_job(job_id).state == "succeeded"
    assert _submit_raw(stack, stack.job_yaml(bogus_key=1))[0] == grpc.StatusCode.INVALID_ARGUMENT
    after = {role: scrape(port) for role, port in ports.items()}

    def moved(role: str, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[role].get(key, 0.0) - before[role].get(key, 0.0)

    ctl = after["controller"]
    assert moved("controller", "fp8rl_steps_total") == 1 and ctl[("fp8rl_step", ())] == 0
    r = reports[0]
    assert ctl[("fp8rl_reward_mean", ())] == pytest.approx(r.reward_mean)
    assert ctl[("fp8rl_token_mult_prob_error", ())] == pytest.approx(r.token_mult_prob_error)
    assert ctl[("fp8rl_last_step_phase_seconds", (("phase", "rollout"),))] == pytest.approx(r.phase_times.rollout)
    assert moved("controller", "fp8rl_step_phase_seconds_total", phase="train") == pytest.approx(r.phase_times.train)
    assert ctl[("fp8rl_tokens_per_second", ())] > 0
    assert moved("controller", "fp8rl_rpc_requests_total", method="JobService/SubmitJob", code="OK") == 1
    assert moved("controller", "fp8rl_rpc_requests_total", method="JobService/SubmitJob", code="INVALID_ARGUMENT") == 1
    assert moved("trainer", "fp8rl_train_steps_total") == 1
    assert moved("trainer", "fp8rl_refits_total", direction="publish") == 1
    assert moved("trainer", "fp8rl_refit_bytes_total", direction="publish") > 0
    assert moved("trainer", "fp8rl_rpc_requests_total", method="TrainerService/TrainStep", code="OK") == 1
    new_version = after["trainer"][("fp8rl_weight_version", ())]
    assert new_version == before["trainer"][("fp8rl_weight_version", ())] + 1
    assert moved("rollout", "fp8rl_generated_tokens_total") > 0 and moved("rollout", "fp8rl_generate_seconds_total") > 0
    assert after["rollout"][("fp8rl_weight_version", ())] == new_version
    # one apply per version it moved through (-1 = none yet: on a fresh stack the job's v0 is applied too)
    assert moved("rollout", "fp8rl_refits_total", direction="apply") == moved("rollout", "fp8rl_weight_version") >= 1
    assert moved("reward", "fp8rl_graded_total") > 0
    # v1's scales: computed by the trainer right after its optimizer step (calibration.site auto -> trainer)
    assert moved("trainer", "fp8rl_calibrations_total") == 1
    assert moved("controller", "fp8rl_rpc_seconds_count", method="JobService/SubmitJob") == 2  # both are timed
    for role in set(ports) - {"calibrator"}:  # and every role answered RPCs during the job (not the calibrator: the
        # trainer calibrated v1, and v0's scales were there from the stack's earlier jobs)
        assert sum(v for (n, _), v in after[role].items() if n == "fp8rl_rpc_seconds_count") > \
            sum(v for (n, _), v in before[role].items() if n == "fp8rl_rpc_seconds_count"), role


def test_unknown_key_is_invalid_argument_naming_it(stack):
    job = yaml.safe_load(stack.job_yaml())
    job["grpo"]["bogus_key"] = 3
    code, details = _submit_raw(stack, yaml.safe_dump(job))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "grpo.bogus_key" in details
    code, details = _submit_raw(stack, "job: [unclosed")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "YAML" in details
    with _client(stack) as c, pytest.raises(ConfigError, match="grpo.bogus_key"):  # the SDK refuses before any RPC
        c.submit_job(yaml.safe_dump(job))


def test_job_for_another_model_or_recipe_is_failed_precondition(stack):
    job = yaml.safe_load(stack.job_yaml())
    job["policy"]["model"] = "tiny-arith"
    with _client(stack) as c:
        before = c.list_jobs()
    code, details = _submit_raw(stack, yaml.safe_dump(job))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "policy.model" in details
    job = yaml.safe_load(stack.job_yaml())
    job["policy"]["training"]["megatron_cfg"]["fp8_cfg"]["enabled"] = False
    code, details = _submit_raw(stack, yaml.safe_dump(job))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "fp8_gen_only" in details and "fp8_e2e" in details
    with _client(stack) as c:
        assert c.list_jobs() == before  # nothing was enqueued


def test_cancel_stops_a_running_job(stack):
    with _client(stack) as c:
        job_id = c.submit_job(stack.job_yaml(steps=500), job_id="to-cancel")
        seen = []
        for r in c.watch(job_id, timeout_s=WATCH_S):
            seen.append(r.step)
            if len(seen) == 1:
                info = c.cancel_job(job_id, "test")
                assert info.state == "cancelled" and info.step < 500
        final = c.get_job(job_id)
        assert (final.state, final.step) == ("cancelled", len(seen)) and final.step < 500
        assert c.cancel_job(job_id).state == "cancelled"  # cancelling a terminal job is a no-op
        cancelled = c.list_jobs(state="cancelled")
        assert job_id in [j.job_id for j in cancelled] and all(j.state == "cancelled" for j in cancelled)
        # and it stays stopped: the runner takes jobs one at a time, so once a later job has run to the end it
        # has left the cancelled one for good
        after = c.submit_job(stack.job_yaml(steps=1), job_id="after-cancel")
        assert [r.step for r in c.watch(after, timeout_s=WATCH_S)] == [0]
        assert c.get_job(after).state == "succeeded"
        assert (c.get_job(job_id).state, c.get_job(job_id).step) == ("cancelled", final.step)


def _trainer(stack):
    target = f"127.0.0.1:{stack.process('trainer')['port']}"
    return trainer_pb2_grpc.TrainerServiceStub(make_channel(target, token=stack.service_token, tls_ca=""))


def _restart_controller(stack, ctl: dict) -> None:
    cmd = list(ctl["cmd"])
    cmd[cmd.index("--port") + 1] = str(ctl["port"])  # same address: clients keep their target
    with open(ctl["log"], "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    info = stack.info
    next(p for p in info["processes"] if p["name"] == "controller")["pid"] = proc.pid  # so that `down` stops it
    (stack.run_dir / "stack.json").write_text(json.dumps(info))


def _kill_with_step_half_done(stack, job_id: str, base: int, *, save_inflight: bool) -> tuple[int, bool]:
    """SIGKILL the controller; if the step in flight had not reached TrainStep yet, train it by hand so the
    trainer is one version ahead of the finished steps — with the step's data saved (``save_inflight``)
    as the controller does right after TrainStep, or lost. Returns (finished steps, whether forced)."""
    os.kill(stack.process("controller")["pid"], signal.SIGKILL)
    time.sleep(0.3)
    jobs = JobStore(redis.Redis.from_url(stack.redis_url))
    done, trainer = jobs.get(job_id).steps_done, _trainer(stack)
    held = trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version
    assert held in (base + done, base + done + 1)
    if held == base + done + 1:
        return done, False
    rows = [trainer_pb2.Sequence(prompt_ids=[1, 40, 41], response_ids=[42, 2], gen_logprobs=[-1.0, -1.0],
                                 advantage=a) for a in (0.5, -0.5)]
    try:
        new = trainer.TrainStep(trainer_pb2.TrainStepRequest(expected_version=held, rows=rows), timeout=30).new_version
    except grpc.RpcError as err:
        # the killed controller's own TrainStep was still running on the trainer and applied first: the step is
        # trained with its data lost, as when it had landed before the kill
        if err.code() == grpc.StatusCode.FAILED_PRECONDITION and \
                trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version == held + 1:
            return done, False
        raise
    assert new == held + 1
    jobs.set_inflight(job_id, {"step": done, "weight_version": held, "new_version": held + 1, "reward_mean": 0.25,
                               "accuracy": 0.5, "metrics": {"marker": 7.0}, "phase_times": {"rollout": 0.1},
                               "started_unix": time.time(), "sequences": [[1, 40, 41, 42, 2]]}
                      if save_inflight else None)
    return done, True


def _wait_steps(stack, job_id: str, n: int, timeout: float = WATCH_S) -> None:
    jobs, deadline = JobStore(redis.Redis.from_url(stack.redis_url)), time.monotonic() + timeout
    while jobs.get(job_id).steps_done < n:
        assert time.monotonic() < deadline, f"job {job_id} did not finish {n} steps in {timeout} s"
        time.sleep(0.02)


def test_controller_killed_mid_job_resumes_and_finishes_the_half_done_step(stack):
    steps = 10
    with _client(stack) as c:
        job_id = c.submit_job(stack.job_yaml(steps=steps, checkpoint_every=0), job_id="resumed")
        base = next(iter(c.watch(job_id, timeout_s=WATCH_S))).weight_version  # step 0 done, step 1 in flight
        lost, forced_lost = _kill_with_step_half_done(stack, job_id, base, save_inflight=False)
        _restart_controller(stack, stack.process("controller"))
        _wait_steps(stack, job_id, lost + 2)  # straight from Redis: the SDK's reconnect backoff is slower
        saved, forced_saved = _kill_with_step_half_done(stack, job_id, base, save_inflight=True)
        assert saved < steps
        _restart_controller(stack, stack.process("controller"))
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        final = c.get_job(job_id)
    assert final.state == "succeeded", final.error
    assert [r.step for r in reports] == list(range(steps))
    assert [r.weight_version for r in reports] == list(range(base, base + steps))  # none skipped or repeated
    assert _trainer(stack).Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version == base + steps
    by_step = {r.step: r for r in reports}
    if forced_lost:  # trained, data lost: recorded without rollout figures
        assert by_step[lost].metrics["recovered_without_rollout"] == 1 and math.isnan(by_step[lost].reward_mean)
    if forced_saved:  # trained, data saved: finished from calibrate + refit with the saved figures
        r = by_step[saved]
        assert (r.metrics["marker"], r.reward_mean, r.accuracy, r.phase_times.rollout) == (7.0, 0.25, 0.5, 0.1)
        assert r.phase_times.calibrate > 0 and "recovered_without_rollout" not in r.metrics
    recovered = [r.step for r in reports if r.metrics.get("recovered_without_rollout")]
    assert set(recovered) <= {lost, saved}
    assert all(math.isnan(r.reward_mean) == (r.step in recovered) for r in reports)


def _respawn(stack, name: str, *extra: str) -> None:
    """Start process ``name`` again with its recorded command (same port) plus ``extra``; record the new pid."""
    entry = stack.process(name)
    cmd = list(entry["cmd"])
    if "--port" in cmd and entry["port"]:
        cmd[cmd.index("--port") + 1] = str(entry["port"])  # same address: clients keep their target
    with open(entry["log"], "ab") as log:
        proc = subprocess.Popen([*cmd, *extra], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    info = stack.info
    next(p for p in info["processes"] if p["name"] == name)["pid"] = proc.pid  # so that `down` stops it
    (stack.run_dir / "stack.json").write_text(json.dumps(info))


def _jobs(stack) -> JobStore:
    return JobStore(redis.Redis.from_url(stack.redis_url))


def test_redis_killed_mid_job_restarts_from_its_append_only_file_and_no_finished_step_is_lost(stack):
    steps = 5
    with _client(stack) as c:
        job_id = c.submit_job(stack.job_yaml(steps=steps, checkpoint_every=0), job_id="redis-restart")
        _wait_steps(stack, job_id, 2)
        before = _jobs(stack).reports(job_id)
        os.kill(stack.process("redis")["pid"], signal.SIGKILL)  # no shutdown save: only the fsynced AOF survives
        time.sleep(1.0)  # every service sees connection errors meanwhile
        _respawn(stack, "redis")
        reports = list(c.watch(job_id, timeout_s=WATCH_S * 2))
        final = c.get_job(job_id)
    assert final.state == "succeeded", final.error
    assert [r.step for r in reports] == list(range(steps))
    base = reports[0].weight_version
    assert [r.weight_version for r in reports] == list(range(base, base + steps))  # none lost, none repeated
    after = _jobs(stack).reports(job_id)
    for old in before:  # what was finished before the kill is still there, unchanged
        assert after[old["step"]] == old
    with pytest.raises(redis.AuthenticationError):  # restarted from its cmd: it still requires the password
        redis.Redis(host="127.0.0.1", port=stack.process("redis")["port"]).ping()


def test_trainer_killed_mid_job_resumes_from_its_checkpoint_and_the_job_rewinds_to_it(stack):
    steps = 6
    with _client(stack) as c:
        job_id = c.submit_job(stack.job_yaml(steps=steps, checkpoint_every=2), job_id="trainer-crash")
        _wait_steps(stack, job_id, 3)
        os.kill(stack.process("trainer")["pid"], signal.SIGKILL)  # mid-step 3: its checkpoint is after step 1
        rec = _jobs(stack).get(job_id)
        ckpt_version, base, latest = rec.checkpoint_version, rec.start_version, _refit(stack).latest()
        assert ckpt_version is not None and base <= ckpt_version < latest
        _respawn(stack, "trainer", "--resume", str(stack.run_dir / "checkpoints"))
        live = list(c.watch(job_id, timeout_s=WATCH_S * 3))  # steps since the checkpoint are run again
        final = c.get_job(job_id)
        reports = list(c.watch(job_id, timeout_s=WATCH_S))  # what the job recorded: one report per step
    assert [r.step for r in live][-1] == steps - 1
    assert final.state == "succeeded", final.error
    assert [r.step for r in reports] == list(range(steps))
    k = ckpt_version - base  # the job went back to the step after the checkpoint
    versions = [r.weight_version for r in reports]
    assert versions[:k] == list(range(base, base + k))
    restored = versions[k]
    assert restored > latest and _refit(stack).restored_from(restored) == ckpt_version
    assert versions[k:] == list(range(restored, restored + steps - k))
    held = _trainer(stack).Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version
    assert held == restored + steps - k


def test_a_checkpoint_taken_after_an_unrecorded_step_finishes_that_step_after_a_trainer_restart(stack):
    steps = 8  # room after the step the kill lands in (its index depends on how fast the first steps ran)
    with _client(stack) as c:
        job_id = c.submit_job(stack.job_yaml(steps=steps, checkpoint_every=0), job_id="ckpt-unrecorded")
        base = next(iter(c.watch(job_id, timeout_s=WATCH_S))).weight_version
        n, forced = _kill_with_step_half_done(stack, job_id, base, save_inflight=True)  # step n trained, not recorded
        trainer = _trainer(stack)
        assert trainer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=60).version == base + n + 1
        os.kill(stack.process("trainer")["pid"], signal.SIGKILL)
        _respawn(stack, "trainer", "--resume", str(stack.run_dir / "checkpoints"))
        _restart_controller(stack, stack.process("controller"))
        reports = list(c.watch(job_id, timeout_s=WATCH_S * 3))
        final = c.get_job(job_id)
    assert final.state == "succeeded", final.error
    assert [r.step for r in reports] == list(range(steps))
    versions = [r.weight_version for r in reports]
    assert versions[:n + 1] == list(range(base, base + n + 1))  # step n recorded from where it started
    republished = versions[n + 1]  # step n's update under its new version: step n+1 starts from it
    assert _refit(stack).restored_from(republished) == base + n + 1
    assert versions[n + 1:] == list(range(republished, republished + steps - n - 1))
    if forced:  # finished with the step's saved data, not re-run
        assert reports[n].metrics["marker"] == 7.0 and reports[n].phase_times.calibrate > 0


def _refit(stack) -> RefitStore:
    return RefitStore(connect(stack.redis_url), stack.info["namespace"])


def test_down_stops_every_process(stack):
    pids = [p["pid"] for p in stack.info["processes"]]
    res = launcher("down", "--run-dir", str(stack.run_dir), "--grace", "10", timeout=60)
    assert res.returncode == 0, res.stderr
    assert stack.info.get("stopped") is True
    for pid in pids:
        assert not alive(pid), f"pid {pid} still running after down"



@pytest.mark.chaos  # a whole stack started and signalled (~25 s): kept out of make test's budget
def test_sigterm_to_launcher_run_brings_its_stack_down(tmp_path):
    """`deploy.launcher run` killed with SIGTERM (a supervisor, `timeout`) stops every process it started."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_job(tiny_model(tmp_path / "model"), steps=50, checkpoint_every=0)))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_") or k == "FP8RL_REDIS_SERVER"}
    p = subprocess.Popen([sys.executable, "-m", "deploy.launcher", "run", "--job", str(job), "--run-dir",
                          str(run_dir), "--plain"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        for line in p.stdout:  # the first finished step: the stack is up and a job is running
            if line.startswith("step 1/"):
                break
        else:
            raise AssertionError(f"the launcher exited with {p.wait()} before a step finished")
        pids = [e["pid"] for e in json.loads((run_dir / "stack.json").read_text())["processes"]]
        p.send_signal(signal.SIGTERM)
        rest = p.communicate(timeout=90)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, rest  # EXIT_INTERRUPTED
    assert "interrupted: cancelling the job" in rest
    for pid in pids:
        assert not alive(pid), f"pid {pid} still running after the launcher got SIGTERM"
