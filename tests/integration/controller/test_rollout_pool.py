"""RolloutPool against real Redis leases, with stub doubles for the replicas (the real path is test_chaos.py):
a replica failing UNAVAILABLE is suspect at once, its chunk re-issued, and it gets no work until it registers
again; only ``rollout`` leases are replicas."""

from __future__ import annotations

import grpc
import pytest

from fp8rl.controller.pool import RolloutPool
from fp8rl.refit import RefitStore, connect
from fp8rl.rpc import rollout_pb2

pytestmark = pytest.mark.integration


class _Down(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class _Replica:
    """A Generate double: one sample per prompt × n at the pinned version, or UNAVAILABLE while ``down``."""

    def __init__(self) -> None:
        self.down, self.calls = False, 0

    def Generate(self, req, timeout=None):  # noqa: N802 - the stub's name
        self.calls += 1
        if self.down:
            raise _Down()
        return [rollout_pb2.GenerateResponse(sample=rollout_pb2.Sample(
            prompt_index=p, sample_index=k, weight_version=req.weight_version, token_ids=[5]))
            for p in range(len(req.prompts)) for k in range(req.sampling.n)]


@pytest.fixture
def world(redis_url, job_id):
    store = RefitStore(connect(redis_url), job_id)
    replicas = {"a:1": _Replica(), "b:1": _Replica()}
    store.register_replica("a", "a:1", 3, ttl_s=30)
    store.register_replica("b", "b:1", 3, ttl_s=30)
    store.register_replica("cal", "c:1", 3, ttl_s=30, role="calibrator")  # never sent a Generate
    return store, replicas, RolloutPool(store, lambda ep: replicas[ep], attempts=3)


def _generate(pool, prompts=4):
    return pool.generate([[1, 2]] * prompts, 3, n=2, sampling={}, seed_of=lambda a: a, request_id="t", wait_s=5)


def test_unavailable_replica_is_suspect_and_its_chunk_reissued(world):
    store, replicas, pool = world
    replicas["a:1"].down = True
    out = _generate(pool)
    assert [(i, s.sample_index) for i, s in out] == [(i, k) for i in range(4) for k in range(2)]
    assert replicas["a:1"].calls == 1  # one failure, then no more work
    calls_b = replicas["b:1"].calls
    _generate(pool)
    assert replicas["a:1"].calls == 1 and replicas["b:1"].calls == calls_b + 1  # all of the next batch on b
    replicas["a:1"].down = False
    store.register_replica("a", "a:1", 3, ttl_s=30)  # restarted: a new registration is not suspect
    _generate(pool)
    assert replicas["a:1"].calls == 2


def test_only_rollout_leases_are_replicas(world):
    _, _, pool = world
    assert pool.replicas(3, wait_s=1) == ["a:1", "b:1"]
