"""Rollout replicas as a Ray Serve application (services/rollout/serve_app.py), refitted by the real protocol.

A local Ray cluster runs 2 Serve replicas of the embedded torch engine, each a refit subscriber with its
own lease; a real trainer and calibrator (processes) and a real redis-server drive them: Calibrate(0) → both
serve v0; TrainStep → v1 published; Calibrate(1) → both refit to v1 and serve it, over gRPC (their leases'
endpoints) and through the Serve handle. ``make test-ray`` (about 30 s of Ray start and 1.2 GB).
"""

from __future__ import annotations

import os
import time

import grpc
import pytest

from fp8rl.refit import RefitStore, connect
from fp8rl.rpc import (
    calibrator_pb2,
    calibrator_pb2_grpc,
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from fp8rl.rpc.channel import make_channel

pytestmark = [pytest.mark.ray, pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # Ray's own pydantic-v1 idioms

REPLICAS = 2
PREFIX = "serve-rollout"
PROMPTS = [[1, 20, 21, 22], [1, 30, 31]]
T = 60.0


def wait_until(pred, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(spawner, tiny_checkpoint, module_job_id, redis_url, write_job, tmp_path_factory):
    import ray  # the ray extra (make test-ray installs it); imported here so collection never needs it
    from ray import serve

    from services.rollout.serve_app import deployment

    tmp = tmp_path_factory.mktemp("serve")
    cfg = write_job(tmp / "job.yaml", tiny_checkpoint, module_job_id)
    trainer = spawner.start("trainer", cfg, "trainer-0", "--checkpoint-dir", str(tmp / "ckpt"))
    calibrator = spawner.start("calibrator", cfg, "calibrator-0")
    os.environ["FP8RL_TORCH_THREADS"] = "1"  # Ray workers inherit the driver's environment
    ray.init(num_cpus=REPLICAS + 2, include_dashboard=False, log_to_driver=True, configure_logging=False,
             object_store_memory=80 * 1024 * 1024)
    try:
        serve.start(proxy_location="Disabled")
        flags = f"--config {cfg} --redis-url {redis_url} --job-id {module_job_id} --host 127.0.0.1 " \
                f"--advertise-host 127.0.0.1 --lease-ttl 3"
        handle = serve.run(deployment(REPLICAS, num_cpus=0.5).bind(flags, PREFIX), name="rollout",
                           route_prefix=None)
        for p in (trainer, calibrator):
            p.wait_listening()
        yield handle, trainer, calibrator, RefitStore(connect(redis_url), module_job_id)
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("FP8RL_TORCH_THREADS", None)


def serve_leases(store: RefitStore) -> dict:
    return {rid: lease for rid, lease in store.live_replicas().items() if rid.startswith(PREFIX)}


def statuses(store: RefitStore) -> dict[str, rollout_pb2.RolloutStatusResponse]:
    out = {}
    for rid, lease in serve_leases(store).items():
        with make_channel(lease.endpoint, token="", tls_ca="") as ch:
            out[rid] = rollout_pb2_grpc.RolloutServiceStub(ch).Status(rollout_pb2.RolloutStatusRequest(), timeout=10)
    return out


def all_at(store: RefitStore, version: int):
    st = statuses(store)
    ok = len(st) == REPLICAS and all(s.ready and s.weight_version == version == s.scales_version
                                     for s in st.values())
    return ok and st


def test_two_serve_replicas_refit_to_a_new_version_and_both_serve_it(cluster):
    handle, trainer, calibrator, store = cluster
    leases = wait_until(lambda: len(serve_leases(store)) == REPLICAS and serve_leases(store), "2 Serve leases")
    assert len({lease.endpoint for lease in leases.values()}) == REPLICAS  # each replica its own gRPC server

    with make_channel(trainer.target, token="", tls_ca="") as tch, \
            make_channel(calibrator.target, token="", tls_ca="") as cch:
        train, cal = trainer_pb2_grpc.TrainerServiceStub(tch), calibrator_pb2_grpc.CalibratorServiceStub(cch)
        wait_until(lambda: store.latest() == 0, "the trainer to publish v0")
        seqs = [common_pb2.TokenSequence(token_ids=p) for p in PROMPTS]
        cal.Calibrate(calibrator_pb2.CalibrateRequest(version=0, sequences=seqs), timeout=T)
        wait_until(lambda: all_at(store, 0), "both Serve replicas at v0")

        # one GRPO-shaped step: sample at v0 on one replica, train on it → v1, calibrate v1
        endpoint = next(iter(leases.values())).endpoint
        with make_channel(endpoint, token="", tls_ca="") as rch:
            req = rollout_pb2.GenerateRequest(request_id="serve", weight_version=0,
                                              prompts=[rollout_pb2.Prompt(token_ids=p) for p in PROMPTS],
                                              sampling=rollout_pb2.SamplingParams(max_tokens=6, n=2, seed=5))
            samples = [r.sample for r in rollout_pb2_grpc.RolloutServiceStub(rch).Generate(req, timeout=T)]
        rows = [trainer_pb2.Sequence(prompt_ids=PROMPTS[s.prompt_index], response_ids=s.token_ids,
                                     gen_logprobs=s.logprobs, advantage=a)
                for s, a in zip(samples, [1.0, -1.0, 0.5, -0.5], strict=True)]
        resp = train.TrainStep(trainer_pb2.TrainStepRequest(expected_version=0, rows=rows, step=0), timeout=T)
        assert resp.new_version == 1 and store.latest() == 1
        # v1 without its scales is never applied: wait until both replicas have seen v1 (each names it as pending,
        # or wrongly applied it), then check each defers it for exactly that reason and still serves v0
        seen = wait_until(lambda: len(st := statuses(store)) == REPLICAS and all(
            s.pending_version == 1 or s.weight_version != 0 for s in st.values()) and st, "both replicas to see v1")
        assert all((s.weight_version, s.pending_version, s.pending_reason) == (0, 1, "awaiting_scales")
                   for s in seen.values()), seen
        seqs = [common_pb2.TokenSequence(token_ids=list(r.prompt_ids) + list(r.response_ids)) for r in rows]
        cal.Calibrate(calibrator_pb2.CalibrateRequest(version=1, sequences=seqs), timeout=T)

    wait_until(lambda: all_at(store, 1), "both Serve replicas refitted to v1")
    assert set(serve_leases(store)) <= store.acks(1)
    assert {lease.version for lease in serve_leases(store).values()} == {1}

    # over gRPC: each replica serves v1 and refuses v0
    for rid, lease in serve_leases(store).items():
        with make_channel(lease.endpoint, token="", tls_ca="") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            req = rollout_pb2.GenerateRequest(request_id=rid, weight_version=1,
                                              prompts=[rollout_pb2.Prompt(token_ids=PROMPTS[0])],
                                              sampling=rollout_pb2.SamplingParams(max_tokens=4, n=1))
            assert all(r.sample.weight_version == 1 for r in stub.Generate(req, timeout=T))
            req.weight_version = 0
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, timeout=T))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # through the Serve handle: requests spread over both replicas, each answering at v1
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while len(seen) < REPLICAS and time.monotonic() < deadline:
        calls = [handle.generate.remote([PROMPTS[1]], 1, max_tokens=4) for _ in range(4)]
        for out in (c.result(timeout_s=T) for c in calls):
            seen[out["replica_id"]] = {s["weight_version"] for s in out["samples"]}.pop()
    assert seen == {rid: 1 for rid in serve_leases(store)}, seen
