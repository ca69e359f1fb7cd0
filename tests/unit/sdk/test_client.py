"""The SDK client and the ``fp8rl`` CLI against a test double of the controller on a real gRPC server.

``FakeController`` implements JobService over an in-memory job table; its state outlives server
restarts, so a watch can be broken and resumed for real, and outages and delays can be injected. The
same main calls against the real controller (a launched stack) are in
tests/integration/controller/test_sdk_real.py.
"""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
import threading
import time
import types
from types import MappingProxyType

import grpc
import pytest

from fp8rl.config import ConfigError, parse_job_config
from fp8rl.rpc import common_pb2, controller_pb2, controller_pb2_grpc
from fp8rl.rpc.server import build_server, set_serving
from fp8rl.sdk import (
    AlreadyExists,
    DeadlineExceeded,
    Fp8rlClient,
    InvalidArgument,
    JobInfo,
    NotFound,
    PhaseTimes,
    StepReport,
    Unauthenticated,
    Unavailable,
    cli,
)

GOOD_JOB = "job: {name: demo, steps: 3}\ngrpo: {num_generations_per_prompt: 4}\n"
BAD_JOB = "job: {name: demo, stepz: 3}\n"
TERMINAL = ("succeeded", "failed", "cancelled")


class FakeController(controller_pb2_grpc.JobServiceServicer):
    """In-memory JobService. ``fail_next[method] = n`` answers the next n calls UNAVAILABLE
    (SubmitJob still records the job first: a reply lost on the way back)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.jobs: dict[str, controller_pb2.JobInfo] = {}
        self.reports: dict[str, list[controller_pb2.StepReport]] = collections.defaultdict(list)
        self.calls: collections.Counter[str] = collections.Counter()
        self.fail_next: collections.Counter[str] = collections.Counter()
        self.delay_s = 0.0
        self.fail_code = grpc.StatusCode.UNAVAILABLE  # what fail_next answers

    def _enter(self, method: str, context) -> None:
        self.calls[method] += 1
        time.sleep(self.delay_s)
        if self.fail_next[method] > 0:
            self.fail_next[method] -= 1
            context.abort(self.fail_code, "injected outage")

    def _job(self, job_id: str, context) -> controller_pb2.JobInfo:
        if job_id not in self.jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        return self.jobs[job_id]

    def SubmitJob(self, request, context):
        self.calls["SubmitJob"] += 1
        try:
            cfg = parse_job_config(request.job_yaml)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self.cond:
            job_id = request.job_id if request.HasField("job_id") else f"job-{len(self.jobs)}"
            if job_id in self.jobs:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"job {job_id!r} already exists")
            now = time.time()
            self.jobs[job_id] = controller_pb2.JobInfo(job_id=job_id, state="pending", total_steps=cfg.job.steps,
                                                       created_unix=now, updated_unix=now)
        if self.fail_next["SubmitJob"] > 0:
            self.fail_next["SubmitJob"] -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected outage after the job landed")
        return controller_pb2.SubmitJobResponse(job_id=job_id)

    def WatchJob(self, request, context):
        self._enter("WatchJob", context)
        self._job(request.job_id, context)
        step = request.from_step
        while context.is_active():
            with self.cond:
                reports = self.reports[request.job_id]
                pending = [r for r in reports if r.step >= step]
                if not pending:
                    if self.jobs[request.job_id].state in TERMINAL:
                        return
                    self.cond.wait(0.05)
                    continue
            for r in pending:
                yield r
                step = r.step + 1

    def GetJob(self, request, context):
        self._enter("GetJob", context)
        with self.cond:
            return controller_pb2.GetJobResponse(job=self._job(request.job_id, context))

    def ListJobs(self, request, context):
        self._enter("ListJobs", context)
        with self.cond:
            jobs = [j for j in reversed(self.jobs.values()) if not request.state or j.state == request.state]
        return controller_pb2.ListJobsResponse(jobs=jobs[: request.limit or None])

    def CancelJob(self, request, context):
        self._enter("CancelJob", context)
        with self.cond:
            job = self._job(request.job_id, context)
            if job.state not in TERMINAL:
                job.state = "cancelled"
                self.cond.notify_all()
            return controller_pb2.CancelJobResponse(job=job)

    def add_step(self, job_id: str, state: str = "running", reward: float = 0.5) -> None:
        """Finishes the job's next step with the given resulting state."""
        with self.cond:
            job, reports = self.jobs[job_id], self.reports[job_id]
            step = len(reports)
            reports.append(controller_pb2.StepReport(
                job_id=job_id, step=step, weight_version=step, reward_mean=reward, accuracy=reward / 2,
                metrics={"token_mult_prob_error": 1.02, "loss": 0.1 * step}, state=state,
                phase_times=common_pb2.PhaseTimes(rollout=1.0, calibrate=0.01, total=2.0),
            ))
            job.step, job.state = step + 1, state
            self.cond.notify_all()


