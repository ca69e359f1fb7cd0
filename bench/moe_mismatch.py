"""Train/rollout mismatch on mixture-of-experts models: recipes x {no replay, routing replay, batch invariance} x KV.

    python bench/moe_mismatch.py [--models tiny-arith-moe a3b-shape moonlight-shape] [--prompts 16 --n 4]

For each model, recipe (bf16, fp8_gen_only, fp8_e2e), KV cache (auto, fp8) and mode, one rollout batch with the torch
rollout engine (routes recorded) and the torch trainer's recompute of it:

* ``plain`` — neither replay nor batch invariance;
* ``R3`` — routing replay: the trainer uses the experts the rollout recorded;
* ``invariant`` — batch-invariant numerics in both engines, no replay.

Reports ``token_mult_prob_error`` (1.0 = near-identical), the router agreement and the max |Δlogprob| (0 = bitwise
equal: the exactness verdict) (share of real (token, layer) pairs
whose trainer top-k set equals the rollout's, measured at each layer before its replay). Models:

* ``tiny-arith-moe`` — the preset (4 layers, 8 experts, top-2, hidden 256), on its arithmetic prompts;
* ``a3b-shape`` — a random-init Qwen3-MoE of the Qwen3-30B-A3B family scaled to fit: 16 experts, top-4 with
  normalised weights, hidden 512, expert width 256, 4 layers, QK-norm, GQA 8:2 (random prompts);
* ``moonlight-shape`` — a random-init DeepSeek-V3 of the Moonlight-16B-A3B family scaled to fit (issue 34): MLA
  without ``q_lora_rank`` (latent 128, rotary 32, nope 64, value 64, 8 heads), 16 routed experts top-4 by sigmoid
  scores with a correction bias (Moonlight's one group), 2 shared experts, layer 0 dense, hidden 512, 4 layers
  (random prompts). With an FP8 KV cache its latent and rotary key are stored in E4M3; the table is followed by the
  KV-cache bytes per token and layer: FP8 latent, BF16 latent, and per-head K/V in BF16.

Prints one table per model and ``ratio mismatch/R3_vs_plain`` (the mismatch excess over 1 that replay leaves,
fp8_e2e + FP8 KV).
"""

from __future__ import annotations

import argparse
import time

import torch

from fp8rl.data import ArithConfig, ArithDataset
from fp8rl.engines import SamplingParams, TorchTrainer, TrainerConfig, build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.presets import TINY_ARITH_TASK, load_policy
from fp8rl.rl import MAX_ABS_LOGPROB_DIFF, max_abs_logprob_diff, token_mult_prob_error

RECIPES = ("bf16", "fp8_gen_only", "fp8_e2e")
MODES = ("plain", "R3", "invariant")


def a3b_shape() -> tuple[CausalLM, list[list[int]]]:
    torch.manual_seed(0)
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=2048, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
                      initializer_range=0.04)
    g = torch.Generator().manual_seed(1)
    return CausalLM(cfg).eval(), [torch.randint(3, 2048, (int(n),), generator=g).tolist()
                                  for n in torch.randint(8, 40, (64,), generator=g)]


def moonlight_shape() -> tuple[CausalLM, list[list[int]]]:
    torch.manual_seed(0)
    cfg = ModelConfig(architecture="deepseek_v3", vocab_size=2048, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=256, norm_topk_prob=True, n_shared_experts=2, first_k_dense_replace=1,
                      n_group=1, topk_group=1, routed_scaling_factor=2.446, kv_lora_rank=128, qk_nope_head_dim=64,
                      qk_rope_head_dim=32, v_head_dim=64, rope_interleave=True, rope_theta=50000.0,
                      initializer_range=0.04)
    model = CausalLM(cfg).eval()
    with torch.no_grad():  # a trained model's correction bias is not zero
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.01)
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(3, 2048, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 40, (64,), generator=g)]


