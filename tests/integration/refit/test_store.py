"""RefitStore against a real redis-server: monotonic versions, scales, leases, acks, fencing, auth."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fp8rl.fp8 import QKVScales
from fp8rl.refit import (
    LeaseExpiredError,
    RefitConnectionError,
    RefitError,
    RefitStore,
    StaleVersionError,
    UnknownVersionError,
    build_shards,
    connect,
)

pytestmark = pytest.mark.integration

SD = {"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}


def manifest(job: str, version: int):
    return build_shards(SD, version, job=job, recipe="bf16", endpoint="trainer-0:50051")[0]


@pytest.fixture
def store(redis_url: str, job_id: str) -> RefitStore:
    return RefitStore(connect(redis_url), job_id)


def test_versions_only_increase(store: RefitStore):
    assert store.latest() is None and store.get_manifest(1) is None
    store.publish(manifest(store.job, 1))
    store.publish(manifest(store.job, 3))
    assert store.latest() == 3
    for stale in (3, 2):
        with pytest.raises(StaleVersionError, match=f"version {stale}: version 3 is already newer") as ei:
            store.publish(manifest(store.job, stale))
        assert (ei.value.version, ei.value.latest) == (stale, 3)
    assert store.latest() == 3 and store.get_manifest(2) is None  # a refused publish writes nothing
    assert store.get_manifest(3).version == 3
    assert [(e.type, e.version) for e in store.events()] == [("weights_published", 1), ("weights_published", 3)]
    with pytest.raises(ValueError, match="job 'other'"):
        store.publish(manifest("other", 4))


def test_concurrent_publishers_exactly_one_wins_per_version(redis_url: str, job_id: str):
    n_publishers, n_versions = 4, 12
    manifests = {v: manifest(job_id, v) for v in range(1, n_versions + 1)}
    wins: dict[int, list[int]] = {v: [] for v in manifests}
    observed: list[int] = []
    errors: list[BaseException] = []  # a thread's exception would otherwise vanish
    barrier = threading.Barrier(n_publishers)
    done = threading.Event()

    def publisher(idx: int) -> None:
        s = RefitStore(connect(redis_url), job_id)
        for v, m in manifests.items():
            barrier.wait(timeout=10)  # all publishers race on the same version at once
            try:
                s.publish(m)
                wins[v].append(idx)
            except StaleVersionError as exc:
                if exc.latest != v:
                    errors.append(exc)
            except BaseException as exc:
                errors.append(exc)

    def reader() -> None:
        s = RefitStore(connect(redis_url), job_id)
        while not done.is_set():
            observed.append(s.latest() or 0)

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(n_publishers)]
    rt = threading.Thread(target=reader)
    for t in [rt, *threads]:
        t.start()
    for t in threads:
        t.join(timeout=30)
    done.set()
    rt.join(timeout=5)
    assert errors == []
    assert {v: len(w) for v, w in wins.items()} == {v: 1 for v in manifests}, wins
    store = RefitStore(connect(redis_url), job_id)
    assert store.latest() == n_versions
    assert len(observed) > 1 and observed == sorted(observed), "weights:latest went backwards"
    assert [e.version for e in store.events(count=1000)] == list(manifests)  # one announcement per version


def test_scales_need_a_manifest_and_are_immutable(store: RefitStore):
    s1 = QKVScales(1, [0.5, 0.25], [0.125, 1.0], [2.0, 0.75])
    with pytest.raises(UnknownVersionError, match="no manifest for weight version 1"):
        store.put_scales(s1)
    store.publish(manifest(store.job, 1))
    assert store.get_scales(1) is None  # absent means None, never a 1.0 default
    eid = store.put_scales(s1)
    assert eid is not None
    assert store.get_scales(1) == s1
    assert store.put_scales(s1) is None  # identical re-put (a retried calibrator) is a no-op
    with pytest.raises(RefitError, match="different QKV scales are already stored for weight version 1"):
        store.put_scales(QKVScales(1, [0.5, 0.5], [0.125, 1.0], [2.0, 0.75]))
    assert store.get_scales(2) is None
    assert [e.type for e in store.events()] == ["weights_published", "scales_published"]


def test_events_resume_after_id_and_block(store: RefitStore):
    start = store.last_event_id()
    assert start == "0-0" and store.events(start) == []
    t0 = time.monotonic()
    assert store.events(start, block_ms=200) == []
    assert time.monotonic() - t0 >= 0.15

    def later() -> None:
        time.sleep(0.2)
        store.publish(manifest(store.job, 2))

    threading.Thread(target=later).start()
    got = store.events(start, block_ms=3000)
    assert [(e.type, e.version) for e in got] == [("weights_published", 2)]
    assert store.events(got[-1].id) == []


def test_lease_expiry_blocks_acks(store: RefitStore):
    store.publish(manifest(store.job, 1))
    store.register_replica("r0", "rollout-0:50052", None, ttl_s=1)
    lease = store.live_replicas()["r0"]
    assert (lease.endpoint, lease.version, lease.ttl_ms) == ("rollout-0:50052", None, 1000)
    assert store.heartbeat("r0", 1) is True
    assert store.live_replicas()["r0"].version == 1
    time.sleep(1.2)
    assert store.live_replicas() == {}
    assert store.heartbeat("r0", 1) is False  # the replica learns it must rejoin
    with pytest.raises(LeaseExpiredError, match="'r0' cannot ack weight version 1: it holds no live lease"):
        store.ack("r0", 1)
    assert store.acks(1) == set()
    store.register_replica("r0", "rollout-0:50052", 1, ttl_s=30)  # rejoin
    store.ack("r0", 1)
    assert store.acks(1) == {"r0"}
    with pytest.raises(UnknownVersionError, match="never published"):
        store.ack("r0", 9)


def test_wait_for_acks_reports_the_missing_replica(store: RefitStore):
    store.publish(manifest(store.job, 1))
    for rid in ("r0", "r1", "r2"):
        store.register_replica(rid, f"{rid}:1", 0, ttl_s=30)
    store.ack("r0", 1)
    store.ack("r2", 1)
    t0 = time.monotonic()
    acked, missing = store.wait_for_acks(1, timeout_s=0.3, poll_s=0.05)
    assert (acked, missing) == (["r0", "r2"], ["r1"])
    assert 0.25 <= time.monotonic() - t0 < 2.0

    threading.Timer(0.2, lambda: store.ack("r1", 1)).start()
    acked, missing = store.wait_for_acks(1, timeout_s=5, poll_s=0.02)
    assert (acked, missing) == (["r0", "r1", "r2"], [])


def test_fence_deletes_the_lease_and_emits_the_event(store: RefitStore):
    store.publish(manifest(store.job, 1))
    store.publish(manifest(store.job, 2))
    store.register_replica("r0", "r0:1", 1, ttl_s=30)
    store.register_replica("r1", "r1:1", 1, ttl_s=30)
    store.ack("r0", 2)
    after = store.last_event_id()
    _, missing = store.wait_for_acks(2, timeout_s=0.1)
    assert missing == ["r1"]
    assert store.fence("r1", 2) is True
    assert [(e.type, e.replica, e.version) for e in store.events(after)] == [("replica_fenced", "r1", 2)]
    assert set(store.live_replicas()) == {"r0"}
    with pytest.raises(LeaseExpiredError):
        store.ack("r1", 2)  # a late ack from a fenced replica is refused
    assert store.heartbeat("r1", 1) is False
    assert store.wait_for_acks(2, timeout_s=0.1) == (["r0"], [])


def test_a_replica_that_moved_past_a_version_is_not_waited_for(store: RefitStore):
    """A rollout replica that held version 1 back (multi-turn trajectories in flight) and then went straight to
    weights:latest = 2 never acks 1: it serves a newer version, so the wait for 1 ends at once — no fence."""
    store.publish(manifest(store.job, 1))
    store.publish(manifest(store.job, 2))
    store.register_replica("r0", "r0:1", 0, ttl_s=30)
    store.register_replica("r1", "r1:1", 0, ttl_s=30)
    store.ack("r0", 1)
    store.ack("r1", 2)  # skipped 1
    t0 = time.monotonic()
    assert store.wait_for_acks(1, timeout_s=5) == (["r0", "r1"], [])
    assert time.monotonic() - t0 < 2.5  # did not wait out the timeout
    assert store.wait_for_acks(2, timeout_s=0.1) == (["r1"], ["r0"])  # an older version is still missing


def test_password_protected_redis(redis_auth_server, job_id: str):
    client = connect(redis_auth_server.url)
    s = RefitStore(client, job_id)
    s.publish(manifest(job_id, 1))
    assert s.latest() == 1
    with pytest.raises(RefitConnectionError, match="refused authentication.*check the password") as ei:
        connect(redis_auth_server.url_with_password("wrong-password"))
    assert "wrong-password" not in str(ei.value) and ":***@" in str(ei.value)
    assert redis_auth_server.password not in str(ei.value)
    with pytest.raises(RefitConnectionError, match="authentication"):
        connect(redis_auth_server.url_with_password(None))


def test_unreachable_redis_fails_clearly():
    with pytest.raises(RefitConnectionError, match=r"cannot use Redis at redis://:\*\*\*@127.0.0.1:1/0"):
        connect("redis://:pw@127.0.0.1:1/0", timeout_s=0.5)


def test_roles_filter_leases_and_only_rollout_leases_are_awaited(store: RefitStore):
    store.publish(manifest(store.job, 1))
    store.register_replica("rollout-0", "h:1", 0, ttl_s=30)  # role defaults to rollout
    store.register_replica("calibrator", "h:2", 0, ttl_s=30, role="calibrator")
    store.register_replica("trainer", "h:3", None, ttl_s=30, role="trainer")
    assert set(store.live_replicas()) == {"rollout-0", "calibrator", "trainer"}
    assert set(store.live_replicas("rollout")) == {"rollout-0"}
    assert store.live_replicas("calibrator")["calibrator"].role == "calibrator"
    store.ack("rollout-0", 1)
    assert store.wait_for_acks(1, timeout_s=0.1) == (["rollout-0"], [])  # neither calibrator nor trainer awaited
    with pytest.raises(ValueError, match="unknown lease role 'gpu'"):
        store.register_replica("x", "h:4", None, ttl_s=30, role="gpu")


def test_endpoint_of_a_role_is_its_newest_live_lease(store: RefitStore):
    assert store.endpoint_of("trainer") is None
    store.register_replica("trainer-a", "h:1", None, ttl_s=30, role="trainer")
    time.sleep(0.01)
    store.register_replica("trainer-b", "h:2", None, ttl_s=30, role="trainer")
    assert store.endpoint_of("trainer").endpoint == "h:2"
    time.sleep(0.01)  # registration times have ms resolution: a restart is never within the same ms
    store.register_replica("trainer-a", "h:9", None, ttl_s=30, role="trainer")  # restarted on another port
    lease = store.endpoint_of("trainer")
    assert (lease.replica_id, lease.endpoint) == ("trainer-a", "h:9") and lease.registered_ms > 0


def test_an_expired_lease_emits_one_replica_fenced_event_and_a_released_one_none(store: RefitStore):
    after = store.last_event_id()
    store.register_replica("r0", "h:1", None, ttl_s=0.3)
    store.register_replica("r1", "h:2", None, ttl_s=30)
    assert store.release("r1") is True and store.release("r1") is False
    time.sleep(0.5)
    assert store.live_replicas() == {} and store.live_replicas() == {}  # the second read finds nothing to prune
    fenced = [(e.replica, e.reason) for e in store.events(after) if e.type == "replica_fenced"]
    assert fenced == [("r0", "lease_expired")]
    store.register_replica("r2", "h:3", 0, ttl_s=30)
    store.publish(manifest(store.job, 1))
    after = store.last_event_id()
    store.fence("r2", 1)
    assert [(e.replica, e.reason) for e in store.events(after)] == [("r2", "refit_timeout")]
