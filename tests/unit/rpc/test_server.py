"""build_server / make_channel plumbing over real loopback gRPC: health, auth, limits, reflection, TLS."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fp8rl.rpc import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from fp8rl.rpc.channel import DEFAULT_DEADLINE_S, make_channel, wait_ready
from fp8rl.rpc.server import build_server, set_serving

MiB = 1024 * 1024
TOKEN = "s3cret-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class LengthRewards(reward_pb2_grpc.RewardServiceServicer):
    """Plumbing stand-in: reward = len(response) (no grading logic)."""

    def Score(self, request, context):
        return reward_pb2.ScoreResponse(
            rewards=[float(len(item.response)) for item in request.items], errors=[""] * len(request.items)
        )


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for var in ("FP8RL_AUTH_TOKEN", "FP8RL_TLS_CERT", "FP8RL_TLS_KEY", "FP8RL_TLS_CA"):
        monkeypatch.delenv(var, raising=False)


def _serve(**kwargs):
    server, health, port = build_server(
        [(reward_pb2_grpc.add_RewardServiceServicer_to_server, LengthRewards())], port=0, **kwargs
    )
    server.start()
    return server, health, port


@pytest.fixture
def plain():
    server, health, port = _serve()
    yield health, port
    server.stop(None)


@pytest.fixture
def authed():
    server, health, port = _serve(token=TOKEN)
    yield health, port
    server.stop(None)


def _score(channel, responses, **kwargs):
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    request = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response=r, answer="4") for r in responses])
    return stub.Score(request, timeout=DEFAULT_DEADLINE_S.score, **kwargs)


def _health(channel, service=""):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=DEFAULT_DEADLINE_S.health).status


def test_ephemeral_port_and_a_call(plain):
    _, port = plain
    assert port > 0
    with make_channel(f"127.0.0.1:{port}") as ch:
        wait_ready(ch, 5)
        assert list(_score(ch, ["a", "bbb"]).rewards) == [1.0, 3.0]


def test_health_starts_not_serving_then_flips(plain):
    health, port = plain
    assert health.service_names == ("fp8rl.v1.RewardService",)
    with make_channel(f"127.0.0.1:{port}") as ch:
        assert _health(ch) == NOT_SERVING
        assert _health(ch, "fp8rl.v1.RewardService") == NOT_SERVING
        set_serving(health, True)
        assert _health(ch) == SERVING
        assert _health(ch, "fp8rl.v1.RewardService") == SERVING
        set_serving(health, False)
        assert _health(ch, "fp8rl.v1.RewardService") == NOT_SERVING


def test_token_required_but_health_open(authed):
    health, port = authed
    set_serving(health, True)
    target = f"127.0.0.1:{port}"
    with make_channel(target) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            _score(anonymous, ["x"])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing bearer token" in err.value.details()
        assert _health(anonymous) == SERVING  # k8s probes send no metadata
    with make_channel(target, token="wrong") as wrong:
        with pytest.raises(grpc.RpcError) as err:
            _score(wrong, ["x"])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "invalid bearer token" in err.value.details() and TOKEN not in err.value.details()
    with make_channel(target, token=TOKEN) as good:
        assert list(_score(good, ["xy"]).rewards) == [2.0]


def _stalled(channel, method: str, streaming: bool = False):
    """A call that sends its headers and never its request message; ``release`` ends the request stream."""
    import threading

    release = threading.Event()

    def never():
        release.wait(30)
        return
        yield b""

    if streaming:
        return channel.stream_stream(method)(never(), timeout=10), release
    return channel.stream_unary(method).future(never(), timeout=10), release


def test_health_without_a_token_is_answered_without_its_message(authed):
    """No token: Check gets the server's overall status at once, its message never read — a stalled one ends at
    once, an oversized one is answered, neither waits among the gate's calls; an unknown service name cannot be
    told (the name is in the unread message). With the token, the standard protocol: the name is read, an unknown
    one is NOT_FOUND. Watch keeps a stream open, so it needs a token."""
    health, port = authed
    set_serving(health, True)
    target = f"127.0.0.1:{port}"
    with make_channel(target, token="") as anonymous:
        call, release = _stalled(anonymous, "/grpc.health.v1.Health/Check")
        try:
            reply = health_pb2.HealthCheckResponse.FromString(call.result(timeout=2))  # no message was ever sent
        finally:
            release.set()
        assert reply.status == SERVING
        check = anonymous.unary_unary("/grpc.health.v1.Health/Check")
        big = health_pb2.HealthCheckRequest(service="x" * (2 * MiB)).SerializeToString()  # past every small limit
        assert health_pb2.HealthCheckResponse.FromString(check(big, timeout=5)).status == SERVING
        assert _health(anonymous, "fp8rl.v1.NoSuchService") == SERVING  # the overall status, whatever is asked
        watch = health_pb2_grpc.HealthStub(anonymous).Watch(health_pb2.HealthCheckRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            next(watch)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Check is open" in err.value.details()
    with make_channel(target, token=TOKEN) as good:
        with pytest.raises(grpc.RpcError) as err:
            _health(good, "fp8rl.v1.NoSuchService")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health_pb2_grpc.HealthStub(good).Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert next(watch).status == SERVING
        watch.cancel()
        # the token's health is read through the gate: a stalled one waits for its message (then the deadline)
        call, release = _stalled(good, "/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.FutureTimeoutError):
            call.result(timeout=0.5)
        release.set()
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the request stream ended without a message


def test_reflection_without_a_token_is_refused_before_its_stream_is_read(authed):
    _, port = authed
    with make_channel(f"127.0.0.1:{port}", token="") as anonymous:
        stream, release = _stalled(anonymous, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                   streaming=True)
        try:
            with pytest.raises(grpc.RpcError) as err:
                next(stream)  # refused from the metadata while the request stream is still open
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            release.set()


def test_health_without_tokens_configured_is_the_standard_protocol(plain):
    health, port = plain
    set_serving(health, True)
    with make_channel(f"127.0.0.1:{port}", token="") as ch:
        with pytest.raises(grpc.RpcError) as err:
            _health(ch, "fp8rl.v1.NoSuchService")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_token_from_env(authed, monkeypatch):
    _, port = authed
    monkeypatch.setenv("FP8RL_AUTH_TOKEN", TOKEN)
    with make_channel(f"127.0.0.1:{port}") as ch:
        assert list(_score(ch, ["abc"]).rewards) == [3.0]
    with make_channel(f"127.0.0.1:{port}", token="") as ch:  # "" overrides the env: no token
        with pytest.raises(grpc.RpcError) as err:
            _score(ch, ["abc"])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_message_limits():
    server, _, port = _serve(max_message_bytes=8 * MiB)
    try:
        with make_channel(f"127.0.0.1:{port}") as ch:
            # Above gRPC's 4 MiB default, below the configured limit: passes.
            assert list(_score(ch, ["a" * (5 * MiB)]).rewards) == [float(5 * MiB)]
            with pytest.raises(grpc.RpcError) as err:
                _score(ch, ["a" * (9 * MiB)])
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(None)


def test_reflection_lists_services(authed):
    _, port = authed
    with make_channel(f"127.0.0.1:{port}", token=TOKEN) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = stub.ServerReflectionInfo(iter([request]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert names == {"fp8rl.v1.RewardService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


def test_wait_ready_names_the_target():
    # A port held bound but not listening: connections to it are refused, and no other socket can take it
    # meanwhile (a port freed by a stopped server may be reused by another listener, or by this client's own
    # ephemeral source port, a TCP self-connect that then looks like a server).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with make_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
                wait_ready(ch, 0.2)


def test_port_in_use_is_an_error(plain):
    _, port = plain
    with pytest.raises(RuntimeError, match=str(port)):
        build_server([], port=port)


def test_tls_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="TLS certificate file .*nope.pem"):
        build_server([], port=0, tls_cert=str(tmp_path / "nope.pem"), tls_key=str(tmp_path / "nope.key"))
    with pytest.raises(ValueError, match="key"):
        build_server([], port=0, tls_cert=str(tmp_path / "cert.pem"))
    with pytest.raises(FileNotFoundError, match="TLS CA file"):
        make_channel("127.0.0.1:1", tls_ca=str(tmp_path / "ca.pem"))


def test_tls_with_token(self_signed_cert, monkeypatch):
    cert, key = self_signed_cert
    monkeypatch.setenv("FP8RL_TLS_CERT", str(cert))
    monkeypatch.setenv("FP8RL_TLS_KEY", str(key))
    server, _, port = _serve(token=TOKEN)
    try:
        with make_channel(f"localhost:{port}", tls_ca=str(cert), token=TOKEN) as ch:
            assert list(_score(ch, ["tls"]).rewards) == [3.0]
        with make_channel(f"localhost:{port}") as plaintext:
            with pytest.raises(grpc.RpcError) as err:
                _score(plaintext, ["x"], wait_for_ready=False)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


class EchoRollout(rollout_pb2_grpc.RolloutServiceServicer):
    """Plumbing stand-in: one sample per prompt, echoing the prompt tokens."""

    def Generate(self, request, context):
        for i, prompt in enumerate(request.prompts):
            sample = rollout_pb2.Sample(
                prompt_index=i, token_ids=prompt.token_ids, weight_version=request.weight_version
            )
            yield rollout_pb2.GenerateResponse(request_id=request.request_id, sample=sample)


def test_server_streaming_rpc_with_auth():
    server, health, port = build_server(
        [
            (reward_pb2_grpc.add_RewardServiceServicer_to_server, LengthRewards()),
            (rollout_pb2_grpc.add_RolloutServiceServicer_to_server, EchoRollout()),
        ],
        port=0,
        token=TOKEN,
    )
    server.start()
    try:
        assert health.service_names == ("fp8rl.v1.RewardService", "fp8rl.v1.RolloutService")
        prompts = [rollout_pb2.Prompt(token_ids=[1, 2]), rollout_pb2.Prompt(token_ids=[3])]
        request = rollout_pb2.GenerateRequest(request_id="r1", prompts=prompts, weight_version=7)
        with make_channel(f"127.0.0.1:{port}") as anonymous:
            with pytest.raises(grpc.RpcError) as err:
                list(rollout_pb2_grpc.RolloutServiceStub(anonymous).Generate(request, timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with make_channel(f"127.0.0.1:{port}", token=TOKEN) as ch:
            out = list(rollout_pb2_grpc.RolloutServiceStub(ch).Generate(request, timeout=DEFAULT_DEADLINE_S.generate))
        assert [(r.request_id, list(r.sample.token_ids), r.sample.weight_version) for r in out] == [
            ("r1", [1, 2], 7),
            ("r1", [3], 7),
        ]
    finally:
        server.stop(None)