class Served:
    """A FakeController on a real loopback gRPC server that can be stopped and restarted on its port."""

    def __init__(self, token: str = ""):
        self.fake, self.token, self.port = FakeController(), token, 0
        self.server = None
        self.start()

    def start(self) -> None:
        for _ in range(50):  # the old server may hold the port for a moment after stopping
            try:
                server, health, port = build_server(
                    [(controller_pb2_grpc.add_JobServiceServicer_to_server, self.fake)],
                    port=self.port, token=self.token, tls_cert="", tls_key="", host="127.0.0.1")
                break
            except RuntimeError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"could not rebind port {self.port}")
        server.start()
        set_serving(health, True)
        self.server, self.port = server, port

    def stop(self) -> None:
        self.server.stop(None).wait()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for var in ("FP8RL_AUTH_TOKEN", "FP8RL_TLS_CA", "FP8RL_TARGET"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def served():
    s = Served()
    yield s
    s.stop()


@pytest.fixture
def client(served):
    c = Fp8rlClient(served.target, backoff_s=0.02, max_backoff_s=0.2, watch_reconnect_s=10.0)
    yield c
    c.close()


def _dead_target() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# -- client --------------------------------------------------------------------------------------


def test_submit_validates_locally_before_any_rpc(client, served, tmp_path):
    with pytest.raises(ConfigError, match="job.stepz"):
        client.submit_job(BAD_JOB)
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text(BAD_JOB)
    with pytest.raises(ConfigError, match=r"bad\.yaml.*job\.stepz"):
        client.submit_job(bad_file)
    with pytest.raises(ConfigError, match="does not exist"):
        client.submit_job(str(tmp_path / "missing.yaml"))
    assert served.fake.calls["SubmitJob"] == 0


def test_submit_get_list_cancel_return_typed_values(client, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_JOB)
    first, second = client.submit_job(good), client.submit_job(GOOD_JOB, job_id="mine")
    assert (first, second) == ("job-0", "mine")
    info = client.get_job("mine")
    assert isinstance(info, JobInfo) and (info.state, info.total_steps, info.is_terminal) == ("pending", 3, False)
    assert [j.job_id for j in client.list_jobs()] == ["mine", "job-0"]
    assert [j.job_id for j in client.list_jobs(limit=1)] == ["mine"]
    cancelled = client.cancel_job("mine", reason="test")
    assert (cancelled.state, cancelled.is_terminal) == ("cancelled", True)
    with pytest.raises(AlreadyExists, match="mine"):
        client.submit_job(GOOD_JOB, job_id="mine")


def test_not_found_maps_to_not_found(client):
    for call in (lambda: client.get_job("nope"), lambda: client.cancel_job("nope"), lambda: list(client.watch("nope"))):
        with pytest.raises(NotFound, match="no job 'nope'") as info:
            call()
        assert info.value.code == "NOT_FOUND"


def test_watch_yields_typed_reports_until_terminal(client, served):
    job = client.submit_job(GOOD_JOB)
    for state in ("running", "running", "succeeded"):
        served.fake.add_step(job, state)
    reports = list(client.watch(job))
    assert [r.step for r in reports] == [0, 1, 2] and reports[-1].is_terminal
    r = reports[0]
    assert isinstance(r, StepReport) and isinstance(r.phase_times, PhaseTimes)
    assert isinstance(r.metrics, MappingProxyType) and r.token_mult_prob_error == pytest.approx(1.02)
    assert r.phase_times.calibrate_share == pytest.approx(0.005)
    assert (r.reward_mean, r.accuracy, r.weight_version) == (0.5, 0.25, 0)
    assert [r.step for r in client.watch(job, from_step=2)] == [2]


def test_watch_resumes_after_server_restart_mid_stream(client, served):
    job = client.submit_job(GOOD_JOB)
    served.fake.add_step(job)
    served.fake.add_step(job)
    seen = []
    for report in client.watch(job):
        seen.append(report.step)
        if report.step == 1:
            served.stop()  # the stream breaks here: the client must reconnect from step 2

            def restart():
                time.sleep(0.3)
                served.start()
                served.fake.add_step(job)
                served.fake.add_step(job, "succeeded")

            threading.Thread(target=restart, daemon=True).start()
    assert seen == [0, 1, 2, 3]  # no step lost, none repeated
    assert served.fake.calls["WatchJob"] >= 2


def test_watch_reopens_expired_segments_and_honours_its_own_timeout(served):
    with Fp8rlClient(served.target, watch_segment_s=0.15, backoff_s=0.01) as c:
        job = c.submit_job(GOOD_JOB)
        with pytest.raises(DeadlineExceeded, match="did not end within 0.3 s"):
            list(c.watch(job, timeout_s=0.3))

        def finish_later():
            time.sleep(0.4)
            served.fake.add_step(job, "succeeded")

        threading.Thread(target=finish_later, daemon=True).start()
        calls_before = served.fake.calls["WatchJob"]
        assert [r.step for r in c.watch(job)] == [0]  # every call has a deadline; the watch outlives them
        assert served.fake.calls["WatchJob"] - calls_before >= 2


def test_watch_backs_off_and_retries_while_the_stream_limits_are_full(client, served):
    job = client.submit_job(GOOD_JOB)
    served.fake.add_step(job, "succeeded")
    served.fake.fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED  # what the controller answers past its watch limits
    served.fake.fail_next["WatchJob"] = 3
    assert [r.step for r in client.watch(job)] == [0]
    assert served.fake.calls["WatchJob"] == 4  # three refusals, then the stream


def test_idempotent_calls_retry_and_submit_does_not(client, served):
    job = client.submit_job(GOOD_JOB, job_id="j")
    served.fake.fail_next["GetJob"] = 2
    assert client.get_job(job).job_id == "j"
    assert served.fake.calls["GetJob"] == 3

    served.fake.fail_next["SubmitJob"] = 1  # lands, but the reply is "lost"
    with pytest.raises(Unavailable, match="injected outage"):
        client.submit_job(GOOD_JOB)
    assert served.fake.calls["SubmitJob"] == 2  # one earlier submit + this one, never retried

    served.fake.fail_next["SubmitJob"] = 1  # with a client-chosen id the retry is safe
    assert client.submit_job(GOOD_JOB, job_id="keyed") == "keyed"
    assert served.fake.calls["SubmitJob"] == 4 and "keyed" in served.fake.jobs


def test_unreachable_server_is_unavailable():
    with Fp8rlClient(_dead_target(), retries=1, backoff_s=0.01) as c:
        with pytest.raises(Unavailable, match="unavailable"):
            c.list_jobs()


def test_deadline_is_enforced(served):
    served.fake.delay_s = 0.5
    with Fp8rlClient(served.target, timeout_s=0.1, retries=0) as c:
        with pytest.raises(DeadlineExceeded):
            c.list_jobs()


def test_token_required():
    s = Served(token="t0k3n")
    try:
        with Fp8rlClient(s.target, token="") as c, pytest.raises(Unauthenticated, match="missing bearer token"):
            c.list_jobs()
        with Fp8rlClient(s.target, token="t0k3n") as c:
            assert c.list_jobs() == []
    finally:
        s.stop()


def test_token_file_and_scope_errors(tmp_path, monkeypatch, capsys):
    s = Served(token="t0k3n")
    try:
        token_file = tmp_path / "client.token"
        token_file.write_text("t0k3n\n")
        with Fp8rlClient(s.target, token_file=token_file) as c:
            assert c.list_jobs() == []
        monkeypatch.setenv("FP8RL_TOKEN_FILE", str(token_file))
        with Fp8rlClient(s.target) as c:  # found through $FP8RL_TOKEN_FILE
            assert c.list_jobs() == []
        monkeypatch.delenv("FP8RL_TOKEN_FILE")
        assert cli.main(["--target", s.target, "--token-file", str(token_file), "status"]) == 0
        assert cli.main(["--target", s.target, "--token-file", str(tmp_path / "missing"), "status"]) == 2
        assert "does not exist" in capsys.readouterr().err
    finally:
        s.stop()


def test_server_side_invalid_argument_maps(client):
    # Bypass local validation to see the server's own rejection mapped.
    with pytest.raises(InvalidArgument, match="job.stepz"):
        client._call("SubmitJob", client._stub.SubmitJob, controller_pb2.SubmitJobRequest(job_yaml=BAD_JOB), 5.0,
                     idempotent=False)


# -- CLI -----------------------------------------------------------------------------------------


def test_cli_submit_status_watch_cancel(served, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FP8RL_TARGET", served.target)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(GOOD_JOB)
    assert cli.main(["submit", str(job_file)]) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id == "job-0"

    assert cli.main(["status"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["JOB_ID", "STATE", "STEP"] and table[1].split()[:3] == [job_id, "pending", "0/3"]

    for state in ("running", "running", "succeeded"):
        served.fake.add_step(job_id, state)
    assert cli.main(["watch", job_id, "--plain"]) == 0
    out = capsys.readouterr().out
    assert "step 3/3 reward=0.500 acc=0.250 mult_err=1.0200" in out and f"job {job_id} succeeded" in out

    cli.main(["--target", served.target, "submit", str(job_file), "--job-id", "other"])
    assert cli.main(["cancel", "other"]) == 0
    assert "job other cancelled" in capsys.readouterr().out
    assert cli.main(["watch", "other", "--plain"]) == 1  # a cancelled job is not a success


def test_cli_exit_codes_for_bad_input(served, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_JOB)
    assert cli.main(["--target", _dead_target(), "submit", str(bad)]) == 2  # validated before connecting
    err = capsys.readouterr().err
    assert "job.stepz" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["--target", served.target, "status", "nope"]) == 2
    assert "no job 'nope'" in capsys.readouterr().err
    assert served.fake.calls["SubmitJob"] == 0


def test_cli_up_down_delegate_to_launcher(monkeypatch, capsys):
    monkeypatch.setattr(cli, "LAUNCHER_MODULE", "fp8rl_test_no_such_pkg.launcher")
    assert cli.main(["up"]) == 1
    assert "not importable" in capsys.readouterr().err

    seen = []
    fake = types.ModuleType("fp8rl_test_launcher")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "fp8rl_test_launcher", fake)
    monkeypatch.setattr(cli, "LAUNCHER_MODULE", "fp8rl_test_launcher")
    assert cli.main(["down", "--all"]) == 0
    assert seen == [["down", "--all"]]


def test_cli_unavailable_exit_code_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "fp8rl.sdk.cli", "--target", _dead_target(), "status"],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith("fp8rl: error:") and "unavailable" in proc.stderr
