"""The reward service as a real process: ``python -m services.reward`` over loopback gRPC."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fp8rl.envs import env_names, resolve
from fp8rl.refit import RefitStore, connect
from fp8rl.rpc import env_pb2, env_pb2_grpc, reward_pb2, reward_pb2_grpc
from fp8rl.rpc.channel import DEFAULT_DEADLINE_S, make_channel

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOKEN = "reward-test-token"
STARTUP_TIMEOUT_S = 30.0


def _wait_ready_file(proc: subprocess.Popen, path: Path, log: Path) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"reward service did not become ready (exit {proc.poll()}); log:\n{log.read_text()[-3000:]}")


SLOW_GRADERS = """
import time
from fp8rl.data import register_grader

def sleepy(response, answer):  # sleeps as many seconds as the response says, then calls it right
    time.sleep(float(response))
    return 1.0

def broken(response, answer):
    raise RuntimeError("this grader always fails")

register_grader("test_sleepy", sleepy)
register_grader("test_broken", broken)
"""
USER_ENVS = """
from fp8rl.envs import Environment, EnvStep

class Echo(Environment):  # a user environment, run by import path: answers once with what it was told
    def reset(self, task):
        return [{"role": "user", "content": task["question"]}]

    def step(self, text):
        return EnvStep([], float(text == "yes"), True, {"said": text})
