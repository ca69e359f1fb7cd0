"""Trainer + calibrator + one rollout replica as real processes, over real gRPC and a real Redis.

One stack per module (starting three torch processes is the expensive part). The tests run in file
order and each leaves the job at a known version: v0 served after Calibrate(0) → v1 trained,
published, calibrated and refitted → malformed requests refused → the replica SIGKILLed mid-run
and restarted, rejoining at v2.
"""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fp8rl.config import load_job_config
from fp8rl.engines import CalibrationModel, QKVCalibrator, SamplingParams, TorchRolloutEngine
from fp8rl.fp8.payload import load_qkv_scales
from fp8rl.presets import load_policy
from fp8rl.refit import RefitStore, assemble, connect, decode_scales
from fp8rl.refit.transport.grpc import GrpcShardSource
from fp8rl.rl.metrics import mismatch_promise
from fp8rl.rpc import (
    calibrator_pb2,
    calibrator_pb2_grpc,
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
PROMPTS = [[1, 20, 21, 22], [1, 30, 31]]
FIXED = [1, 40, 41, 42, 43]
ATOL_LOGPROB = 1e-5  # same code, same weights, same scales; only thread scheduling may differ
SERVING = health_pb2.HealthCheckResponse.SERVING
T = 60.0  # per-call deadline


class Stack:
    def __init__(self, cfg, trainer, calibrator, rollout, store, ckpt):
        self.cfg, self.trainer, self.calibrator, self.rollout, self.store = cfg, trainer, calibrator, rollout, store
        self.ckpt = ckpt
        self._channels: dict[str, grpc.Channel] = {}

    def _ch(self, p) -> grpc.Channel:
        if p.target not in self._channels:
            self._channels[p.target] = p.channel()
        return self._channels[p.target]

    def train(self):
        return trainer_pb2_grpc.TrainerServiceStub(self._ch(self.trainer))

    def cal(self):
        return calibrator_pb2_grpc.CalibratorServiceStub(self._ch(self.calibrator))

    def roll(self):
        return rollout_pb2_grpc.RolloutServiceStub(self._ch(self.rollout))

    def health(self, p) -> int:
        return health_pb2_grpc.HealthStub(self._ch(p)).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture(scope="module")
def stack(spawner, tiny_checkpoint, module_job_id, redis_url, write_job, tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("stack")
    cfg = write_job(tmp / "job.yaml", tiny_checkpoint, module_job_id)
    trainer = spawner.start("trainer", cfg, "trainer-0", "--checkpoint-dir", str(tmp / "ckpt"))
    calibrator = spawner.start("calibrator", cfg, "calibrator-0")
    rollout = spawner.start("rollout", cfg, "rollout-0", "--max-message-bytes", str(4 * MiB))
    for p in (trainer, calibrator, rollout):
        p.wait_listening()
    return Stack(cfg, trainer, calibrator, rollout, RefitStore(connect(redis_url), module_job_id), tmp / "ckpt")


def generate(st: Stack, prompts, version: int, session_keys=(), **sampling) -> list[rollout_pb2.Sample]:
    sampling = {"max_tokens": 4, "n": 1, **sampling}
    req = rollout_pb2.GenerateRequest(request_id="t", weight_version=version, session_keys=session_keys,
                                      prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts],
                                      sampling=rollout_pb2.SamplingParams(**sampling))
    return [r.sample for r in st.roll().Generate(req, timeout=T)]


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    return ei.value.code(), ei.value.details()


def wait_until(pred, what: str, timeout: float = 30.0, proc: object | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}" + (f"; log:\n{proc.log_tail()}" if proc else ""))


def rows_from(samples, advantages) -> list[trainer_pb2.Sequence]:
    return [trainer_pb2.Sequence(prompt_ids=PROMPTS[s.prompt_index], response_ids=s.token_ids, gen_logprobs=s.logprobs,
                                 advantage=a) for s, a in zip(samples, advantages, strict=True)]


def test_rollout_serves_v0_only_after_calibrate(stack: Stack):
    st = stack
    ts = st.train().Status(trainer_pb2.TrainerStatusRequest(), timeout=5)
    assert (ts.version, ts.ready, ts.recipe, ts.backend) == (0, True, "fp8_e2e", "torch")
    assert ts.weights_endpoint == st.trainer.target == st.store.get_manifest(0).endpoint
    assert st.store.latest() == 0

    rs = st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)  # v0 exists, its scales do not
    assert not rs.ready and not rs.HasField("weight_version") and rs.kv_cache_dtype == "fp8"
    assert st.health(st.rollout) != SERVING
    code, details = code_of(lambda: generate(st, PROMPTS, 0))
    assert code == grpc.StatusCode.UNAVAILABLE and "not ready" in details

    seqs = [common_pb2.TokenSequence(token_ids=p) for p in PROMPTS]
    resp = st.cal().Calibrate(calibrator_pb2.CalibrateRequest(version=0, sequences=seqs), timeout=T)
    got = decode_scales(resp.scales, 0)  # the one wire format: the bytes Redis holds
    assert resp.version == 0 and got.num_layers == 2 and min(got.q) > 0
    assert st.store.get_scales(0) == got
    assert resp.scales == st.store.client.get(st.store.keys.scales(0))

    wait_until(lambda: st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5).ready, "rollout ready at v0",
               proc=st.rollout)
    rs = st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)
    assert (rs.weight_version, rs.scales_version, rs.replica_id) == (0, 0, "rollout-0")
    assert st.health(st.rollout) == SERVING
    assert {"rollout-0", "calibrator-0"} <= st.store.acks(0)

    samples = generate(st, PROMPTS, 0, n=2, seed=3)
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s.weight_version == 0 and len(s.token_ids) == len(s.logprobs) > 0 for s in samples)

    again = st.cal().Calibrate(calibrator_pb2.CalibrateRequest(version=0, sequences=seqs[:1]), timeout=T)
    assert again.scales == resp.scales  # scales are immutable: a retry returns the stored set


