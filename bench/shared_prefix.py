"""Shared prompts run once (rollout and trainer) vs once per row, in one run: the calculator job's first turn.

    python bench/shared_prefix.py [--prompts 4] [--n 8] [--recipe fp8_e2e] [--kv fp8] [--max-tokens 96]
                                  [--micro-batch 16]

Model: a random-init Llama of the tiny-arith-tool preset's shape (4 layers, 256 wide, the ChatML character
tokenizer, 2048 positions; random weights are enough: the cost is the shapes'), batch-invariant, in ``--recipe``
with ``--kv``. Prompts: ``--prompts`` calculator tasks rendered as the job renders them (the system prompt and the
Hermes tools block, ~1,000 tokens, then the question), ``--n`` samples each at temperature 1 (EOS kept: turns end
where the model stops).

Rollout: one ``generate`` with each prompt repeated ``--n`` times, repeats prefilled once (the default) vs every
row prefilled whole. Trainer: ``compute_logprobs`` and one ``train_step`` on those samples with
``share_prefix`` on vs off (micro-batches of ``--micro-batch`` rows). Prints the seconds of each and

    ratio seconds/rollout_shared_vs_whole X   ratio seconds/logprobs_shared_vs_whole X   ratio seconds/train_...

and whether the shared runs' samples and logprobs are bitwise the unshared ones' (they must be under invariance).
The two arms alternate (shared first, then whole) on this noisy shared machine; every ratio is from this run.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from fp8rl.engines import SamplingParams, TorchRolloutEngine
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.envs import CalculatorEnv, ChatRenderer, make_calculator_tasks
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM
from fp8rl.model.tokenizer import load_tokenizer, stop_token_ids
from fp8rl.presets.chatml import build_chatml_tokenizer
from fp8rl.presets.tiny_arith_tool import tiny_arith_tool_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--recipe", default="fp8_e2e", choices=("bf16", "fp8_e2e"))
    ap.add_argument("--kv", default="fp8", choices=("auto", "fp8"))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--micro-batch", type=int, default=16)
    args = ap.parse_args()

    tok = load_tokenizer(build_chatml_tokenizer(tempfile.mkdtemp(prefix="fp8rl-bench-")))
    torch.manual_seed(0)
    model = CausalLM(tiny_arith_tool_config()).eval()
    renderer, env = ChatRenderer(tok), CalculatorEnv()
    prompts = [renderer.opening(env.reset(t), env.tools()) for t in make_calculator_tasks(args.prompts, seed=0)]
    print(f"{args.prompts} prompts x n={args.n}, {len(prompts[0])} tokens each; {args.recipe}, kv {args.kv}")
    rr = recipe_for_role(args.recipe, "rollout", kv_cache_dtype=args.kv, batch_invariant=True)
    tr = recipe_for_role(args.recipe, "trainer", kv_cache_dtype=args.kv, batch_invariant=True)
    scales = QKVCalibrator(model, pad_token_id=tok.pad_id).calibrate(0, prompts) if args.kv == "fp8" else None
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=1)

    seconds: dict[str, dict[str, float]] = {"shared": {}, "whole": {}}
    outs: dict[str, tuple] = {}
    for arm in ("shared", "whole"):
        engine = TorchRolloutEngine(model, rr, eos_token_ids=stop_token_ids(tok), max_batch_size=256)
        if scales is not None:
            engine.load_scales(scales)
        if arm == "whole":
            engine._shared_prompts = lambda rows, found, version, scales: found  # every row prefilled whole
        t = time.perf_counter()
        samples = engine.generate(prompts, params)
        seconds[arm]["rollout"] = time.perf_counter() - t
        trainer = TorchTrainer(model, tr, TrainerConfig(lr=3e-4, micro_batch_size=args.micro_batch,
                                                        share_prefix=arm == "shared"))
        if scales is not None:
            trainer.load_qkv_scales(scales)  # version 0: the trainer holds the weights they were calibrated on
        batch = build_train_batch(samples, torch.arange(len(samples), dtype=torch.float32) % 2, args.n, tok.pad_id)
        t = time.perf_counter()
        lp = trainer.compute_logprobs(batch)
        seconds[arm]["logprobs"] = time.perf_counter() - t
        t = time.perf_counter()
        trainer.train_step(batch)
        seconds[arm]["train"] = time.perf_counter() - t
        mask = batch.loss_mask.bool()
        outs[arm] = ([(s.token_ids, s.logprobs) for s in samples], lp[mask], batch.gen_logprobs[mask])
        print(f"{arm:>6}: " + "  ".join(f"{k} {v:.2f} s" for k, v in seconds[arm].items())
              + f"  ({int(mask.sum())} generated tokens)")
    for phase in ("rollout", "logprobs", "train"):
        print(f"ratio seconds/{phase}_shared_vs_whole {seconds['shared'][phase] / seconds['whole'][phase]:.3f}")
    same_samples = outs["shared"][0] == outs["whole"][0]
    same_lp = torch.equal(outs["shared"][1], outs["whole"][1])
    exact = torch.equal(outs["shared"][1], outs["shared"][2])
    print(f"bitwise: samples {same_samples}, trainer logprobs {same_lp}, trainer = rollout {exact}")


if __name__ == "__main__":
    main()