"""
ITEM_TIMEOUT_S = 3.0  # the service's per-item bound in this module


@pytest.fixture(scope="module")
def reward_service(tmp_path_factory, redis_url):
    """A running reward service (math_verify by default, two graders of a test module registered) with a
    service token (Score's scope) and its endpoint lease in Redis; yields (proc, port, ready_file)."""
    tmp = tmp_path_factory.mktemp("reward")
    ready, log, job = tmp / "ready.json", tmp / "reward.log", tmp / "job.yaml"
    job.write_text("job:\n  name: reward-test\nreward:\n  grader: math_verify\n")
    (tmp / "slow_graders.py").write_text(SLOW_GRADERS)
    (tmp / "user_envs.py").write_text(USER_ENVS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")])
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward", "--config", str(job), "--port", "0", "--ready-file", str(ready),
             "--redis-url", redis_url, "--job-id", "reward-test", "--replica-id", "reward-0",
             "--service-token", TOKEN, "--timeout-s", str(ITEM_TIMEOUT_S), "--grader-module", "slow_graders",
             "--env-module", "user_envs", "--env-workers", "1"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    info = _wait_ready_file(proc, ready, log)
    assert info["pid"] == proc.pid
    try:
        yield proc, info["port"], ready
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def stub(reward_service):
    _, port, _ = reward_service
    channel = make_channel(f"localhost:{port}", token=TOKEN, tls_ca="")
    yield reward_pb2_grpc.RewardServiceStub(channel)
    channel.close()


def _item(response: str, answer: str, grader: str = "") -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(response=response, answer=answer, grader=grader)


def test_health_is_serving_without_a_token(reward_service):
    _, port, _ = reward_service
    channel = make_channel(f"localhost:{port}", token="", tls_ca="")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "fp8rl.v1.RewardService"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=DEFAULT_DEADLINE_S.health)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_scores_a_mixed_batch(stub):
    request = reward_pb2.ScoreRequest(items=[
        _item("so the answer is \\boxed{\\frac{1}{2}}", "0.5"),  # right (default grader: math_verify)
        _item("\\boxed{7}", "8"),  # wrong, but readable
        _item("I have no idea", "3"),  # unparsable
        _item("total: 12", "12", grader="exact_match"),  # right, another grader
        _item("", "12", grader="exact_match"),  # unparsable under exact_match too
    ])
    response = stub.Score(request, timeout=DEFAULT_DEADLINE_S.score)
    assert list(response.rewards) == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert response.num_unparsable == 2
    assert [e.split(":")[0] for e in response.errors] == ["", "", "unparsable", "", "unparsable"]
    g, u = reward_pb2.GRADE_STATUS_GRADED, reward_pb2.GRADE_STATUS_UNPARSABLE
    assert list(response.statuses) == [g, g, u, g, u]


def test_score_model_refuses_bad_requests_and_without_a_reward_model_says_so(stub):
    """ScoreModel (issue 52): oversized items and a bad time bound are INVALID_ARGUMENT, named; a service started with
    no reward.model is FAILED_PRECONDITION saying how to start one (the served model: tests/unit/rewards)."""
    big = reward_pb2.ModelItem(question="x" * ((1 << 18) + 1), response="4")
    for req, match in ((reward_pb2.ScoreModelRequest(items=[big]), "items\\[0\\].question"),
                       (reward_pb2.ScoreModelRequest(timeout_s=float("nan")), "timeout_s"),
                       (reward_pb2.ScoreModelRequest(timeout_s=-1.0), "timeout_s")):
        with pytest.raises(grpc.RpcError) as err:
            stub.ScoreModel(req, timeout=DEFAULT_DEADLINE_S.score)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and re.search(match, err.value.details())
    with pytest.raises(grpc.RpcError) as err:
        stub.ScoreModel(reward_pb2.ScoreModelRequest(items=[reward_pb2.ModelItem(response="4")]),
                        timeout=DEFAULT_DEADLINE_S.score)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "reward.model" in err.value.details()
    assert len(stub.Score(reward_pb2.ScoreRequest(items=[_item("4", "4")]), timeout=5).rewards) == 1  # still serves


@pytest.fixture
def envs(reward_service):
    _, port, _ = reward_service
    channel = make_channel(f"localhost:{port}", token=TOKEN, tls_ca="")
    yield env_pb2_grpc.EnvServiceStub(channel)
    channel.close()


def test_env_service_runs_builtin_and_module_environments_and_records_them(envs, redis_url):
    task = json.dumps({"question": "What is 12*34?", "answer": "408"})
    opening = envs.Reset(env_pb2.EnvResetRequest(trajectory_id="c1", env="calculator", task_json=task), timeout=30)
    assert json.loads(opening.messages_json)[-1]["content"].endswith("What is 12*34?")
    assert json.loads(opening.tools_json)[0]["function"]["name"] == "calculator"
    done = envs.Step(env_pb2.EnvStepRequest(trajectory_id="c1", text="Answer: 408"), timeout=30)
    assert (done.status, done.done, done.reward) == (env_pb2.ENV_STATUS_OK, True, 1.0)
    envs.Reset(env_pb2.EnvResetRequest(trajectory_id="u1", env="user_envs:Echo", task_json='{"question": "ok?"}'),
               timeout=30)
    r = envs.Step(env_pb2.EnvStepRequest(trajectory_id="u1", text="yes"), timeout=30)
    assert r.reward == 1.0 and json.loads(r.info_json) == {"said": "yes"}
    assert envs.Close(env_pb2.EnvCloseRequest(trajectory_ids=["c1", "u1", "never"]), timeout=30).closed == 2
    gone = envs.Step(env_pb2.EnvStepRequest(trajectory_id="u1", text="yes"), timeout=30)
    assert gone.status == env_pb2.ENV_STATUS_LOST and "has no environment" in gone.error
    builtins = {n for n in env_names() if resolve(n).__module__.startswith("fp8rl.envs.")}  # fp8rl's registered ones
    assert RefitStore(connect(redis_url), "reward-test").envs() == (builtins, {"user_envs"})


@pytest.mark.parametrize("request_, match", [
    (env_pb2.EnvResetRequest(trajectory_id="x", env="os:system"), "does not run here"),
    (env_pb2.EnvResetRequest(trajectory_id="x", env="calculator", task_json="[1]"), "must be a JSON object"),
    (env_pb2.EnvResetRequest(trajectory_id="x", env="calculator", task_json='{"q": NaN}'), "is not JSON"),
    (env_pb2.EnvResetRequest(trajectory_id="", env="calculator"), "trajectory_id is empty"),
    (env_pb2.EnvResetRequest(trajectory_id="x" * 300, env="calculator"), "the limit is 256"),
    (env_pb2.EnvStepRequest(trajectory_id="x", text="y" * ((1 << 18) + 1)), "the limit is"),
    (env_pb2.EnvStepRequest(trajectory_id="x", timeout_s=float("nan")), "timeout_s"),
])
def test_env_service_refuses_bad_requests_naming_the_field(envs, request_, match):
    method = envs.Reset if isinstance(request_, env_pb2.EnvResetRequest) else envs.Step
    with pytest.raises(grpc.RpcError) as err:
        method(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in err.value.details()


def test_a_reset_that_fails_is_failed_precondition_naming_the_error(envs):
    with pytest.raises(grpc.RpcError) as err:
        envs.Reset(env_pb2.EnvResetRequest(trajectory_id="r1", env="calculator", task_json='{"question": "1"}'),
                   timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "answer" in err.value.details()


def test_the_service_registers_its_endpoint_lease(reward_service, redis_url):
    _, port, _ = reward_service
    lease = RefitStore(connect(redis_url), "reward-test").endpoint_of("reward")
    assert lease is not None and lease.replica_id == "reward-0" and lease.endpoint.endswith(f":{port}")


def test_hung_and_crashing_graders_are_ungraded_and_never_hold_a_worker(stub):
    """Three items that would hang for a minute each (two worker processes) and one whose grader raises come
    back TIMEOUT / ERROR, not a plain 0; the batch ends within ~2 rounds of the per-item bound; each hung
    worker is killed and replaced, so the next batch of right answers is graded (reward 1, GRADED)."""
    hung = [_item("60", "1", grader="test_sleepy") for _ in range(3)]
    request = reward_pb2.ScoreRequest(items=[*hung, _item("\\boxed{1}", "1"), _item("x", "1", grader="test_broken")])
    t = time.monotonic()
    response = stub.Score(request, timeout=120)
    took = time.monotonic() - t
    timeout, error, graded = (reward_pb2.GRADE_STATUS_TIMEOUT, reward_pb2.GRADE_STATUS_ERROR,
                              reward_pb2.GRADE_STATUS_GRADED)
    assert list(response.statuses) == [timeout, timeout, timeout, graded, error]
    assert list(response.rewards) == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert "took longer than" in response.errors[0] and "always fails" in response.errors[4]
    assert took < 60, f"a hung grader held the batch for {took:.0f} s"
    after = stub.Score(reward_pb2.ScoreRequest(items=[_item("\\boxed{2}", "2") for _ in range(4)]), timeout=120)
    assert list(after.statuses) == [graded] * 4 and list(after.rewards) == [1.0] * 4


def test_empty_batch(stub):
    response = stub.Score(reward_pb2.ScoreRequest(), timeout=DEFAULT_DEADLINE_S.score)
    assert (list(response.rewards), response.num_unparsable, list(response.errors)) == ([], 0, [])


def test_unknown_grader_is_invalid_argument_and_service_keeps_serving(stub):
    request = reward_pb2.ScoreRequest(items=[_item("\\boxed{1}", "1"), _item("\\boxed{1}", "1", grader="nope")])
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(request, timeout=DEFAULT_DEADLINE_S.score)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[1].grader" in info.value.details() and "'nope'" in info.value.details()
    assert "exact_match" in info.value.details() and "math_verify" in info.value.details()
    again = stub.Score(reward_pb2.ScoreRequest(items=[_item("\\boxed{1}", "1")]), timeout=DEFAULT_DEADLINE_S.score)
    assert list(again.rewards) == [1.0]


def test_token_is_required(reward_service):
    _, port, _ = reward_service
    channel = make_channel(f"localhost:{port}", token="", tls_ca="")
    with pytest.raises(grpc.RpcError) as info:
        reward_pb2_grpc.RewardServiceStub(channel).Score(reward_pb2.ScoreRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_tls_token_and_job_defaults_from_flags_and_env(tmp_path, self_signed_cert, redis_url):
    """TLS cert/key by flag, the token by environment, the default grader from the job YAML (--config)."""
    cert, key = self_signed_cert
    job = tmp_path / "job.yaml"
    job.write_text("job:\n  name: reward-tls\nreward:\n  grader: exact_match\n  timeout_s: 3\n")
    ready, log = tmp_path / "ready.json", tmp_path / "reward.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")} | {"FP8RL_SERVICE_TOKEN": TOKEN}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward", "--port", "0", "--ready-file", str(ready), "--config", str(job),
             "--redis-url", redis_url, "--tls-cert", str(cert), "--tls-key", str(key)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        port = _wait_ready_file(proc, ready, log)["port"]
        with make_channel(f"localhost:{port}", token=TOKEN, tls_ca=str(cert)) as ch:
            # exact_match (the job's grader) accepts a bare "7"; math_verify would need a final answer to parse
            got = reward_pb2_grpc.RewardServiceStub(ch).Score(
                reward_pb2.ScoreRequest(items=[_item("7", "7"), _item("8", "7")]), timeout=DEFAULT_DEADLINE_S.score)
            assert list(got.rewards) == [1.0, 0.0]
        with make_channel(f"localhost:{port}", token="", tls_ca=str(cert)) as ch:
            with pytest.raises(grpc.RpcError) as info:
                reward_pb2_grpc.RewardServiceStub(ch).Score(reward_pb2.ScoreRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize("role", ["reward", "calibrator"])
def test_a_tls_cert_without_its_key_is_a_clear_startup_error(tmp_path, role, self_signed_cert):
    cert, _ = self_signed_cert
    job = tmp_path / "job.yaml"
    job.write_text("job:\n  name: tls-check\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")}
    res = subprocess.run([sys.executable, "-m", f"services.{role}", "--port", "0", "--config", str(job),
                          "--tls-cert", str(cert)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--tls-cert and --tls-key go together" in res.stderr


def test_sigterm_stops_gracefully(reward_service):
    """Runs last in this module: the service exits 0 on SIGTERM and removes its ready file."""
    proc, _, ready = reward_service
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert not ready.exists()


def test_grades_without_redis_and_registers_its_lease_once_redis_answers(tmp_path, redis_server_binary):
    """Grading needs no Redis (the reward spec says so): the service starts with Redis down, scores, and its lease
    appears once a redis-server listens at the URL."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on (yet)
        sock.bind(("127.0.0.1", 0))
        port_r = sock.getsockname()[1]
    url = f"redis://127.0.0.1:{port_r}/0"
    job = tmp_path / "job.yaml"
    job.write_text("job:\n  name: reward-noredis\nreward:\n  grader: exact_match\n")
    ready, log = tmp_path / "ready.json", tmp_path / "reward.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward", "--config", str(job), "--port", "0", "--ready-file", str(ready),
             "--redis-url", url, "--replica-id", "reward-nr", "--service-token", TOKEN, "--lease-ttl", "3"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    redis_proc = None
    try:
        port = _wait_ready_file(proc, ready, log)["port"]
        with make_channel(f"localhost:{port}", token=TOKEN, tls_ca="") as ch:
            got = reward_pb2_grpc.RewardServiceStub(ch).Score(
                reward_pb2.ScoreRequest(items=[_item("7", "7"), _item("8", "7")]), timeout=DEFAULT_DEADLINE_S.score)
        assert list(got.rewards) == [1.0, 0.0]
        assert "serves without its lease until Redis answers" in log.read_text()
        redis_proc = subprocess.Popen([redis_server_binary, "--port", str(port_r), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT)
        deadline, lease = time.monotonic() + 20, None
        while lease is None and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                lease = RefitStore(connect(url, timeout_s=1), "reward-noredis").endpoint_of("reward")
            except Exception:  # noqa: BLE001 - redis-server still starting
                lease = None
        assert lease is not None and lease.endpoint.endswith(f":{port}"), log.read_text()[-2000:]
    finally:
        for p in (proc, redis_proc):
            if p is not None:
                p.kill()
                p.wait(timeout=10)
