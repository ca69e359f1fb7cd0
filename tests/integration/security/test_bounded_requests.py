"""Bounded work against the real stack ``deploy.launcher up`` starts, with raw stubs (not the SDK).

Every case of issue 12 where one request could exhaust or wedge a service is refused with the right code,
fast, and the service stays healthy (health SERVING, a normal call still answers): hostile job files (alias
bomb, oversize YAML, ``job.steps: 2**63``, ``job_id: ""``), hostile ``data.path`` (a device, a FIFO, a
symlink out of the data root, a file that fails only when the job starts), oversize Generate / TrainStep /
ComputeLogprobs / Calibrate / Score calls, bad temperatures, too many WatchJob streams, long calls filling
the worker pool, and a long Generate the client cancels. Then a bounded fuzz: random and mutated request
bytes to every RPC never get INTERNAL or UNKNOWN, and every service still answers.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fp8rl import limits
from fp8rl.rpc import (
    calibrator_pb2,
    calibrator_pb2_grpc,
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weights_pb2,
)
from fp8rl.rpc.channel import make_channel

pytestmark = pytest.mark.integration

INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
SERVING = health_pb2.HealthCheckResponse.SERVING
FAST_S = 2.0  # a refusal answers within this (the work it refuses would take minutes, or forever)
FUZZ_PER_RPC = 200
PROMPT = [1, 20, 21]
# The 326-byte bomb of the issue, one level deeper: 9**9 leaves once expanded.
ALIAS_BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
                       + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
                       + ["job: {name: *a8}"])


class Services:
    """Raw channels to one launched stack: the service token for internal RPCs, the client token for the JobService."""

    def __init__(self, stack) -> None:
        self.stack = stack
        self._channels: dict[str, grpc.Channel] = {}

    def ch(self, name: str) -> grpc.Channel:
        if name not in self._channels:
            target = self.stack.target if name == "controller" else f"127.0.0.1:{self.stack.process(name)['port']}"
            token = self.stack.client_token if name == "controller" else self.stack.service_token
            self._channels[name] = make_channel(target, token=token, tls_ca="")
        return self._channels[name]

    def jobs(self):
        return controller_pb2_grpc.JobServiceStub(self.ch("controller"))

    def roll(self):
        return rollout_pb2_grpc.RolloutServiceStub(self.ch("rollout-0"))

    def train(self):
        return trainer_pb2_grpc.TrainerServiceStub(self.ch("trainer"))

    def healthy(self, name: str) -> None:
        """Health SERVING and a normal cheap call answering, both within FAST_S."""
        t0 = time.monotonic()
        status = health_pb2_grpc.HealthStub(self.ch(name)).Check(health_pb2.HealthCheckRequest(), timeout=FAST_S)
        assert status.status == SERVING, name
        normal = {
            "controller": lambda: self.jobs().ListJobs(controller_pb2.ListJobsRequest(), timeout=FAST_S),
            "rollout-0": lambda: self.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=FAST_S),
            "trainer": lambda: self.train().Status(trainer_pb2.TrainerStatusRequest(), timeout=FAST_S),
            "reward": lambda: reward_pb2_grpc.RewardServiceStub(self.ch("reward")).Score(
                reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response="4", answer="4")]), timeout=FAST_S),
            "calibrator": lambda: None,  # health only: every Calibrate is real work
        }
        normal[name]()
        assert time.monotonic() - t0 < FAST_S * 2

    def close(self) -> None:
        for c in self._channels.values():
            c.close()


@pytest.fixture(scope="module")
def svc(stacks):
    s = Services(stacks.get())
    yield s
    s.close()


def refused(call, code: grpc.StatusCode = INVALID, match: str = "") -> str:
    """``call()`` fails with ``code`` within FAST_S, with a short message containing ``match``."""
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        call()
    took = time.monotonic() - t0
    details = err.value.details() or ""
    assert err.value.code() == code, (err.value.code(), details[:500])
    assert match in details, details[:500]
    assert took < FAST_S, f"refused after {took:.2f} s"
    assert len(details) < 2000
    return details


def gen_request(version: int, *, prompts: int = 1, **sampling) -> rollout_pb2.GenerateRequest:
    sampling = {"max_tokens": 4, "n": 1, "seed": 0, **sampling}
    return rollout_pb2.GenerateRequest(request_id="bounded", weight_version=version,
                                       prompts=[rollout_pb2.Prompt(token_ids=PROMPT)] * prompts,
                                       sampling=rollout_pb2.SamplingParams(**sampling))


def serving_version(svc: Services) -> int:
    """The version the rollout replica serves, calibrating it first when its QKV scales are missing."""
    v = svc.train().Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version
    if svc.stack.refit().get_scales(v) is None:
        calibrator_pb2_grpc.CalibratorServiceStub(svc.ch("calibrator")).Calibrate(calibrator_pb2.CalibrateRequest(
            version=v, sequences=[common_pb2.TokenSequence(token_ids=PROMPT)]), timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = svc.roll().Status(rollout_pb2.RolloutStatusRequest(), timeout=5)
        if st.ready and st.weight_version == v:
            return v
        time.sleep(0.1)
    pytest.fail(f"the rollout replica did not serve weight version {v} within 30 s")


def submit(svc: Services, job: dict | str, job_id: str | None = None):
    text = job if isinstance(job, str) else yaml.safe_dump(job)
    req = controller_pb2.SubmitJobRequest(job_yaml=text)
    if job_id is not None:
        req.job_id = job_id
    return svc.jobs().SubmitJob(req, timeout=10)


def tiny_job(svc: Services, **sections) -> dict:
    job = yaml.safe_load(svc.stack.job_yaml())
    for key, value in sections.items():
        job.setdefault(key, {}).update(value)
    return job


# -- the job file -----------------------------------------------------------------------------------------------

def test_hostile_job_files_are_refused_fast_with_a_short_message(svc):
    assert len(ALIAS_BOMB) < 600
    refused(lambda: submit(svc, ALIAS_BOMB), match="anchors and aliases")
    huge = "job: {name: big}\n" + "#" * limits.MAX_JOB_YAML_BYTES
    refused(lambda: submit(svc, huge), match=f"the limit is {limits.MAX_JOB_YAML_BYTES} bytes")
    refused(lambda: submit(svc, tiny_job(svc, job={"steps": 2**63})), match="job.steps: 9223372036854775808")
    refused(lambda: submit(svc, tiny_job(svc, job={"steps": limits.MAX_JOB_STEPS + 1})),
            match=f"job.steps: must be <= {limits.MAX_JOB_STEPS}")
    refused(lambda: submit(svc, tiny_job(svc), job_id=""), match="job_id is empty")
    refused(lambda: svc.jobs().GetJob(controller_pb2.GetJobRequest(job_id=""), timeout=5), match="job_id is empty")
    refused(lambda: svc.jobs().CancelJob(controller_pb2.CancelJobRequest(job_id=""), timeout=5),
            match="job_id is empty")
    listed = svc.jobs().ListJobs(controller_pb2.ListJobsRequest(), timeout=5)  # never "Value out of range"
    assert all(0 < j.total_steps <= limits.MAX_JOB_STEPS for j in listed.jobs)
    svc.healthy("controller")


def test_hostile_data_paths_are_refused_at_submit_and_a_late_failure_fails_the_job(svc):
    root = svc.stack.job_file.parent  # the launcher's controller takes the directory of its --config as data root
    fifo = root / "fifo.jsonl"
    if not fifo.exists():
        os.mkfifo(fifo)
    outside = root.parent / "outside.jsonl"
    outside.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    link = root / "link-out.jsonl"
    if not link.exists():
        os.symlink(outside, link)

    def data_job(path: str) -> dict:
        return tiny_job(svc, data={"task": "jsonl", "path": path})

    refused(lambda: submit(svc, data_job("/dev/zero")), match="outside the data root")
    refused(lambda: submit(svc, data_job("fifo.jsonl")), match="is a FIFO, not a regular file")
    refused(lambda: submit(svc, data_job("link-out.jsonl")), match="outside the data root")
    refused(lambda: submit(svc, data_job("../outside.jsonl")), match="outside the data root")
    refused(lambda: submit(svc, data_job(".")), match="is a directory")
    svc.healthy("controller")

    (root / "late.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\nnot json\n')
    job_id = submit(svc, data_job("late.jsonl")).job_id  # fine by its size and kind; line 2 fails when it starts
    deadline = time.monotonic() + 30
    while (job := svc.jobs().GetJob(controller_pb2.GetJobRequest(job_id=job_id), timeout=5).job).state != "failed":
        assert job.state in ("pending", "running") and time.monotonic() < deadline, job
        time.sleep(0.1)
    assert "late.jsonl:2: invalid JSON" in job.error and job.step == 0
    svc.healthy("controller")


# -- per-request limits ----------------------------------------------------------------------------------------

def test_oversize_batches_are_invalid_argument_before_any_work(svc):
    v = svc.train().Status(trainer_pb2.TrainerStatusRequest(), timeout=5).version
    row = trainer_pb2.Sequence(prompt_ids=PROMPT, response_ids=[30], gen_logprobs=[-1.0])
    rows = [row] * (limits.MAX_BATCH_ROWS + 1)
    refused(lambda: svc.train().TrainStep(trainer_pb2.TrainStepRequest(expected_version=v, rows=rows), timeout=10),
            match=f"{limits.MAX_BATCH_ROWS + 1} rows; the limit is {limits.MAX_BATCH_ROWS}")
    refused(lambda: svc.train().ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(rows=rows), timeout=10),
            match=f"the limit is {limits.MAX_BATCH_ROWS}")
    seqs = [common_pb2.TokenSequence(token_ids=PROMPT)] * (limits.MAX_BATCH_ROWS + 1)
    refused(lambda: calibrator_pb2_grpc.CalibratorServiceStub(svc.ch("calibrator")).Calibrate(
        calibrator_pb2.CalibrateRequest(version=v, sequences=seqs), timeout=10), match="(--max-rows)")
    score = reward_pb2_grpc.RewardServiceStub(svc.ch("reward")).Score
    refused(lambda: score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(answer="1")] *
                                                  (limits.MAX_SCORE_ITEMS + 1)), timeout=10), match="(--max-items)")
    refused(lambda: score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(
        response="9" * (limits.MAX_RESPONSE_CHARS + 1), answer="9")]), timeout=10),
        match=f"items[0].response: {limits.MAX_RESPONSE_CHARS + 1} characters")
    assert svc.train().Status(trainer_pb2.TrainerStatusRequest(), timeout=5).version == v
    for name in ("trainer", "calibrator", "reward"):
        svc.healthy(name)


def test_generate_bounds_and_sampling_validation(svc):
    v = serving_version(svc)
    gen = svc.roll().Generate
    refused(lambda: list(gen(gen_request(v, n=10**6), timeout=10)), match="sampling.n: 1000000 samples per prompt")
    refused(lambda: list(gen(gen_request(v, prompts=limits.MAX_GENERATE_PROMPTS + 1), timeout=10)),
            match="(--max-prompts)")
    refused(lambda: list(gen(gen_request(v, prompts=1000, n=1000, max_tokens=60), timeout=10)),
            match="(--max-generated-tokens)")
    refused(lambda: list(gen(gen_request(v, temperature=float("inf")), timeout=10)), match="temperature must be finite")
    refused(lambda: list(gen(gen_request(v, temperature=float("nan")), timeout=10)), match="temperature must be finite")
    refused(lambda: list(gen(gen_request(v, top_p=float("nan")), timeout=10)), match="top_p")
    tiny = [r.sample for r in gen(gen_request(v, n=2, temperature=1e-300, max_tokens=6), timeout=30)]
    greedy = [r.sample for r in gen(gen_request(v, n=2, temperature=0.0, max_tokens=6), timeout=30)]
    assert [list(s.token_ids) for s in tiny] == [list(s.token_ids) for s in greedy] and len(tiny) == 2
    svc.healthy("rollout-0")


def test_a_cancelled_long_generate_frees_the_engine(svc):
    v = serving_version(svc)
    long = svc.roll().Generate(gen_request(v, prompts=64, n=256, max_tokens=60), timeout=120)  # minutes of decoding
    time.sleep(1.0)
    long.cancel()
    t0 = time.monotonic()
    small = [r.sample for r in svc.roll().Generate(gen_request(v, max_tokens=4), timeout=10)]
    assert len(small) == 1 and time.monotonic() - t0 < 5.0
    with pytest.raises(grpc.RpcError) as err:
        list(long)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    past = svc.roll().Generate(gen_request(v, prompts=64, n=256, max_tokens=60), timeout=1.0)  # deadline, not cancel
    with pytest.raises(grpc.RpcError) as err:
        list(past)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    t0 = time.monotonic()
    assert len(list(svc.roll().Generate(gen_request(v), timeout=10))) == 1 and time.monotonic() - t0 < 5.0
    svc.healthy("rollout-0")


def test_long_calls_filling_the_workers_never_starve_health_or_status(svc):
    v = serving_version(svc)
    calls = [svc.roll().Generate(gen_request(v, prompts=64, n=256, max_tokens=60), timeout=60) for _ in range(10)]
    try:
        time.sleep(1.0)  # all ten reached the server: some run or wait for the engine, the rest were refused
        for _ in range(3):
            svc.healthy("rollout-0")
        refused_now = []
        for c in calls:
            if c.done():
                with pytest.raises(grpc.RpcError) as err:
                    list(c)
                refused_now.append(err.value.code())
        assert refused_now and set(refused_now) == {grpc.StatusCode.UNAVAILABLE}, refused_now  # "busy, retry"
    finally:
        for c in calls:
            c.cancel()
    t0 = time.monotonic()  # the cancelled calls let go of their slots and the engine within a decode step
    while True:
        try:
            assert len(list(svc.roll().Generate(gen_request(v), timeout=10))) == 1
            break
        except grpc.RpcError as err:  # "busy" only until the cancelled calls have noticed
            assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5.0, err
            time.sleep(0.05)
    assert time.monotonic() - t0 < 5.0


def test_too_many_watch_streams_are_resource_exhausted_and_get_job_still_answers(svc):
    job_id = submit(svc, tiny_job(svc, job={"steps": 50, "checkpoint_every": 0})).job_id
    per_client = limits.MAX_WATCH_STREAMS_PER_CLIENT
    clients = [make_channel(svc.stack.target, token=svc.stack.client_token, tls_ca="", own_connection=True)
               for _ in range(limits.MAX_WATCH_STREAMS // per_client)]
    streams = [controller_pb2_grpc.JobServiceStub(c).WatchJob(controller_pb2.WatchJobRequest(job_id=job_id),
                                                              timeout=120) for c in clients for _ in range(per_client)]
    try:
        time.sleep(1.0)  # let the streams start on the server
        refused(lambda: list(svc.jobs().WatchJob(controller_pb2.WatchJobRequest(job_id=job_id), timeout=10)),
                EXHAUSTED, match=f"{limits.MAX_WATCH_STREAMS} WatchJob streams are open")
        refused(lambda: list(controller_pb2_grpc.JobServiceStub(clients[0]).WatchJob(
            controller_pb2.WatchJobRequest(job_id=job_id), timeout=10)), EXHAUSTED, match="the limit per client")
        svc.healthy("controller")
        assert svc.jobs().GetJob(controller_pb2.GetJobRequest(job_id=job_id), timeout=FAST_S).job.job_id == job_id
    finally:
        for s in streams:
            s.cancel()
        for c in clients:
            c.close()
    cancelled = svc.jobs().CancelJob(controller_pb2.CancelJobRequest(job_id=job_id), timeout=60).job
    assert cancelled.state == "cancelled", cancelled
    deadline = time.monotonic() + 10  # closed streams give their slots back
    while True:
        try:
            list(svc.jobs().WatchJob(controller_pb2.WatchJobRequest(job_id=job_id), timeout=10))
            break
        except grpc.RpcError as err:
            assert err.code() == EXHAUSTED and time.monotonic() < deadline, err
            time.sleep(0.2)


# -- fuzz --------------------------------------------------------------------------------------------------------

def _fuzz_cases() -> list[tuple[str, str, bool, bytes]]:
    """(process, method, server-streaming, a valid request that is refused for a reason mutations rarely undo)."""
    far = 10**12  # a weight version nobody holds
    row = trainer_pb2.Sequence(prompt_ids=PROMPT, response_ids=[30, 31], gen_logprobs=[-1.0, -1.0], advantage=1.0)
    cases = [
        ("rollout-0", "/fp8rl.v1.RolloutService/Generate", True, gen_request(far)),
        ("rollout-0", "/fp8rl.v1.RolloutService/Status", False, rollout_pb2.RolloutStatusRequest()),
        ("trainer", "/fp8rl.v1.TrainerService/TrainStep", False,
         trainer_pb2.TrainStepRequest(expected_version=far, rows=[row])),
        ("trainer", "/fp8rl.v1.TrainerService/ComputeLogprobs", False,
         trainer_pb2.ComputeLogprobsRequest(expected_version=far, rows=[row])),
        ("trainer", "/fp8rl.v1.TrainerService/SaveCheckpoint", False, trainer_pb2.SaveCheckpointRequest(path="/x")),
        ("trainer", "/fp8rl.v1.TrainerService/Status", False, trainer_pb2.TrainerStatusRequest()),
        ("trainer", "/fp8rl.v1.WeightStore/GetManifest", False, weights_pb2.GetManifestRequest(version=far)),
        ("trainer", "/fp8rl.v1.WeightStore/StreamShards", True, weights_pb2.StreamShardsRequest(version=far)),
        ("calibrator", "/fp8rl.v1.CalibratorService/Calibrate", False, calibrator_pb2.CalibrateRequest(
            version=far, sequences=[common_pb2.TokenSequence(token_ids=PROMPT)])),
        ("reward", "/fp8rl.v1.RewardService/Score", False, reward_pb2.ScoreRequest(
            items=[reward_pb2.ScoreItem(response="4", answer="4", grader="no-such-grader")])),
        ("controller", "/fp8rl.v1.JobService/SubmitJob", False,
         controller_pb2.SubmitJobRequest(job_yaml="job: {stepz: 1}\npolicy: {model: elsewhere}")),
        ("controller", "/fp8rl.v1.JobService/WatchJob", True, controller_pb2.WatchJobRequest(job_id="no-such-job")),
        ("controller", "/fp8rl.v1.JobService/GetJob", False, controller_pb2.GetJobRequest(job_id="no-such-job")),
        ("controller", "/fp8rl.v1.JobService/ListJobs", False, controller_pb2.ListJobsRequest(state="nope")),
        ("controller", "/fp8rl.v1.JobService/CancelJob", False, controller_pb2.CancelJobRequest(job_id="no-such-job")),
        ("controller", "/grpc.health.v1.Health/Check", False, health_pb2.HealthCheckRequest(service="x")),
    ]
    return [(p, m, s, r.SerializeToString()) for p, m, s, r in cases]


def _mutations(rng: random.Random, valid: bytes, count: int):
    """``count`` byte strings: half uniformly random, half the valid request with bytes flipped, cut or added."""
    for i in range(count):
        if i % 2 == 0 or not valid:
            yield rng.randbytes(rng.randrange(0, 64))
            continue
        data = bytearray(valid)
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(3)
            if op == 0 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op == 1 and data:
                del data[rng.randrange(len(data)):]
            else:
                data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        yield bytes(data)


def test_fuzzed_request_bytes_never_get_internal_or_unknown_and_every_service_stays_up(svc):
    serving_version(svc)  # so the rollout replica serves (and is checked SERVING at the end)
    rng = random.Random(12)
    bad: list[tuple[str, grpc.StatusCode, str, bytes]] = []
    seen: dict[grpc.StatusCode, int] = {}
    lock = threading.Lock()

    def one(proc: str, method: str, streaming: bool, data: bytes) -> None:
        ch = svc.ch(proc)
        try:
            if streaming:
                list(ch.unary_stream(method)(data, timeout=10))
            else:
                ch.unary_unary(method)(data, timeout=10)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
        with lock:
            seen[code] = seen.get(code, 0) + 1
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                bad.append((method, code, details[:300], data))

    jobs = [(p, m, s, d) for p, m, s, valid in _fuzz_cases() for d in _mutations(rng, valid, FUZZ_PER_RPC)]
    with ThreadPoolExecutor(4) as ex:  # under every server's long-call cap, so nothing here is refused as busy
        list(ex.map(lambda j: one(*j), jobs))
    assert not bad, bad[:5]
    assert seen.get(INVALID, 0) > len(jobs) // 4, seen  # most random bytes do not even parse
    for name in ("controller", "rollout-0", "trainer", "reward", "calibrator"):
        svc.healthy(name)
