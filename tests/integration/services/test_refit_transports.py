"""The refit data plane of the real services beyond shared memory (which ``test_stack`` covers): a trainer
broadcasting to a rollout replica over a ``torch.distributed`` gloo group (``refit.transport:
collective``), and a delta refit over gRPC (``refit.delta``).

Each stack is a trainer + one rollout replica as real processes (KV cache in the model dtype, so no
calibrator is needed), real Redis, real gRPC. The collective group's own failure cases are in
``tests/integration/refit/test_collective.py``, the delta's in ``tests/integration/refit/test_delta.py``.
"""

from __future__ import annotations

import json

import pytest
import yaml

from fp8rl.refit import RefitStore, connect
from fp8rl.rpc import rollout_pb2, trainer_pb2

from .test_stack import PROMPTS, Stack, T, generate, rows_from, wait_until

pytestmark = pytest.mark.integration


def _stack(spawner, tiny_checkpoint, job_id, redis_url, write_job, tmp, refit: dict, tag: str) -> Stack:
    """A trainer and a rollout replica of their own job (ids ending in ``tag``: the module's spawner keeps every
    process it started until the module ends)."""
    cfg = write_job(tmp / "job.yaml", tiny_checkpoint, job_id, vllm_cfg={"precision": "fp8", "kv_cache_dtype": "auto"})
    job = yaml.safe_load(cfg.read_text())
    job["refit"] = refit
    cfg.write_text(yaml.safe_dump(job))
    trainer = spawner.start("trainer", cfg, f"trainer-{tag}", "--checkpoint-dir", str(tmp / "ckpt"))
    rollout = spawner.start("rollout", cfg, f"rollout-{tag}")
    for p in (trainer, rollout):
        p.wait_listening()
    return Stack(cfg, trainer, None, rollout, RefitStore(connect(redis_url), job_id), tmp / "ckpt")


def _held(st: Stack) -> int | None:
    """The version the replica holds (None before its first refit: ``weight_version`` is an optional field)."""
    rs = st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)
    return rs.weight_version if rs.HasField("weight_version") else None


def _train_to_v1(st: Stack, ready=lambda: True) -> list[str]:
    """v0 served, ``ready()``, one TrainStep, the replica at v1; returns the replica's log lines about v1."""
    wait_until(lambda: _held(st) == 0, "rollout at v0", timeout=60, proc=st.rollout)
    wait_until(ready, "the transport to be ready", timeout=60, proc=st.rollout)
    rows = rows_from(generate(st, PROMPTS, 0, n=2, seed=5, max_tokens=6), [1.0, -1.0, 0.5, -0.5])
    resp = st.train().TrainStep(trainer_pb2.TrainStepRequest(expected_version=0, rows=rows, step=0), timeout=T)
    assert resp.new_version == 1
    wait_until(lambda: _held(st) == 1, "rollout at v1", timeout=60, proc=st.rollout)
    assert st.rollout.replica_id in st.store.acks(1)
    assert all(s.weight_version == 1 for s in generate(st, PROMPTS, 1, n=1, seed=1, max_tokens=4))
    return [ln for ln in st.rollout.log_path.read_text().splitlines() if "weight version 1" in ln]


@pytest.mark.collective  # make test-collective
def test_the_trainer_broadcasts_v1_to_the_replica_over_a_gloo_group(spawner, tiny_checkpoint, module_job_id,
                                                                     redis_url, write_job, tmp_path):
    st = _stack(spawner, tiny_checkpoint, module_job_id + "-c", redis_url, write_job, tmp_path,
                {"transport": "collective", "collective": True}, "c")

    def in_group() -> bool:  # v0 may precede the group (served over gRPC then); v1 must come by broadcast
        raw = st.store.client.get(st.store.keys.collective_epoch())
        return raw is not None and st.rollout.replica_id in json.loads(raw)["members"] and \
            "joined collective epoch" in st.rollout.log_path.read_text()

    lines = _train_to_v1(st, in_group)
    m1 = st.store.get_manifest(1)
    assert m1.collective and m1.collective.rsplit(":", 1)[0] == st.trainer.target.rsplit(":", 1)[0]
    assert any(ln.endswith("refit transport for weight version 1: collective") for ln in lines), lines
    assert not any("via collective failed" in ln for ln in lines), lines


def test_a_replica_at_the_base_pulls_v1_as_a_delta_over_grpc(spawner, tiny_checkpoint, module_job_id, redis_url,
                                                             write_job, tmp_path):
    st = _stack(spawner, tiny_checkpoint, module_job_id + "-d", redis_url, write_job, tmp_path,
                {"transport": "grpc", "delta": True}, "d")
    lines = _train_to_v1(st)
    delta, full = st.store.get_delta(1), st.store.get_manifest(1)
    assert delta is not None and delta.base == 0 and full.shm is None
    applied = [ln for ln in lines if "applied weight version 1 " in ln]
    assert applied and f"delta: {delta.total_bytes} bytes" in applied[-1], applied
