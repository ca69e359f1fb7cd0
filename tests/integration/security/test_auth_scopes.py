"""Token scopes and path confinement against the real stack ``deploy.launcher up`` starts, with raw stubs.

What a new user or an attacker on the same host could try, talking to each service with the generated
stubs (not the SDK): no token is UNAUTHENTICATED everywhere but health; the client token (what the SDK
holds) is PERMISSION_DENIED on every internal RPC and changes nothing in Redis, the weights or the
checkpoints; the service token is PERMISSION_DENIED on the JobService; SaveCheckpoint takes a name,
never a path. Plus: the launcher's token files are private and no token is on a command line, and a
service refuses to listen off loopback without its token unless told ``--insecure``. The stack's Redis requires
the password the launcher generated (``NOAUTH`` without it, ``WRONGPASS`` with another): it is in 0600 files
only — on no command line of any process, in no environment, log or ``stack.json`` — and a service given a wrong
or missing one stops at start with one line naming the setting.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fp8rl.rpc import (
    calibrator_pb2,
    calibrator_pb2_grpc,
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    env_pb2,
    env_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)
from fp8rl.rpc.channel import make_channel
from fp8rl.sdk import Fp8rlClient, PermissionDenied, Unauthenticated

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
T = 30.0
DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED
FORGED = [trainer_pb2.Sequence(prompt_ids=[1, 40, 41], response_ids=[42, 2], gen_logprobs=[-1.0, -1.0], advantage=a)
          for a in (1e6, -1e6)]  # the forged batch of the issue: a huge advantage


def _target(stack, name: str) -> str:
    return f"127.0.0.1:{stack.process(name)['port']}"


def _internal_calls(version: int) -> dict[str, tuple[str, object]]:
    """RPC name -> (process, call(channel)): one call of every internal RPC (streams read to the end)."""
    seq = [common_pb2.TokenSequence(token_ids=[1, 40, 41, 42])]
    gen = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=[1, 20, 21])], weight_version=version,
                                      sampling=rollout_pb2.SamplingParams(max_tokens=2, n=1, temperature=1.0))
    trainer = trainer_pb2_grpc.TrainerServiceStub
    return {
        "TrainStep": ("trainer", lambda ch: trainer(ch).TrainStep(
            trainer_pb2.TrainStepRequest(expected_version=version, rows=FORGED), timeout=T)),
        "ComputeLogprobs": ("trainer", lambda ch: trainer(ch).ComputeLogprobs(
            trainer_pb2.ComputeLogprobsRequest(rows=FORGED), timeout=T)),
        "SaveCheckpoint": ("trainer", lambda ch: trainer(ch).SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(name="stolen"), timeout=T)),
        "TrainerStatus": ("trainer", lambda ch: trainer(ch).Status(trainer_pb2.TrainerStatusRequest(), timeout=T)),
        "GetManifest": ("trainer", lambda ch: weights_pb2_grpc.WeightStoreStub(ch).GetManifest(
            weights_pb2.GetManifestRequest(version=version), timeout=T)),
        "StreamShards": ("trainer", lambda ch: list(weights_pb2_grpc.WeightStoreStub(ch).StreamShards(
            weights_pb2.StreamShardsRequest(version=version, shard_index=0), timeout=T))),
        "Calibrate": ("calibrator", lambda ch: calibrator_pb2_grpc.CalibratorServiceStub(ch).Calibrate(
            calibrator_pb2.CalibrateRequest(version=version + 1, sequences=seq), timeout=T)),
        "Generate": ("rollout-0", lambda ch: list(rollout_pb2_grpc.RolloutServiceStub(ch).Generate(gen, timeout=T))),
        "RolloutStatus": ("rollout-0", lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).Status(
            rollout_pb2.RolloutStatusRequest(), timeout=T)),
        "ReleaseSessions": ("rollout-0", lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).ReleaseSessions(
            rollout_pb2.ReleaseSessionsRequest(session_keys=["k"]), timeout=T)),
        "Score": ("reward", lambda ch: reward_pb2_grpc.RewardServiceStub(ch).Score(
            reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response="4", answer="4")]), timeout=T)),
        "ScoreModel": ("reward", lambda ch: reward_pb2_grpc.RewardServiceStub(ch).ScoreModel(
            reward_pb2.ScoreModelRequest(items=[reward_pb2.ModelItem(question="2+2?", response="4")]), timeout=T)),
        "Reset": ("reward", lambda ch: env_pb2_grpc.EnvServiceStub(ch).Reset(env_pb2.EnvResetRequest(
            trajectory_id="t", env="calculator", task_json='{"question": "What is 2*3?", "answer": "6"}'), timeout=T)),
        "Step": ("reward", lambda ch: env_pb2_grpc.EnvServiceStub(ch).Step(
            env_pb2.EnvStepRequest(trajectory_id="t", text="Answer: 6"), timeout=T)),
        "Close": ("reward", lambda ch: env_pb2_grpc.EnvServiceStub(ch).Close(
            env_pb2.EnvCloseRequest(trajectory_ids=["t"]), timeout=T)),
        "RunAgents": ("reward", lambda ch: env_pb2_grpc.EnvServiceStub(ch).RunAgents(env_pb2.RunAgentsRequest(
            entrypoint="os:system", timeout_s=5, concurrency=1, temperature=1.0, top_p=1.0, max_tokens_per_call=4,
            tasks=[env_pb2.AgentTask(session_id="s", task_json="{}", base_url="http://127.0.0.1:1/v1")]), timeout=T)),
    }


def test_the_calls_cover_every_internal_rpc():
    """Every method of every fp8rl service but the JobService has its call above (a new RPC must be added)."""
    covered = {name.removeprefix("Trainer").removeprefix("Rollout") for name in _internal_calls(0)}
    for mod in (calibrator_pb2, env_pb2, reward_pb2, rollout_pb2, trainer_pb2, weights_pb2):
        for service in mod.DESCRIPTOR.services_by_name.values():
            missing = {m for m in service.methods_by_name} - covered
            assert not missing, (service.full_name, missing)


def _job_calls() -> dict[str, object]:
    jobs = controller_pb2_grpc.JobServiceStub
    return {
        "SubmitJob": lambda ch: jobs(ch).SubmitJob(controller_pb2.SubmitJobRequest(job_yaml="job: {steps: 1}"),
                                                   timeout=T),
        "ListJobs": lambda ch: jobs(ch).ListJobs(controller_pb2.ListJobsRequest(), timeout=T),
        "GetJob": lambda ch: jobs(ch).GetJob(controller_pb2.GetJobRequest(job_id="nope"), timeout=T),
        "CancelJob": lambda ch: jobs(ch).CancelJob(controller_pb2.CancelJobRequest(job_id="nope"), timeout=T),
        "WatchJob": lambda ch: list(jobs(ch).WatchJob(controller_pb2.WatchJobRequest(job_id="nope"), timeout=T)),
    }


def _code(call, channel) -> tuple[grpc.StatusCode, str]:
    try:
        call(channel)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _redis_state(stack) -> dict[bytes, bytes]:
    """Every fp8rl key and its serialized value, leases aside (their heartbeats renew them all the time)."""
    r = redis.Redis.from_url(stack.redis_url)
    return {k: r.dump(k) for k in r.scan_iter(match="fp8rl:*") if b"replicas" not in k and b"lease" not in k}


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _trainer_version(stack) -> int:
    with make_channel(_target(stack, "trainer"), token=stack.service_token, tls_ca="") as ch:
        return trainer_pb2_grpc.TrainerServiceStub(ch).Status(trainer_pb2.TrainerStatusRequest(), timeout=T).version


def _redis_password(stack) -> str:
    return redis.connection.parse_url(stack.redis_url)["password"]


def test_token_files_are_private_and_no_token_is_on_a_command_line(stack):
    paths = stack.info["secrets"]
    secrets_dir = Path(paths["service_token_file"]).parent
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    for key in ("service_token_file", "client_token_file", "redis_config_file", "redis_url_file"):
        assert Path(paths[key]).parent == secrets_dir, key
        assert stat.S_IMODE(Path(paths[key]).stat().st_mode) == 0o600, key
    tokens = (stack.service_token, stack.client_token, _redis_password(stack))
    assert len(set(tokens)) == 3 and all(len(t) >= 32 for t in tokens)
    stack_json = (stack.run_dir / "stack.json").read_text()
    for p in stack.info["processes"]:
        seen = [json.dumps(p["cmd"])]
        for what in ("cmdline", "environ"):
            proc_file = Path(f"/proc/{p['pid']}/{what}")
            if proc_file.exists():
                seen.append(proc_file.read_bytes().decode(errors="replace"))
        for t in tokens:
            assert all(t not in s for s in seen), f"a secret is visible in {p['name']}'s command line or environment"
    assert not any(t in stack_json for t in tokens)
    password = tokens[2].encode()
    for proc in Path("/proc").iterdir():  # what `ps` shows any local user: every process's command line
        try:
            cmdline = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
        except OSError:  # exited meanwhile, or not ours to read
            continue
        assert password not in cmdline, f"the Redis password is on the command line of pid {proc.name}"
    logs = sorted((stack.run_dir / "logs").iterdir())
    assert {p["name"] for p in stack.info["processes"]} <= {log.stem for log in logs}
    for log in logs:
        assert password not in log.read_bytes(), f"the Redis password is in {log}"


def test_redis_refuses_a_client_without_the_generated_password(stack):
    port = stack.process("redis")["port"]
    with socket.create_connection(("127.0.0.1", port), timeout=T) as raw:  # what any local process can send
        raw.sendall(b"GET fp8rl:anything\r\n")
        assert raw.recv(256).startswith(b"-NOAUTH "), "Redis answered a client without the password"
        raw.sendall(b"AUTH not-the-password\r\n")
        assert raw.recv(256).startswith(b"-WRONGPASS ")
    authed = redis.Redis.from_url(stack.redis_url)
    assert authed.config_get("requirepass")["requirepass"] == _redis_password(stack)
    assert stack.refit().latest() is not None  # the coordination keys, read with the password


def test_a_service_with_a_wrong_or_missing_redis_password_stops_at_start_naming_the_setting(stack, tmp_path):
    port = stack.process("redis")["port"]
    wrong = tmp_path / "wrong.url"
    wrong.write_text(f"redis://:not-the-password@127.0.0.1:{port}/0\n")
    job = tmp_path / "job.yaml"
    job.write_text("job:\n  name: redis-auth\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")}
    common = ["--port", "0", "--host", "127.0.0.1", "--config", str(job)]
    # (flags, what the last line of stderr must say); the reward role would otherwise serve without Redis
    refused = "refused authentication"
    cases = [(["--redis-url-file", str(wrong)], [refused, f"redis://:***@127.0.0.1:{port}/0",
                                                 f"given by --redis-url-file {wrong}"]),
             (["--redis-url", f"redis://127.0.0.1:{port}/0"], [refused, "given by --redis-url (or $FP8RL_REDIS_URL)"]),
             (["--redis-url-file", str(tmp_path / "none.url")], [f"--redis-url-file '{tmp_path / 'none.url'}' does "
                                                                  "not exist"])]
    procs = [subprocess.Popen([sys.executable, "-m", "services.reward", *common, *flags], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for flags, _ in cases]  # at once: each imports torch
    for (flags, expected), proc in zip(cases, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (flags, err[-2000:])
        assert "Traceback" not in out + err and "not-the-password" not in out + err, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert all(e in last for e in expected), (expected, last)


def test_no_token_is_unauthenticated_and_health_stays_open(stack):
    latest = stack.refit().latest() or 0  # a real version to ask for
    for rpc, (proc, call) in _internal_calls(latest).items():
        with make_channel(_target(stack, proc), token="", tls_ca="") as ch:
            code, details = _code(call, ch)
            assert code == UNAUTH and "missing bearer token" in details, (rpc, code, details)
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
    with make_channel(stack.target, token="", tls_ca="") as ch:
        for rpc, call in _job_calls().items():
            assert _code(call, ch)[0] == UNAUTH, rpc
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with make_channel(stack.target, token="not-the-token", tls_ca="") as ch:
        code, details = _code(_job_calls()["ListJobs"], ch)
        assert code == UNAUTH and "invalid bearer token" in details


def test_the_client_token_cannot_call_internal_rpcs_and_changes_nothing(stack):
    latest = _trainer_version(stack)
    redis_before, files_before = _redis_state(stack), _files(stack.run_dir / "checkpoints")
    for rpc, (proc, call) in _internal_calls(latest).items():
        with make_channel(_target(stack, proc), token=stack.client_token, tls_ca="") as ch:
            code, details = _code(call, ch)
            assert code == DENIED, (rpc, code, details)
            assert "needs the service token" in details and "client token only grants" in details, details
            assert stack.client_token not in details
    assert _trainer_version(stack) == latest  # no forged step trained
    assert _redis_state(stack) == redis_before  # no version published, no scales stored, no event
    assert _files(stack.run_dir / "checkpoints") == files_before


def test_the_service_token_is_refused_on_the_job_service(stack):
    with make_channel(stack.target, token=stack.service_token, tls_ca="") as ch:
        for rpc, call in _job_calls().items():
            code, details = _code(call, ch)
            assert code == DENIED and "needs the client token" in details, (rpc, details)
    with Fp8rlClient(stack.target, token=stack.service_token, tls_ca="", timeout_s=T) as c:
        with pytest.raises(PermissionDenied, match="needs the client token"):
            c.list_jobs()
    with Fp8rlClient(stack.target, token="", tls_ca="", timeout_s=T) as c:
        with pytest.raises(Unauthenticated, match="missing bearer token"):
            c.list_jobs()


def test_the_sdk_with_the_client_token_file_submits_and_lists_and_the_services_serve_the_service_token(stack):
    with Fp8rlClient(stack.target, token_file=stack.info["secrets"]["client_token_file"], tls_ca="",
                     timeout_s=T) as c:
        job_id = c.submit_job(stack.job_yaml(steps=1), job_id=f"sdk-{time.monotonic_ns()}")
        steps = [r.step for r in c.watch(job_id, timeout_s=240)]
        final = c.get_job(job_id)
        assert (final.state, steps) == ("succeeded", [0]), final.error  # the controller's service-token calls work
        assert job_id in [j.job_id for j in c.list_jobs()]
    latest = _trainer_version(stack)
    for rpc in ("TrainerStatus", "GetManifest", "StreamShards", "Generate", "RolloutStatus", "Score"):
        proc, call = _internal_calls(latest)[rpc]
        with make_channel(_target(stack, proc), token=stack.service_token, tls_ca="") as ch:
            code, details = _code(call, ch)
            assert code == grpc.StatusCode.OK, (rpc, code, details)


def test_save_checkpoint_takes_a_name_never_a_path(stack, tmp_path):
    checkpoints = (stack.run_dir / "checkpoints").resolve()
    outside = stack.run_dir.parent  # the test's directory: model, job file, run dir
    files_before = _files(outside)
    version = _trainer_version(stack)
    refused = [trainer_pb2.SaveCheckpointRequest(name=n) for n in ("../x", "/abs", "a/b", "..", "x" * 65, ".env")]
    refused += [trainer_pb2.SaveCheckpointRequest(path=p) for p in ("../somewhere", str(tmp_path / "abs"), ".")]
    with make_channel(_target(stack, "trainer"), token=stack.service_token, tls_ca="") as ch:
        trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
        for req in refused:
            with pytest.raises(grpc.RpcError) as err:
                trainer.SaveCheckpoint(req, timeout=T)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, err.value.details())
            assert ("name:" in err.value.details()) != bool(req.path), err.value.details()
        assert _files(outside) == files_before and list(tmp_path.iterdir()) == []
        assert not Path("/abs.pt").exists() and not Path("/abs").exists()
        ck = trainer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(name="best"), timeout=T)
        assert (Path(ck.path), ck.file, ck.version) == (checkpoints, "best.pt", version)
        assert (checkpoints / "best.pt").is_file()
        assert _files(outside) - files_before == {str((stack.run_dir / "checkpoints" / "best.pt").relative_to(outside))}
        assert trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=T).ready


def _run_service(role: str, *argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")}
    return subprocess.run([sys.executable, "-m", f"services.{role}", "--port", "0", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("role", "argv", "scope"), [
    ("reward", (), "service"),
    ("calibrator", (), "service"),
    ("controller", ("--service-token", "only-the-service-token"), "client"),
])
def test_listening_off_loopback_without_a_token_refuses_to_start(role, argv, scope, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("job:\n  name: open-listen\n")
    res = _run_service(role, "--host", "0.0.0.0", "--config", str(job), *argv)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"refusing to listen on '0.0.0.0' (not a loopback address) without the {scope} token" in res.stderr
    assert f"--{scope}-token-file" in res.stderr and "--insecure" in res.stderr


def test_insecure_allows_an_open_listener(tmp_path, redis_url):
    ready, job = tmp_path / "ready.json", tmp_path / "job.yaml"
    job.write_text("job:\n  name: insecure-listen\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")}
    proc = subprocess.Popen([sys.executable, "-m", "services.reward", "--port", "0", "--host", "0.0.0.0",
                             "--insecure", "--ready-file", str(ready), "--config", str(job), "--redis-url", redis_url],
                            cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the --insecure reward service did not start"
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        with make_channel(f"127.0.0.1:{port}", token="", tls_ca="") as ch:  # open on purpose
            got = reward_pb2_grpc.RewardServiceStub(ch).Score(
                reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response="4", answer="4", grader="exact_match")]),
                timeout=T)
            assert list(got.rewards) == [1.0]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert "--insecure: listening on 0.0.0.0 with no service token" in out
