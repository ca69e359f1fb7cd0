"""The two token scopes of build_server over real loopback gRPC, and how clients find their token."""

from __future__ import annotations

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fp8rl.rpc import controller_pb2, controller_pb2_grpc, reward_pb2, reward_pb2_grpc
from fp8rl.rpc.channel import make_channel, read_token_file, resolve_token
from fp8rl.rpc.server import SCOPE_CLIENT, SCOPE_SERVICE, ScopedTokens, build_server, rpc_scope, set_serving

SERVICE, CLIENT = "svc-token-0123", "cli-token-4567"
T = 5.0


class Jobs(controller_pb2_grpc.JobServiceServicer):
    def ListJobs(self, request, context):
        return controller_pb2.ListJobsResponse()


class Rewards(reward_pb2_grpc.RewardServiceServicer):
    def Score(self, request, context):
        return reward_pb2.ScoreResponse()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for var in ("FP8RL_AUTH_TOKEN", "FP8RL_TOKEN_FILE", "FP8RL_TLS_CERT", "FP8RL_TLS_KEY", "FP8RL_TLS_CA"):
        monkeypatch.delenv(var, raising=False)


def _serve(tokens: ScopedTokens):
    server, health, port = build_server(
        [(controller_pb2_grpc.add_JobServiceServicer_to_server, Jobs()),
         (reward_pb2_grpc.add_RewardServiceServicer_to_server, Rewards())],
        port=0, host="127.0.0.1", scoped_tokens=tokens)
    server.start()
    set_serving(health, True)
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def both():
    server, target = _serve(ScopedTokens(service=SERVICE, client=CLIENT))
    yield target
    server.stop(None)


def _calls(channel):
    """(name, call) for one RPC of each scope."""
    jobs, rewards = controller_pb2_grpc.JobServiceStub(channel), reward_pb2_grpc.RewardServiceStub(channel)
    return {SCOPE_CLIENT: lambda: jobs.ListJobs(controller_pb2.ListJobsRequest(), timeout=T),
            SCOPE_SERVICE: lambda: rewards.Score(reward_pb2.ScoreRequest(), timeout=T)}


def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_rpc_scopes():
    assert rpc_scope("/fp8rl.v1.JobService/SubmitJob") == SCOPE_CLIENT
    for m in ("/fp8rl.v1.TrainerService/TrainStep", "/fp8rl.v1.WeightStore/StreamShards",
              "/fp8rl.v1.RolloutService/Generate", "/fp8rl.v1.CalibratorService/Calibrate"):
        assert rpc_scope(m) == SCOPE_SERVICE
    assert rpc_scope("/grpc.health.v1.Health/Check") is None


@pytest.mark.parametrize(("token", "expected"), [
    (SERVICE, {SCOPE_SERVICE: grpc.StatusCode.OK, SCOPE_CLIENT: grpc.StatusCode.PERMISSION_DENIED}),
    (CLIENT, {SCOPE_SERVICE: grpc.StatusCode.PERMISSION_DENIED, SCOPE_CLIENT: grpc.StatusCode.OK}),
    ("", {SCOPE_SERVICE: grpc.StatusCode.UNAUTHENTICATED, SCOPE_CLIENT: grpc.StatusCode.UNAUTHENTICATED}),
    ("nope", {SCOPE_SERVICE: grpc.StatusCode.UNAUTHENTICATED, SCOPE_CLIENT: grpc.StatusCode.UNAUTHENTICATED}),
])
def test_each_scope_takes_only_its_token(both, token, expected):
    with make_channel(both, token=token) as ch:
        for scope, call in _calls(ch).items():
            code, details = _code(call)
            assert code == expected[scope], (scope, details)
            if code == grpc.StatusCode.PERMISSION_DENIED:  # names the scope needed, never a token
                assert f"needs the {scope} token" in details and SERVICE not in details and CLIENT not in details
            if token == "" and code != grpc.StatusCode.OK:
                assert "missing bearer token" in details
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=T)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # always open, whatever is sent


def test_a_scope_without_a_token_is_open_and_the_other_still_guarded():
    server, target = _serve(ScopedTokens(service=SERVICE, client=None))
    try:
        with make_channel(target, token="") as ch:
            calls = _calls(ch)
            assert _code(calls[SCOPE_CLIENT])[0] == grpc.StatusCode.OK
            assert _code(calls[SCOPE_SERVICE])[0] == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(None)


def test_equal_scoped_tokens_are_refused():
    with pytest.raises(ValueError, match="service token and the client token are equal"):
        build_server([], port=0, host="127.0.0.1", scoped_tokens=ScopedTokens(service="same", client="same"))


def test_the_one_token_form_opens_both_scopes():
    server, _, port = build_server([(controller_pb2_grpc.add_JobServiceServicer_to_server, Jobs()),
                                    (reward_pb2_grpc.add_RewardServiceServicer_to_server, Rewards())],
                                   port=0, host="127.0.0.1", token=SERVICE)
    server.start()
    try:
        with make_channel(f"127.0.0.1:{port}", token=SERVICE) as ch:
            assert all(_code(c)[0] == grpc.StatusCode.OK for c in _calls(ch).values())
    finally:
        server.stop(None)


def test_token_resolution_order(tmp_path, monkeypatch):
    f = tmp_path / "client.token"
    f.write_text(CLIENT + "\n")
    assert read_token_file(f) == CLIENT
    assert resolve_token() is None
    monkeypatch.setenv("FP8RL_TOKEN_FILE", str(f))
    assert resolve_token() == CLIENT  # the file when nothing else is set
    monkeypatch.setenv("FP8RL_AUTH_TOKEN", SERVICE)
    assert resolve_token() == SERVICE  # the variable before the file
    assert resolve_token(token_file=f) == CLIENT  # an explicit file before the variable
    assert resolve_token("") is None and resolve_token("x", f) == "x"
    monkeypatch.setenv("FP8RL_AUTH_TOKEN", "")
    assert resolve_token() is None  # set but empty: no token, the file is not read


@pytest.mark.parametrize(("content", "message"), [
    ("", "is empty"), ("two words", "whitespace inside the token"), ("x" * 5000, "larger than 4096 bytes")])
def test_a_bad_token_file_is_named(tmp_path, content, message):
    f = tmp_path / "t"
    f.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        read_token_file(f)
    assert str(f) in str(err.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_token_file(tmp_path / "missing")


def test_client_with_token_file_reaches_the_job_service(both, tmp_path):
    f = tmp_path / "client.token"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, CLIENT.encode())
    os.close(fd)
    with make_channel(both, token_file=f) as ch:
        assert _code(_calls(ch)[SCOPE_CLIENT])[0] == grpc.StatusCode.OK
