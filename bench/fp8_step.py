"""One GRPO trainer step in FP8 against BF16 on the CPU reference path: same model, same batch, one run.

    python bench/fp8_step.py [--hidden 768 --layers 6 --vocab 8000 --rows 32 --seq 96 --mb 8 --minibatches 2
                              --steps 3] [--experts 16 --top-k 4 --moe-width 256]

A seeded Llama-shaped model (``--hidden`` need not be a multiple of 128: the FP8 blocks are padded, as on a
real checkpoint whose width is not) and one seeded batch. Each trainer runs :func:`fp8rl.engines.train_on_batch`
— prev logprobs, then ``--minibatches`` optimizer updates over micro-batches of ``--mb`` rows — ``--steps``
times after a warm-up, the trainers' steps interleaved round by round (the order rotating), so a drift of the
machine's speed reaches every trainer alike; each trainer's median step is reported, and each ratio is the median
of the rounds' ratios with their range. Three trainers:

* ``bf16``: the BF16 recipe (high-precision linears);
* ``fp8_e2e``: block-scaled FP8 linears, each weight quantized once per optimizer update
  (:class:`fp8rl.fp8.linear.WeightCache`);
* ``fp8_e2e_per_call``: the same with the cache off — every micro-batch forward (and the logprob pass)
  quantizes and dequantizes every weight again, what the trainer did before.

With ``--experts E`` the model is a Qwen3-MoE of the same shape whose every layer routes each token to ``--top-k``
of ``E`` experts of width ``--moe-width`` (the router FP32, each expert's linears FP8 per the recipe), computed as
grouped GEMMs (:mod:`fp8rl.model.grouped`); two more trainers run the per-expert reference loop
(``bf16_loop``, ``fp8_e2e_loop``: ``SparseMoeBlock.grouped = False``, what every MoE step ran before issue 54).

Prints ``ratio fp8_step/bf16_step`` (target ≤ 1.3), ``ratio fp8_per_call_step/bf16_step`` and
``ratio fp8_step/fp8_per_call_step``; with experts also ``ratio bf16_step/bf16_loop_step`` (grouped vs loop),
``ratio fp8_step/fp8_loop_step`` and ``ratio fp8_loop_step/bf16_loop_step`` (the loop's FP8 cost).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp8rl.engines import TorchTrainer, TrainBatch, TrainerConfig, train_on_batch
from fp8rl.fp8 import Fp8Linear, recipe_for_role
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.model.moe import SparseMoeBlock


def model(args) -> CausalLM:
    torch.manual_seed(0)
    heads = max(args.hidden // 64, 1)
    moe = dict(architecture="qwen3_moe", num_experts=args.experts, num_experts_per_tok=args.top_k,
               moe_intermediate_size=args.moe_width, norm_topk_prob=True) if args.experts else {"architecture": "llama"}
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                      num_attention_heads=heads, num_key_value_heads=max(heads // 3, 1), head_dim=64,
                      max_position_embeddings=max(args.seq, 64), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      **moe)
    return CausalLM(cfg)


def batch(args) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.rows, args.seq), generator=g)
    loss = torch.zeros_like(ids)
    loss[:, args.seq // 3:] = 1
    return TrainBatch(ids, torch.ones_like(ids), loss, torch.randn(args.rows, generator=g),
                      -torch.rand(ids.shape, generator=g) * loss)


def step_seconds(tr: TorchTrainer, args) -> float:
    """One step's seconds on the bench's batch."""
    b = batch(args)
    t0 = time.perf_counter()
    train_on_batch(tr, b)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE with this many experts per layer (0: dense)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-width", type=int, default=256)
    args = ap.parse_args(argv)
    policy = model(args)
    cfg = TrainerConfig(lr=1e-5, micro_batch_size=args.mb, num_minibatches=args.minibatches)
    experts = f", {args.experts} experts top-{args.top_k} of width {args.moe_width}" if args.experts else ""
    print(f"one trainer step, torch {torch.__version__}, threads={torch.get_num_threads()}: "
          f"{sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} "
          f"layers{experts}), batch {args.rows} x {args.seq}, micro-batch {args.mb}, {args.minibatches} updates "
          f"per step, median of {args.steps}")
    res = {}
    runs = [("bf16", "bf16", True, True), ("fp8_e2e", "fp8_e2e", True, True),
            ("fp8_e2e_per_call", "fp8_e2e", False, True)]
    if args.experts:
        runs += [("bf16_loop", "bf16", True, False), ("fp8_e2e_loop", "fp8_e2e", True, False)]
    trainers = {}
    for name, recipe, cache, grouped in runs:
        tr = TorchTrainer(policy, recipe_for_role(recipe, "trainer"), cfg)
        for m in tr.model.modules():
            if isinstance(m, Fp8Linear) and not cache:
                m.weight_cache = None
            if isinstance(m, SparseMoeBlock):
                m.grouped = grouped
        trainers[name] = tr
    times: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    for i in range(args.steps + 1):  # the first round warms every trainer up
        for name in names[i % len(names):] + names[:i % len(names)]:
            t = step_seconds(trainers[name], args)
            if i:
                times[name].append(t)
    res = {name: statistics.median(ts) for name, ts in times.items()}
    for name in names:
        print(f"  {name:17s} {res[name]:7.3f} s/step")

    def ratio(label: str, a: str, b: str) -> None:
        r = [x / y for x, y in zip(times[a], times[b], strict=True)]
        res[f"ratio {label}"] = statistics.median(r)
        print(f"ratio {label} {statistics.median(r):.4f} (median of {len(r)} rounds, range {min(r):.3f} .. "
              f"{max(r):.3f})")

    ratio("fp8_step/bf16_step", "fp8_e2e", "bf16")
    ratio("fp8_per_call_step/bf16_step", "fp8_e2e_per_call", "bf16")
    ratio("fp8_step/fp8_per_call_step", "fp8_e2e", "fp8_e2e_per_call")
    if args.experts:
        ratio("bf16_step/bf16_loop_step", "bf16", "bf16_loop")
        ratio("fp8_step/fp8_loop_step", "fp8_e2e", "fp8_e2e_loop")
        ratio("fp8_loop_step/bf16_loop_step", "fp8_e2e_loop", "bf16_loop")
    return res


if __name__ == "__main__":
    main()
