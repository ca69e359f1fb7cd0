"""fp8rl.metrics: RPC counts by final status code over real loopback gRPC, the report → gauges mapping, and
the /metrics exporter (a real HTTP scrape, parsed by prometheus_client's own parser)."""

from __future__ import annotations

import math
import urllib.request

import grpc
import pytest
from prometheus_client import generate_latest

from fp8rl.metrics import ServiceMetrics, parse_metrics, scrape, serve_metrics
from fp8rl.rpc import controller_pb2, controller_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from fp8rl.rpc.channel import make_channel
from fp8rl.rpc.server import ScopedTokens, build_server

T = 5.0


class Jobs(controller_pb2_grpc.JobServiceServicer):
    def ListJobs(self, request, context):
        if request.state == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad state")
        if request.state == "boom":
            raise RuntimeError("a bug")
        return controller_pb2.ListJobsResponse()


class Rollout(rollout_pb2_grpc.RolloutServiceServicer):
    def Generate(self, request, context):  # a response stream
        yield rollout_pb2.GenerateResponse(request_id=request.request_id)
        if request.request_id == "fail-mid-stream":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "half way")
        yield rollout_pb2.GenerateResponse(request_id=request.request_id)


def _samples(m: ServiceMetrics) -> dict:
    return parse_metrics(generate_latest(m.registry).decode())


@pytest.fixture
def served(monkeypatch):
    for var in ("FP8RL_AUTH_TOKEN", "FP8RL_TLS_CERT", "FP8RL_TLS_KEY", "FP8RL_TLS_CA"):
        monkeypatch.delenv(var, raising=False)
    m = ServiceMetrics("test")
    server, _health, port = build_server(
        [(controller_pb2_grpc.add_JobServiceServicer_to_server, Jobs()),
         (rollout_pb2_grpc.add_RolloutServiceServicer_to_server, Rollout())],
        port=0, host="127.0.0.1", scoped_tokens=ScopedTokens(service="svc-tok", client="cli-tok"),
        observer=m.observe_rpc)
    server.start()
    yield m, f"127.0.0.1:{port}"
    server.stop(None)


def _code(call) -> grpc.StatusCode:
    try:
        r = call()
        if not isinstance(r, controller_pb2.ListJobsResponse):
            list(r)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


def test_rpcs_are_counted_by_method_and_final_code_including_refused_ones(served):
    m, target = served
    jobs = controller_pb2_grpc.JobServiceStub(make_channel(target, token="cli-tok", tls_ca=""))
    anon = controller_pb2_grpc.JobServiceStub(make_channel(target, token="", tls_ca=""))
    gen = rollout_pb2_grpc.RolloutServiceStub(make_channel(target, token="svc-tok", tls_ca=""))
    codes = [_code(lambda: jobs.ListJobs(controller_pb2.ListJobsRequest(), timeout=T)),
             _code(lambda: jobs.ListJobs(controller_pb2.ListJobsRequest(), timeout=T)),
             _code(lambda: jobs.ListJobs(controller_pb2.ListJobsRequest(state="bad"), timeout=T)),
             _code(lambda: jobs.ListJobs(controller_pb2.ListJobsRequest(state="boom"), timeout=T)),
             _code(lambda: anon.ListJobs(controller_pb2.ListJobsRequest(), timeout=T)),
             _code(lambda: gen.Generate(rollout_pb2.GenerateRequest(request_id="ok"), timeout=T)),
             _code(lambda: gen.Generate(rollout_pb2.GenerateRequest(request_id="fail-mid-stream"), timeout=T))]
    assert [c.name for c in codes] == ["OK", "OK", "INVALID_ARGUMENT", "UNKNOWN", "UNAUTHENTICATED", "OK",
                                       "FAILED_PRECONDITION"]
    s = _samples(m)
    count = {labels: v for (name, labels), v in s.items() if name == "fp8rl_rpc_requests_total"}
    assert count == {(("code", "OK"), ("method", "JobService/ListJobs")): 2,
                     (("code", "INVALID_ARGUMENT"), ("method", "JobService/ListJobs")): 1,
                     (("code", "UNKNOWN"), ("method", "JobService/ListJobs")): 1,
                     (("code", "UNAUTHENTICATED"), ("method", "JobService/ListJobs")): 1,
                     (("code", "OK"), ("method", "RolloutService/Generate")): 1,
                     (("code", "FAILED_PRECONDITION"), ("method", "RolloutService/Generate")): 1}
    assert s[("fp8rl_rpc_seconds_count", (("method", "JobService/ListJobs"),))] == 5
    assert s[("fp8rl_rpc_seconds_count", (("method", "RolloutService/Generate"),))] == 2