def kv_bytes_per_token(c: ModelConfig) -> str:
    """The KV cache's bytes per token and layer: MLA's latent + rotary key in FP8 and BF16, and what per-head K/V of
    the same heads would cost in BF16."""
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    per_head = c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
    return (f"KV cache bytes per token and layer: FP8 latent {latent}, BF16 latent {2 * latent}, per-head K/V BF16 "
            f"{2 * per_head} (ratio fp8_latent/bf16_per_head_kv {latent / (2 * per_head):.4f}, "
            f"bf16_latent/bf16_per_head_kv {latent / per_head:.4f})")


def tiny_arith_moe() -> tuple[CausalLM, list[list[int]]]:
    model, tok, _ = load_policy("tiny-arith-moe")
    problems = ArithDataset(ArithConfig(**TINY_ARITH_TASK), seed=3).eval_set(64)
    return model.eval(), [tok.encode(p.prompt) for p in problems]


def measure(model: CausalLM, prompts, recipe: str, kv: str, mode: str, args) -> tuple[float, float, float]:
    """(token_mult_prob_error, router agreement, max |Δlogprob|) of one rollout batch and its recompute."""
    invariant = mode == "invariant"
    rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=invariant)
    tr = recipe_for_role(recipe, "trainer", kv_cache_dtype=kv, batch_invariant=invariant)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=args.prompts * args.n,
                                record_routes=True)
    # the replayed pass measures the router agreement in every mode (at each layer, before its replay)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=16, router_replay=True,
                                                    measure_unreplayed=mode != "R3"))
    if kv == "fp8":
        scales = QKVCalibrator(model, pad_token_id=0).calibrate(0, prompts[:args.prompts])
        engine.load_scales(scales)
        if trainer.needs_qkv_scales:
            trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts[:args.prompts], SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                                                     n=args.n, seed=5))
    batch = build_train_batch(samples, None, args.n, 0, advantages=torch.zeros(len(samples)),
                              route_shape=model.config.route_shape)
    replayed = trainer.compute_logprobs(batch)
    m = trainer.routing_metrics()
    if mode == "R3":
        err = float(token_mult_prob_error(replayed, batch.gen_logprobs, batch.loss_mask))
        max_d = max_abs_logprob_diff(replayed, batch.gen_logprobs, batch.loss_mask)
    else:
        err, max_d = m["moe/unreplayed/token_mult_prob_error"], m[f"moe/unreplayed/{MAX_ABS_LOGPROB_DIFF}"]
    return err, m["moe/router_agreement"], max_d


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-arith-moe", "a3b-shape", "moonlight-shape"],
                    choices=("tiny-arith-moe", "a3b-shape", "moonlight-shape"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    for name in args.models:
        model, prompts = {"tiny-arith-moe": tiny_arith_moe, "a3b-shape": a3b_shape,
                          "moonlight-shape": moonlight_shape}[name]()
        c = model.config
        print(f"\n{name}: {c.num_experts} experts top-{c.num_experts_per_tok}, hidden {c.hidden_size}, "
              f"{c.num_hidden_layers} layers; {args.prompts} prompts x {args.n} samples, {args.max_tokens} tokens",
              flush=True)
        print("| recipe | KV | " + " | ".join(f"{m}: mult_err / agreement / max abs Δlogprob" for m in MODES) + " |")
        print("|---|---|" + "---|" * len(MODES))
        res = {}
        for recipe in RECIPES:
            for kv in ("auto", "fp8"):
                t0 = time.perf_counter()
                cells = []
                for mode in MODES:
                    res[recipe, kv, mode] = measure(model, prompts, recipe, kv, mode, args)
                    err, agreement, max_d = res[recipe, kv, mode]
                    cells.append(f"{err:.7f} / {agreement:.4f} / {max_d:.1e}")
                print(f"| {recipe} | {kv} | " + " | ".join(cells) + f" |  ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        plain, r3 = res["fp8_e2e", "fp8", "plain"][0], res["fp8_e2e", "fp8", "R3"][0]
        print(f"ratio mismatch/R3_vs_plain {name} {(r3 - 1) / (plain - 1) if plain > 1 else float('nan'):.4f}")
        if c.is_mla:
            print(kv_bytes_per_token(c))


if __name__ == "__main__":
    main()
