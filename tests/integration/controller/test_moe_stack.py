"""Mixture-of-experts jobs through the service stack (issue 27, ``make test-moe``).

Stacks launched as a user would (``deploy.launcher up``):

* the ``tiny-arith-moe`` preset (8 experts, top-2, every layer; warm-started by the launcher on first use), fp8_e2e +
  FP8 KV + **routing replay**: the rollout replica records each sample's routes, they travel with the sample through
  the controller to TrainStep (``common.Routes``), and the trainer's passes use them — every step reports
  ``moe/router_agreement`` (its own routing against the rollout's) and the mismatch without replay;
* a small random Qwen3-MoE (4 experts, top-2, one dense layer among the MoE ones), fp8_e2e + FP8 KV + **batch
  invariance** and no replay, the trainer over 2 FSDP2 ranks: routing and every logprob agree bitwise,
  ``token_mult_prob_error`` exactly 1.0 each step;
* TrainStep refuses rows whose routes are missing or malformed, naming the row, and trains nothing.
"""

from __future__ import annotations

import re

import grpc
import pytest
import torch

from fp8rl.model import CausalLM, ModelConfig, save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.rpc import trainer_pb2, trainer_pb2_grpc
from fp8rl.rpc.channel import make_channel
from fp8rl.rpc.routes import routes_to_proto

from .conftest import Stack, assert_zero_mismatch, down, run_stack_job, tiny_job
from .test_controller import WATCH_S

pytestmark = [pytest.mark.integration, pytest.mark.moe]

EXPERTS, TOP_K = 4, 2
PRESET_EXPERTS = 8  # tiny-arith-moe


def tiny_moe_model(path) -> tuple:
    """A seeded random 3-layer, 128-wide Qwen3-MoE (layer 1 dense) + the character tokenizer."""
    tok = CharTokenizer()
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=64, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                      pad_token_id=tok.pad_id, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                      moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.05)
    torch.manual_seed(0)
    save_hf_checkpoint(CausalLM(cfg), cfg, path)
    tok.save(path)
    return path, cfg


def _run_job(tmp_path, model: str | None = None, **changes) -> tuple[list, object, Stack]:
    model_dir, _ = tiny_moe_model(tmp_path / "model")
    job = tiny_job(model_dir, max_new_tokens=10)
    job["job"]["steps"] = 3
    if model is not None:  # a preset instead of the random checkpoint
        job["policy"]["model"] = model
    for section, values in changes.items():
        job["policy"].setdefault(section, {}).update(values)
    return run_stack_job(tmp_path, job, model_dir, watch_s=WATCH_S * 3)  # the caller takes the stack down


def test_replay_through_the_stack_and_trainstep_refuses_bad_routes(tmp_path):
    reports, info, stack = _run_job(tmp_path, "tiny-arith-moe",
                                    router_replay={"enabled": True, "measure_unreplayed": True})
    try:
        assert (info.state, info.error) == ("succeeded", ""), info.error
        assert [r.step for r in reports] == [0, 1, 2]
        for r in reports:
            m = r.metrics
            # the preset answers before any update (decoded tokens carry routes too); after an update at lr 0.01 on
            # 8 samples a policy may answer with EOS alone, which is not what this test is about
            assert m["response_len"] > (1 if r.step == 0 else 0)
            assert 0.0 <= m["moe/router_agreement"] <= 1.0 and m["moe/unreplayed/token_mult_prob_error"] >= 1.0
            assert 1.0 <= m["moe/load_max_over_mean"] <= PRESET_EXPERTS and "moe/load/3/7" in m
        trainer = trainer_pb2_grpc.TrainerServiceStub(make_channel(
            f"127.0.0.1:{stack.process('trainer')['port']}", token=stack.service_token, tls_ca=""))
        version = trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version
        # a row of 3 prompt + 2 response tokens: 4 fed tokens x 4 MoE layers x top-2
        good = routes_to_proto(torch.tensor([[[0, 1]] * 4] * 4, dtype=torch.uint8))
        short = routes_to_proto(torch.tensor([[[0, 1]] * 4] * 3, dtype=torch.uint8))  # 3 tokens, not 4

        def row(routes):
            return trainer_pb2.Sequence(prompt_ids=[1, 20, 21], response_ids=[30, 31], gen_logprobs=[-1.0, -1.0],
                                        advantage=1.0, **({"routes": routes} if routes is not None else {}))

        for bad, match in ((None, "sample 1: routing replay is on, but the sample carries no routes"),
                           (short, r"sample 1: routes have shape \(3, 4, 2\), expected \(4, 4, 2\)")):
            with pytest.raises(grpc.RpcError) as err:
                trainer.TrainStep(trainer_pb2.TrainStepRequest(expected_version=version, rows=[row(good), row(bad)]),
                                  timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details()
            assert re.search(match, err.value.details()), err.value.details()
        assert trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version == version  # nothing trained
    finally:
        down(stack)


def test_batch_invariance_gives_zero_moe_mismatch_without_replay_on_two_trainer_ranks(tmp_path):
    reports, info, stack = _run_job(tmp_path, numerics={"batch_invariant": True},
                                    training={"dp_size": 2, "micro_batch_size": 3})
    down(stack)
    assert_zero_mismatch(info, reports, 3)
    for r in reports:
        assert "moe/router_agreement" not in r.metrics  # no replay: the rollout shipped no routes
        assert r.metrics["moe/load_max_over_mean"] >= 1.0  # the load, summed over both ranks, reaches the report


def tiny_deepseek_model(path) -> tuple:
    """A seeded random 3-layer, 128-wide DeepSeek-V3 (issue 34): MLA (latent 64, rotary 32), 4 routed experts in 2
    groups (top-2 within 1 group), one shared expert, layer 0 dense, + the character tokenizer."""
    tok = CharTokenizer()
    cfg = ModelConfig(architecture="deepseek_v3", vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=3, num_attention_heads=2, max_position_embeddings=64,
                      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                      num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=128, norm_topk_prob=True,
                      n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                      routed_scaling_factor=2.5, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                      v_head_dim=64, rope_interleave=True, initializer_range=0.05)
    torch.manual_seed(0)
    save_hf_checkpoint(CausalLM(cfg), cfg, path)
    tok.save(path)
    return path, cfg


def test_a_deepseek_family_job_with_an_fp8_latent_cache_has_zero_mismatch_and_replays(tmp_path):
    """A 3-step job on a DeepSeek-V3-shaped model: fp8_e2e, the FP8 latent KV cache (the calibrator service measures
    the latent's and the rotary key's scales each step and they ship with the version), batch invariance, and
    routing replay (the routes of the sigmoid group-limited router travel with the samples): every step's
    trainer logprobs are the rollout's bitwise and the replayed routes are the trainer's own."""
    model_dir, _ = tiny_deepseek_model(tmp_path / "model")
    job = tiny_job(model_dir, max_new_tokens=10)
    job["job"]["steps"] = 3
    job["policy"]["numerics"] = {"batch_invariant": True}
    job["policy"]["router_replay"] = {"enabled": True}
    reports, info, stack = run_stack_job(tmp_path, job, model_dir, watch_s=WATCH_S * 3)
    down(stack)
    assert_zero_mismatch(info, reports, 3)
    assert all(r.metrics["moe/router_agreement"] == 1.0 for r in reports)
