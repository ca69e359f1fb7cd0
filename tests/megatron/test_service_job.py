"""A 3-step GRPO job through the real service stack with ``policy.training.backend: megatron``.

The trainer runs on one rank and on two: ``policy.training.dp_size: 2`` (the launcher starts it under torchrun,
Megatron-Core DDP sums the gradients) and ``megatron_cfg.pipeline_model_parallel_size: 2`` (two pipeline stages,
Megatron's 1F1B schedule). The stack is started exactly as in the controller tests (``python -m deploy.launcher
up``: redis-server, trainer, calibrator, reward, one rollout replica, controller as real processes) and driven
with the SDK; their helpers are reused from ``tests/integration/controller/conftest.py``.
Step 0 runs on the initial weights, so its numbers must equal the in-process loop's (torch backend) exactly as
the torch stack's do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fp8rl.loop import LoopConfig, run
from fp8rl.rl.metrics import mismatch_promise
from fp8rl.rpc import trainer_pb2, trainer_pb2_grpc
from fp8rl.rpc.channel import make_channel
from fp8rl.sdk import Fp8rlClient

pytestmark = [pytest.mark.megatron, pytest.mark.integration]

STEPS = 3
WATCH_S = 180.0


@pytest.fixture(scope="module", params=[pytest.param((1, 1), marks=pytest.mark.slow), (2, 1),
                                            pytest.param((1, 2), marks=pytest.mark.slow)],
                ids=["dp1", "dp2", "pp2"])  # dp1, pp2: make test-megatron-full (dp2 runs a multi-rank trainer service;
                # pipeline stages are test_data_parallel's)
def megatron_stack(megatron_core, tmp_path_factory, request, controller_stack):
    """The stack with a Megatron trainer on one rank, then on two (torchrun): two data-parallel ranks (Megatron-Core
    DDP), then two pipeline stages (Megatron's 1F1B schedule, one layer each)."""
    h = controller_stack
    tmp = tmp_path_factory.mktemp("megatron-stack")
    model_dir = h.tiny_model(tmp / "model")
    job = h.tiny_job(model_dir, steps=STEPS, checkpoint_every=0)
    job["policy"]["training"]["backend"] = "megatron"
    job["policy"]["training"]["dp_size"], pp = request.param
    job["policy"]["training"]["megatron_cfg"]["pipeline_model_parallel_size"] = pp
    job_file = tmp / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir = tmp / "run"
    up = h.launcher("up", "--job", str(job_file), "--run-dir", str(run_dir), "--ready-timeout", "180")
    if up.returncode != 0:
        pytest.fail(f"launcher up failed ({up.returncode}):\n{up.stderr[-4000:]}", pytrace=False)
    try:
        yield h.Stack(run_dir, job_file, model_dir)
    finally:
        h.launcher("down", "--run-dir", str(run_dir), "--grace", "10", timeout=60)


def test_three_step_job_on_the_megatron_backend(megatron_stack):
    stack = megatron_stack
    trainer = trainer_pb2_grpc.TrainerServiceStub(
        make_channel(f"127.0.0.1:{stack.process('trainer')['port']}", token=stack.service_token, tls_ca=""))
    status = trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=30)
    assert (status.backend, status.recipe, status.version) == ("megatron", "fp8_e2e", 0)

    with Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=30) as c:
        job_id = c.submit_job(stack.job_file)
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        info = c.get_job(job_id)
    assert (info.state, info.step, info.total_steps, info.error) == ("succeeded", STEPS, STEPS, "")
    assert [(r.step, r.weight_version) for r in reports] == [(i, i) for i in range(STEPS)]
    for r in reports:
        print(f"step {r.step}: token_mult_prob_error {r.token_mult_prob_error:.5f}")
        # rollout (torch FP8, FP8 KV) vs Megatron trainer logprobs: the same promise as the torch backend's
        assert 1.0 <= r.token_mult_prob_error <= mismatch_promise("fp8_e2e", "fp8", over="step")
        assert {"train/loss", "train/grad_norm"} <= set(r.metrics)
    assert trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=30).version == STEPS
    training = yaml.safe_load(stack.job_file.read_text())["policy"]["training"]
    log = Path(stack.process("trainer")["log"]).read_text()
    if training["dp_size"] == 2:
        assert "trainer rank 0 of 2 (Megatron-Core DDP over gloo)" in log
    if training["megatron_cfg"]["pipeline_model_parallel_size"] == 2:
        assert "trainer rank 0 of 2 (Megatron-Core DDP, tensor x pipeline parallel 1 x 2 over gloo)" in log

    # Step 0 is on the initial weights: same rollouts as the in-process loop, and the Megatron trainer's
    # logprobs equal the torch backend's there, so the mismatch metric is the loop's too. The loop runs the
    # numerics a Megatron job resolves to: batch invariance off (the torch backend's default is on).
    loop = run(LoopConfig.from_flags(model=str(stack.model_dir), recipe="fp8_e2e", kv_cache_dtype="fp8", steps=1,
                          prompts_per_step=4, group_size=2, max_tokens=4, lr=0.01, micro_batch_size=8,
                          calibration_max_sequences=4, eval_size=2, seed=0, batch_invariant=False),
               progress=False)["steps"]
    r, h = reports[0], loop[0]
    assert r.reward_mean == pytest.approx(h["reward_mean"])
    assert r.metrics["response_len"] == pytest.approx(h["response_len"])
    assert r.token_mult_prob_error == pytest.approx(h["token_mult_prob_error"], rel=1e-5)
    assert r.metrics["train/loss"] == pytest.approx(h["train/loss"], rel=1e-4)