def test_a_step_report_sets_the_gauges_and_adds_to_the_phase_totals():
    m = ServiceMetrics("controller")
    report = {"step": 3, "reward_mean": 0.25, "accuracy": 0.5,
              "metrics": {"token_mult_prob_error": 1.0125, "weight_lag_mean": 0.5, "num_tokens": 120.0},
              "phase_times": {"rollout": 2.0, "train": 1.5, "outage": 0.0}}
    m.observe_report(report)
    m.observe_report({**report, "step": 4, "accuracy": math.nan, "metrics": {}, "phase_times": {"rollout": 1.0}})
    s = _samples(m)
    assert s[("fp8rl_steps_total", ())] == 2 and s[("fp8rl_step", ())] == 4
    assert s[("fp8rl_accuracy", ())] == 0.5  # a NaN leaves the last finite value
    assert s[("fp8rl_token_mult_prob_error", ())] == 1.0125 and s[("fp8rl_policy_lag_versions", ())] == 0.5
    assert s[("fp8rl_tokens_per_second", ())] == 60.0  # from the step that had both: 120 tokens / 2 s
    assert s[("fp8rl_last_step_phase_seconds", (("phase", "rollout"),))] == 1.0
    assert s[("fp8rl_step_phase_seconds_total", (("phase", "rollout"),))] == 3.0


def test_refits_and_generation_add_up_and_both_directions_exist_from_the_start():
    m = ServiceMetrics("rollout")
    s = _samples(m)
    for direction in ("publish", "apply"):
        assert s[("fp8rl_refits_total", (("direction", direction),))] == 0
    assert s[("fp8rl_weight_version", ())] == -1
    m.observe_refit("apply", 1, 1000, 0.5)
    m.observe_refit("apply", 2, 24, 0.25)
    m.observe_generation(40, 2.0)
    s = _samples(m)
    assert s[("fp8rl_refits_total", (("direction", "apply"),))] == 2
    assert s[("fp8rl_refit_bytes_total", (("direction", "apply"),))] == 1024
    assert s[("fp8rl_refit_seconds_total", (("direction", "apply"),))] == 0.75
    assert s[("fp8rl_weight_version", ())] == 2 and s[("fp8rl_generated_tokens_total", ())] == 40


def test_the_exporter_serves_metrics_over_http_and_refuses_a_taken_port():
    m = ServiceMetrics("reward")
    m.graded.inc(7)
    srv = serve_metrics(m, 0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=T) as r:
            text = r.read().decode()
        assert "fp8rl_graded_total 7.0" in text.splitlines()
        assert scrape(srv.port)[("fp8rl_graded_total", ())] == 7
        with pytest.raises(RuntimeError, match=f"could not serve metrics on 127.0.0.1:{srv.port}"):
            serve_metrics(ServiceMetrics("other"), srv.port, "127.0.0.1")
    finally:
        srv.close()


def test_a_validation_step_sets_the_validation_and_entropy_gauges():
    m = ServiceMetrics("controller")
    m.observe_report({"step": 1, "metrics": {"val_accuracy": 0.25, "val/pass@1": 0.2, "val/pass@4": 0.6,
                                             "val/mean@4": 0.2, "train/entropy": 0.75}, "phase_times": {}})
    m.observe_report({"step": 2, "metrics": {"train/entropy": 0.5}, "phase_times": {}})  # no validation this step
    s = _samples(m)
    assert s[("fp8rl_validation", (("metric", "accuracy"),))] == 0.25
    assert s[("fp8rl_validation", (("metric", "pass@4"),))] == 0.6
    assert s[("fp8rl_validation", (("metric", "mean@4"),))] == 0.2
    assert s[("fp8rl_policy_entropy", ())] == 0.5
