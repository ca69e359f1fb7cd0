"""fp8rl.rpc.guard over real loopback gRPC: malformed bytes are INVALID_ARGUMENT, long calls never starve health."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fp8rl.rpc import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from fp8rl.rpc.channel import make_channel
from fp8rl.rpc.guard import GateLimits, is_light, request_limit
from fp8rl.rpc.server import build_server, set_serving

SERVING = health_pb2.HealthCheckResponse.SERVING


class SlowRewards(reward_pb2_grpc.RewardServiceServicer):
    """Score blocks until released (a long call holding its worker)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running = 0
        self._lock = threading.Lock()

    def Score(self, request, context):
        with self._lock:
            self.running += 1
        try:
            self.release.wait(30)
            return reward_pb2.ScoreResponse(rewards=[1.0] * len(request.items))
        finally:
            with self._lock:
                self.running -= 1


class StreamingRollout(rollout_pb2_grpc.RolloutServiceServicer):
    def Generate(self, request, context):
        for i in range(len(request.prompts)):
            yield rollout_pb2.GenerateResponse(request_id=request.request_id,
                                               sample=rollout_pb2.Sample(prompt_index=i))

    def Status(self, request, context):
        return rollout_pb2.RolloutStatusResponse(replica_id="r0")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for var in ("FP8RL_AUTH_TOKEN", "FP8RL_TLS_CERT", "FP8RL_TLS_KEY", "FP8RL_TLS_CA"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def served():
    slow, roll = SlowRewards(), StreamingRollout()
    server, health, port = build_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, slow),
                                         (rollout_pb2_grpc.add_RolloutServiceServicer_to_server, roll)],
                                        port=0, host="127.0.0.1", max_workers=4, reserved_workers=2)
    server.start()
    set_serving(health, True)
    ch = make_channel(f"127.0.0.1:{port}", token="", tls_ca="")
    yield slow, ch
    slow.release.set()
    ch.close()
    server.stop(None)


def _raw(ch, method: str, data: bytes, streaming: bool = False):
    if streaming:
        return list(ch.unary_stream(method)(data, timeout=5))
    return ch.unary_unary(method)(data, timeout=5)


def test_malformed_bytes_are_invalid_argument_not_internal(served):
    _, ch = served
    for method, streaming in (("/fp8rl.v1.RewardService/Score", False), ("/fp8rl.v1.RolloutService/Generate", True),
                              ("/fp8rl.v1.RolloutService/Status", False)):
        with pytest.raises(grpc.RpcError) as err:
            _raw(ch, method, b"\xff\xff\xff\xff", streaming)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert method in err.value.details() and "malformed request" in err.value.details()


def test_well_formed_bytes_still_reach_the_handler(served):
    _, ch = served
    req = rollout_pb2.GenerateRequest(request_id="x", prompts=[rollout_pb2.Prompt(token_ids=[1])] * 3)
    got = _raw(ch, "/fp8rl.v1.RolloutService/Generate", req.SerializeToString(), streaming=True)
    assert [rollout_pb2.GenerateResponse.FromString(b).sample.prompt_index for b in got] == [0, 1, 2]
    status = rollout_pb2.RolloutStatusResponse.FromString(_raw(ch, "/fp8rl.v1.RolloutService/Status", b""))
    assert status.replica_id == "r0"


def test_long_calls_beyond_the_cap_are_refused_and_health_and_status_still_answer(served):
    slow, ch = served
    stub = reward_pb2_grpc.RewardServiceStub(ch)
    with ThreadPoolExecutor(4) as ex:
        held = [ex.submit(stub.Score, reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem()]), timeout=30)
                for _ in range(2)]
        deadline = time.monotonic() + 10
        while slow.running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow.running == 2  # 4 workers - 2 reserved: both long calls run
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(reward_pb2.ScoreRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "busy" in err.value.details()
        for _ in range(5):  # the reserved workers answer health and Status at once
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING
            rollout_pb2_grpc.RolloutServiceStub(ch).Status(rollout_pb2.RolloutStatusRequest(), timeout=2)
        assert time.monotonic() - t0 < 3
        slow.release.set()
        assert all(list(f.result().rewards) == [1.0] for f in held)
    assert stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem()]), timeout=5).rewards == [1.0]


def test_light_methods_and_bad_limits():
    assert is_light("/grpc.health.v1.Health/Check") and is_light("/fp8rl.v1.TrainerService/Status")
    assert is_light("/fp8rl.v1.JobService/GetJob") and not is_light("/fp8rl.v1.JobService/WatchJob")
    assert not is_light("/fp8rl.v1.RolloutService/Generate")
    with pytest.raises(ValueError, match="long_calls must be >= 1, got 0"):
        GateLimits(long_calls=0, light_calls=1)
    with pytest.raises(ValueError, match="first_message_s must be > 0"):
        GateLimits(long_calls=1, light_calls=1, first_message_s=0)
    # the batch-carrying RPCs take the bulk limit; a job YAML fits SubmitJob; everything else is small
    assert request_limit("/fp8rl.v1.TrainerService/TrainStep", 123) == 123
    assert request_limit("/fp8rl.v1.JobService/SubmitJob", 123) > 64 * 1024
    assert request_limit("/fp8rl.v1.JobService/ListJobs", 1 << 30) == 64 * 1024
