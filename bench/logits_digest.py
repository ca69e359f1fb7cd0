"""Digest of every model family's numbers under every recipe: one SHA-256 per family × recipe × KV dtype.

Not a timing. A refactor of the model or the FP8 code that must leave the numbers bitwise unchanged (issue 49:
families and formats as plug-ins) runs this at the parent commit and at its own, on the same machine, and
compares the lines: each digest covers a random-init model's FP32 logits of a padded batch (the plain forward),
the rollout engine's sampled tokens and logprobs, and the trainer's logprobs of them (batch invariance on).

    python bench/logits_digest.py > /tmp/before.txt   # at the parent
    python bench/logits_digest.py | diff /tmp/before.txt -
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import DEFAULT_SCALING, SCALINGS, recipe_for_role
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.model.family import get_family

_COMMON = dict(vocab_size=160, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5)
FAMILIES = [  # one small config per family (its architecture names it)
    dict(architecture="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    dict(architecture="qwen2", tie_word_embeddings=True),
    dict(architecture="qwen3", head_dim=64),
    dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
         norm_topk_prob=True),
    dict(architecture="deepseek_v3", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
         n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=64, kv_lora_rank=32,
         qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, rope_interleave=True, routed_scaling_factor=2.5),
    dict(architecture="gemma3_text", head_dim=32, sliding_window=7, query_pre_attn_scalar=24,
         layer_types=("sliding_attention", "full_attention"), rope_linear_factor=2.0),
]
RECIPES = [("bf16", DEFAULT_SCALING)] + [("fp8_e2e", s) for s in SCALINGS]


def digest(family: dict, recipe: str, scaling: str, kv: str) -> str:
    torch.manual_seed(0)
    config_class = get_family(family["architecture"]).config_class or ModelConfig
    model = CausalLM(config_class(**_COMMON, **family))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 150, (n,), generator=g).tolist() for n in (3, 17, 9, 40)]
    h = hashlib.sha256()
    ids = torch.zeros(len(prompts), 40, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, 40 - len(p):], mask[i, 40 - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        h.update(model(ids, attention_mask=mask).numpy().tobytes())
    rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=True, scaling=scaling)
    tr = recipe_for_role(recipe, "trainer", kv_cache_dtype=kv, batch_invariant=True, scaling=scaling)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=3)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=5))
    if kv == "fp8":
        scales = QKVCalibrator(model, pad_token_id=0).calibrate(0, prompts)
        engine.load_scales(scales)
        if trainer.needs_qkv_scales:
            trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=3))
    batch = build_train_batch(samples, torch.zeros(len(samples)), 2, 0)
    h.update(batch.input_ids.numpy().tobytes())
    h.update(batch.gen_logprobs.numpy().tobytes())
    h.update(trainer.compute_logprobs(batch).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=[f["architecture"] for f in FAMILIES])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for fam in FAMILIES:
        if fam["architecture"] not in args.families:
            continue
        for recipe, scaling in RECIPES:
            for kv in ("auto", "fp8"):
                print(f"{fam['architecture']:12s} {recipe:8s} {scaling:10s} kv={kv:5s} "
                      f"{digest(fam, recipe, scaling, kv)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