def test_train_step_publishes_and_the_replica_refits_to_v1(stack: Stack, tiny_checkpoint):
    st = stack
    samples = generate(st, PROMPTS, 0, n=2, seed=5, max_tokens=6)
    rows = rows_from(samples, [1.0, -1.0, 0.5, -0.5])
    lp = st.train().ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(rows=rows, expected_version=0), timeout=T)
    assert lp.version == 0 and [len(r.logprobs) for r in lp.rows] == [len(s.token_ids) for s in samples]
    err = lp.metrics["token_mult_prob_error"]
    print(f"token_mult_prob_error {err:.5f} (promise {mismatch_promise('fp8_e2e', 'fp8', over='step')})")
    assert 1.0 <= err <= mismatch_promise("fp8_e2e", "fp8", over="step")  # FP8 rollout + FP8 KV vs FP8 trainer

    resp = st.train().TrainStep(trainer_pb2.TrainStepRequest(expected_version=0, rows=rows, step=0), timeout=T)
    assert resp.new_version == 1 and "train/loss" in resp.metrics and "token_mult_prob_error" in resp.metrics
    assert resp.phase_times.train > 0 and resp.phase_times.publish > 0
    code, details = code_of(lambda: st.train().TrainStep(
        trainer_pb2.TrainStepRequest(expected_version=0, rows=rows), timeout=T))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "holds version 1" in details

    manifest = st.store.get_manifest(1)
    assert st.store.latest() == 1 and manifest.recipe == "fp8_e2e"
    assert manifest.entry("model.layers.0.self_attn.q_proj.weight").dtype == "float8_e4m3fn"
    assert manifest.entry("model.layers.0.self_attn.q_proj.weight_scale").dtype == "float32"
    # v1 is published but its scales are not: wait until the replica has seen v1 (it names v1 as pending, or
    # wrongly applied it), then check it defers v1 for exactly that reason and still serves v0
    rs = wait_until(lambda: ((s := st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)).pending_version
                             == 1 or s.weight_version != 0) and s, "rollout to see v1", proc=st.rollout)
    assert (rs.weight_version, rs.scales_version, rs.ready) == (0, 0, True)
    assert (rs.pending_version, rs.pending_reason) == (1, "awaiting_scales") and st.store.get_scales(1) is None

    seqs = [common_pb2.TokenSequence(token_ids=list(r.prompt_ids) + list(r.response_ids)) for r in rows]
    cal = st.cal().Calibrate(calibrator_pb2.CalibrateRequest(version=1, sequences=seqs), timeout=T)
    assert cal.version == 1 and decode_scales(cal.scales, 1).version == 1
    rs = wait_until(lambda: (s := st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)).weight_version == 1
                    and s, "rollout at v1", proc=st.rollout)
    assert rs.scales_version == 1 and rs.ready
    rs = wait_until(lambda: not (s := st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)).HasField(
        "pending_version") and s, "rollout to drop the pending v1", proc=st.rollout)
    assert rs.pending_reason == ""
    assert {"rollout-0", "calibrator-0"} <= st.store.acks(1)
    # refit.transport auto, one host: the trainer wrote v1 into shared memory and both replicas mapped it
    assert manifest.shm is not None and Path(manifest.shm["dir"]).is_dir()
    for p in (st.rollout, st.calibrator):
        assert "refit transport for weight version 0: shm" in p.log_path.read_text(), p.role
        assert "via shm failed" not in p.log_path.read_text(), p.role

    # An in-process engine fed the same v1 bytes (pulled over the same WeightStore) and scales agrees.
    src = GrpcShardSource()
    tensors = assemble(manifest, [src.fetch(manifest, i) for i in range(manifest.num_shards)])
    src.close()
    job = load_job_config(st.cfg)
    policy, tok, _ = load_policy(str(tiny_checkpoint))
    ref = TorchRolloutEngine(policy, job.fp8_recipe("rollout"), eos_token_ids=[tok.eos_id], pad_token_id=tok.pad_id,
                             initial_version=None)
    ref.load_weights(1, tensors, st.store.get_scales(1))
    want = ref.generate([FIXED], SamplingParams(temperature=0.0, max_tokens=6), weight_version=1)[0]
    got = generate(st, [FIXED], 1, temperature=0.0, max_tokens=6)[0]
    assert tuple(got.token_ids) == want.token_ids and got.weight_version == 1
    torch.testing.assert_close(torch.tensor(list(got.logprobs)), torch.tensor(want.logprobs), atol=ATOL_LOGPROB,
                               rtol=0)

    ck = st.train().SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=T)
    assert ck.version == 1 and (Path(ck.path) / "trainer-v000001.pt").is_file()


def test_a_trainer_that_calibrates_publishes_each_version_with_its_scales(spawner, tiny_checkpoint, module_job_id,
                                                                         redis_url, write_job, tmp_path):
    """calibration.site trainer (TrainStepRequest.calibrate_scales): TrainStep computes v1's QKV scales on the
    weights it just stepped to and stores them beside v1's manifest, so a replica moves to v1 with no Calibrate call;
    they are the scales the calibrator's own model computes on v1's published bytes over the same sequences
    (bitwise: batch-invariant numerics, the default)."""
    job_id = module_job_id + "-tc"
    cfg = write_job(tmp_path / "job.yaml", tiny_checkpoint, job_id, calibration={"max_sequences": 4, "site": "trainer"})
    procs = [spawner.start("trainer", cfg, "trainer-0", "--checkpoint-dir", str(tmp_path / "ckpt")),
             spawner.start("calibrator", cfg, "calibrator-0"), spawner.start("rollout", cfg, "rollout-0")]
    for p in procs:
        p.wait_listening()
    st = Stack(cfg, *procs, RefitStore(connect(redis_url), job_id), tmp_path / "ckpt")
    # version 0's scales: the calibrator's, as the controller asks for them
    st.cal().Calibrate(calibrator_pb2.CalibrateRequest(version=0, sequences=[common_pb2.TokenSequence(
        token_ids=list(p)) for p in PROMPTS]), timeout=T)
    wait_until(lambda: (s := st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)).ready
               and s.weight_version == 0, "rollout serving v0", proc=st.rollout)
    rows = rows_from(generate(st, PROMPTS, 0, n=2, seed=5, max_tokens=6), [1.0, -1.0, 0.5, -0.5])
    resp = st.train().TrainStep(trainer_pb2.TrainStepRequest(expected_version=0, rows=rows, step=0,
                                                             calibrate_scales=True), timeout=T)
    assert resp.new_version == 1 and resp.phase_times.calibrate > 0
    scales = st.store.get_scales(1)  # there as soon as TrainStep returns: no Calibrate call for v1
    assert scales is not None and scales.version == 1
    rs = wait_until(lambda: (s := st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)).weight_version == 1
                    and s, "rollout at v1", proc=st.rollout)
    assert rs.scales_version == 1 and rs.ready

    manifest = st.store.get_manifest(1)
    src = GrpcShardSource()
    tensors = assemble(manifest, [src.fetch(manifest, i) for i in range(manifest.num_shards)])
    src.close()
    job = load_job_config(cfg)
    policy, tok, _ = load_policy(str(tiny_checkpoint))
    target = CalibrationModel(policy, job.fp8_recipe("calibrator"))
    target.load_weights(1, tensors)
    want = QKVCalibrator(target.model, pad_token_id=tok.pad_id, max_sequences=4).calibrate(
        1, [list(r.prompt_ids) + list(r.response_ids) for r in rows])
    assert (scales.q, scales.k, scales.v) == (want.q, want.k, want.v)  # FP32 values, compared exactly

    # calibration.site logprobs: v2's scales are the Q/K/V amax of v1's logprob pass over the step's rows (one pass of
    # the trainer's 8-row micro-batch) — a pass that, batch-invariant, recomputes the rollout's FP8 attention with
    # v1's scales, so the reference runs v1's model with that attention too — stored beside v2's manifest; the two
    # sources are exclusive
    code, details = code_of(lambda: st.train().TrainStep(trainer_pb2.TrainStepRequest(
        expected_version=1, rows=rows, calibrate_scales=True, scales_from_logprobs=True), timeout=T))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "exclusive" in details
    rows1 = rows_from(generate(st, PROMPTS, 1, n=2, seed=6, max_tokens=6), [1.0, -1.0, 0.5, -0.5])
    resp = st.train().TrainStep(trainer_pb2.TrainStepRequest(expected_version=1, rows=rows1, step=1,
                                                             scales_from_logprobs=True), timeout=T)
    assert resp.new_version == 2 and st.store.get_scales(2) is not None
    got = st.store.get_scales(2)
    target.model.enable_fp8_kv()
    load_qkv_scales(target.model, scales)
    want = QKVCalibrator(target.model, pad_token_id=tok.pad_id, micro_batch_size=8).calibrate(
        2, [list(r.prompt_ids) + list(r.response_ids) for r in rows1])
    assert (got.q, got.k, got.v) == (want.q, want.k, want.v)


def test_request_pinned_to_an_old_version_is_refused(stack: Stack):
    code, details = code_of(lambda: generate(stack, PROMPTS, 0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "pinned to weight version 0" in details and "holds version 1" in details


def test_malformed_requests_are_refused_and_every_service_keeps_serving(stack: Stack):
    st = stack
    ok = rows_from(generate(st, PROMPTS[:1], 1, n=2), [1.0, -1.0])
    nan = trainer_pb2.Sequence(prompt_ids=[1, 5], response_ids=[6, 7], gen_logprobs=[float("nan"), -1.0])
    short = trainer_pb2.Sequence(prompt_ids=[1, 5], response_ids=[6, 7], gen_logprobs=[-1.0])
    oov = trainer_pb2.Sequence(prompt_ids=[1, 500], response_ids=[6], gen_logprobs=[-1.0])
    overflow = [trainer_pb2.Sequence(prompt_ids=r.prompt_ids, response_ids=r.response_ids, gen_logprobs=r.gen_logprobs,
                                     advantage=a) for r, a in zip(ok, (3e38, -3e38), strict=True)]  # finite float32
    masked = trainer_pb2.Sequence(prompt_ids=[1, 5], response_ids=[6, 7], gen_logprobs=[-1.0, -1.0],
                                  loss_mask=[True])
    for rows, needle in (([*ok, nan], "gen_logprobs[0] is nan"), ([short], "1 gen_logprobs for 2 response_ids"),
                         ([masked], "1 loss_mask entries for 2 response_ids"),
                         ([], "no rows"), ([oov], "token id 500"), (overflow, "non-finite gradient")):
        code, details = code_of(lambda r=rows: st.train().TrainStep(
            trainer_pb2.TrainStepRequest(expected_version=1, rows=r), timeout=T))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
    code, _ = code_of(lambda: st.train().ComputeLogprobs(
        trainer_pb2.ComputeLogprobsRequest(rows=ok, expected_version=7), timeout=T))
    assert code == grpc.StatusCode.FAILED_PRECONDITION

    for prompts, sampling, needle in (([[]], {}, "prompt 0 is empty"), ([], {}, "prompts is empty"),
                                      (PROMPTS, {"n": 0}, "n must be >= 1"),
                                      (PROMPTS, {"max_tokens": 100}, "exceeds the model's 64 positions"),
                                      (PROMPTS, {"session_keys": ["a"]}, "1 keys for 2 prompts"),
                                      (PROMPTS[:1], {"session_keys": ["a"], "n": 2}, "sampling.n = 1")):
        code, details = code_of(lambda p=prompts, s=sampling: generate(st, p, 1, **s))  # session_keys among s
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
    huge = rollout_pb2.GenerateRequest(weight_version=1, sampling=rollout_pb2.SamplingParams(max_tokens=1, n=1),
                                       prompts=[rollout_pb2.Prompt(token_ids=[1], text="x" * 5 * MiB)])
    code, _ = code_of(lambda: list(st.roll().Generate(huge, timeout=T)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED

    code, _ = code_of(lambda: st.cal().Calibrate(calibrator_pb2.CalibrateRequest(version=1), timeout=T))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    seqs = [common_pb2.TokenSequence(token_ids=[1, 2, 3])]
    code, details = code_of(lambda: st.cal().Calibrate(calibrator_pb2.CalibrateRequest(version=99, sequences=seqs),
                                                       timeout=T))
    assert code == grpc.StatusCode.NOT_FOUND and "not published" in details

    assert st.train().Status(trainer_pb2.TrainerStatusRequest(), timeout=5).version == 1  # nothing was applied
    assert all(st.health(p) == SERVING for p in (st.trainer, st.calibrator, st.rollout))
    assert len(generate(st, PROMPTS, 1)) == 2


def test_a_killed_replica_restarts_and_rejoins_at_the_latest_version(stack: Stack, spawner):
    st = stack
    rows = rows_from(generate(st, PROMPTS[:1], 1, n=2, seed=9), [1.0, -1.0])
    errors: list[grpc.StatusCode] = []

    def long_generate():  # 1024 rows x 48 tokens: four engine batches, seconds on this model
        try:
            generate(st, PROMPTS * 64, 1, n=8, max_tokens=48, temperature=1.0)
        except grpc.RpcError as exc:
            errors.append(exc.code())

    t = threading.Thread(target=long_generate)
    t.start()
    # kill once the replica says it is computing that call, so the kill lands mid-generation
    wait_until(lambda: st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5).generating == 1,
               "the long Generate to start", proc=st.rollout)
    st.rollout.kill()  # SIGKILL: no graceful anything
    t.join(timeout=T)
    assert errors == [grpc.StatusCode.UNAVAILABLE]

    assert st.train().TrainStep(trainer_pb2.TrainStepRequest(expected_version=1, rows=rows), timeout=T).new_version == 2
    seqs = [common_pb2.TokenSequence(token_ids=list(r.prompt_ids) + list(r.response_ids)) for r in rows]
    st.cal().Calibrate(calibrator_pb2.CalibrateRequest(version=2, sequences=seqs), timeout=T)

    st.rollout = spawner.start("rollout", st.cfg, "rollout-0").wait_listening()
    rs = wait_until(lambda: (s := st.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)).ready and s,
                    "restarted rollout ready", proc=st.rollout)
    assert (rs.weight_version, rs.scales_version) == (2, 2)
    assert "rollout-0" in st.store.acks(2) and st.store.live_replicas()["rollout-0"].version == 2
    assert all(s.weight_version == 2 for s in generate(st, PROMPTS, 2))

    assert st.rollout.terminate() == 0  # SIGTERM: graceful stop, exit 0, ready file removed
    assert not st.rollout.ready_file.exists()


def test_a_trainer_resumes_from_a_checkpoint_and_republishes_one_the_job_moved_past(stack: Stack, spawner, redis_url):
    st = stack
    fresh = "svc-resume-" + uuid.uuid4().hex[:8]
    resumed = spawner.start("trainer", st.cfg, "trainer-resumed", "--resume", str(st.ckpt), "--job-id", fresh)
    resumed.wait_listening()
    ts = trainer_pb2_grpc.TrainerServiceStub(resumed.channel()).Status(trainer_pb2.TrainerStatusRequest(), timeout=5)
    assert (ts.version, ts.ready) == (1, True)
    initial = spawner.start("trainer", st.cfg, "trainer-initial", "--job-id", fresh)  # no --resume: refused
    store = RefitStore(connect(redis_url), fresh)
    assert store.latest() == 1 and store.restored_from(1) is None  # published at startup, in its own job
    assert initial.proc.wait(timeout=60) == 2
    assert "already has weights:latest=1" in initial.log_tail() and "--resume" in initial.log_tail()
    # The stack's job is at v2 and the checkpoint holds v1: republished as v3, marked as restored from v1,
    # with exactly the checkpoint's weights.
    behind = spawner.start("trainer", st.cfg, "trainer-behind", "--resume", str(st.ckpt)).wait_listening()
    ts = trainer_pb2_grpc.TrainerServiceStub(behind.channel()).Status(trainer_pb2.TrainerStatusRequest(), timeout=5)
    assert (ts.version, ts.ready) == (3, True)
    assert (st.store.latest(), st.store.restored_from(3)) == (3, 1)
    src = GrpcShardSource()
    v1, v3 = (assemble(m, [src.fetch(m, i) for i in range(m.num_shards)])
              for m in (store.get_manifest(1), st.store.get_manifest(3)))
    src.close()
    assert v1.keys() == v3.keys() and all(torch.equal(v1[k], v3[k]) for k in v1)


def test_a_trainer_refuses_a_step_past_its_memory_limit_and_keeps_serving(spawner, tiny_checkpoint, module_job_id,
                                                                          redis_url, write_job, tmp_path):
    """A trainer given less memory than a micro-batch needs (``--memory-limit-gb``, below what the process already
    holds) answers TrainStep with RESOURCE_EXHAUSTED naming policy.training.micro_batch_size before any work: no
    version is published, the process keeps serving."""
    job_id = module_job_id + "-mem"
    cfg = write_job(tmp_path / "job.yaml", tiny_checkpoint, job_id)
    tr = spawner.start("trainer", cfg, "trainer-mem", "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--memory-limit-gb", "0.01").wait_listening()
    stub = trainer_pb2_grpc.TrainerServiceStub(tr.channel())
    rows = [trainer_pb2.Sequence(prompt_ids=p, response_ids=[50, 51, 52], gen_logprobs=[-1.0] * 3, advantage=a)
            for p, a in zip(PROMPTS, (1.0, -1.0), strict=True)]
    store = RefitStore(connect(redis_url), job_id)
    before = store.latest()
    code, details = code_of(lambda: stub.TrainStep(trainer_pb2.TrainStepRequest(expected_version=0, rows=rows, step=0),
                                                   timeout=T))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "policy.training.micro_batch_size" in details and "nothing was run" in details, details
    assert store.latest() == before and tr.proc.poll() is None
    assert health_pb2_grpc.HealthStub(tr.channel()).Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING


def test_a_version_trained_while_redis_refused_writes_is_published_with_its_lineage_before_status(
        spawner, tiny_checkpoint, module_job_id, redis_url, write_job, tmp_path):
    """Redis refuses writes while a step trains (``min-replicas-to-write``: a real Redis answering NOREPLICAS): the
    step's update is held but cannot be published, and TrainStep says so (UNAVAILABLE). Once Redis takes writes
    again, Status publishes it — its lineage (``trained_from``) first — before answering, so a controller resuming
    the job reads where the held version came from (it failed the job as "unknown" when a Redis restart landed in
    that window)."""
    job_id = module_job_id + "-lineage"
    cfg = write_job(tmp_path / "job.yaml", tiny_checkpoint, job_id,
                    vllm_cfg={"precision": "fp8", "kv_cache_dtype": "auto"})  # no FP8 KV: no QKV scales to wait for
    tr = spawner.start("trainer", cfg, "trainer-lineage", "--checkpoint-dir", str(tmp_path / "ckpt")).wait_listening()
    stub = trainer_pb2_grpc.TrainerServiceStub(tr.channel())
    rows = [trainer_pb2.Sequence(prompt_ids=p, response_ids=[50, 51, 52], gen_logprobs=[-1.0] * 3, advantage=a)
            for p, a in zip(PROMPTS, (1.0, -1.0), strict=True)]
    client = connect(redis_url)
    store = RefitStore(client, job_id)
    assert store.latest() == 0
    client.config_set("min-replicas-to-write", 1)
    try:
        code, details = code_of(lambda: stub.TrainStep(
            trainer_pb2.TrainStepRequest(expected_version=0, rows=rows, step=0), timeout=T))
    finally:
        client.config_set("min-replicas-to-write", 0)
    assert code == grpc.StatusCode.UNAVAILABLE and "could not publish" in details, details
    assert store.latest() == 0 and store.trained_from(1) is None  # held, not published
    assert stub.Status(trainer_pb2.TrainerStatusRequest(), timeout=T).version == 1
    assert (store.latest(), store.trained_from(1)) == (1, 0)


def test_vllm_backend_without_vllm_installed_is_a_clear_startup_error(spawner, tiny_checkpoint, module_job_id,
                                                                     write_job, tmp_path):
    if importlib.util.find_spec("vllm") is not None:  # the default venv never has it (vLLM lives in .venv-vllm)
        pytest.skip("vLLM is installed in this environment")
    cfg = write_job(tmp_path / "vllm.yaml", tiny_checkpoint, module_job_id, backend="vllm")
    p = spawner.start("rollout", cfg, "rollout-vllm")
    assert p.proc.wait(timeout=60) == 2
    assert "needs vLLM 0.32.0 installed" in p.log_tail() and "make test-vllm" in p.log_tail()
    assert "Traceback" not in p.log_tail()


def test_a_replica_serves_the_openai_endpoint_beside_generate(stack: Stack, spawner):
    """A rollout replica started with ``--openai-port 0``: the real ``openai`` client's completion, seeded, is the
    gRPC Generate of the same prompt and seed on the same replica — the same engine, token for token, logprob for
    logprob, at the version it reports. The chat route needs a chat template (this tiny model has none): a clear
    400. Beyond loopback without a token the replica does not start."""
    import re

    import openai

    latest = stack.store.latest()  # earlier tests may have left the newest version without its QKV scales
    if stack.store.get_scales(latest) is None:
        stack.cal().Calibrate(calibrator_pb2.CalibrateRequest(version=latest, sequences=[
            common_pb2.TokenSequence(token_ids=q) for q in PROMPTS]), timeout=T)
    p = spawner.start("rollout", stack.cfg, "rollout-openai", "--openai-port", "0").wait_listening()
    try:
        port = int(wait_until(lambda: re.search(r"OpenAI-compatible endpoint on http://127\.0\.0\.1:(\d+)/v1",
                                                 p.log_tail(20000)), "the endpoint's port in the log", proc=p)[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60)
        stub = rollout_pb2_grpc.RolloutServiceStub(p.channel())
        status = wait_until(lambda: (s := stub.Status(rollout_pb2.RolloutStatusRequest(), timeout=T)).ready and s,
                            "the replica to hold a version", proc=p)
        prompt = [3, 5, 7, 9]
        got = client.completions.create(model="m", prompt=[prompt], max_tokens=4, seed=5, temperature=1.0)
        ch = got.choices[0].model_extra
        req = rollout_pb2.GenerateRequest(request_id="oa", weight_version=status.weight_version,
                                          prompts=[rollout_pb2.Prompt(token_ids=prompt)],
                                          sampling=rollout_pb2.SamplingParams(max_tokens=4, n=1, seed=5,
                                                                              temperature=1.0))
        ref = [r.sample for r in stub.Generate(req, timeout=T)][0]
        assert ch["generation_token_ids"] == list(ref.token_ids) and ch["prompt_token_ids"] == prompt
        assert ch["generation_log_probs"] == list(ref.logprobs) and ch["weight_version"] == ref.weight_version
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    finally:
        p.terminate()
    bad = spawner.start("rollout", stack.cfg, "rollout-openai-open", "--openai-port", "0", "--openai-host", "0.0.0.0")
    assert bad.proc.wait(timeout=60) == 2
    assert "refusing to serve the OpenAI endpoint" in bad.log_tail() and "Traceback" not in bad.log_tail()
