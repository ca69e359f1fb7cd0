"""Train/rollout mismatch and step time, per recipe × KV dtype × batch invariance, in one run.

    python bench/batch_invariance.py [--model tiny-arith|DIR|smollm2-135m-instruct] [--prompts 8 --n 4
                                      --max-tokens 24 --repeats 5] [--recipes bf16 fp8_e2e] [--kv auto fp8]

One GRPO step's two engine phases on the embedded engines: the rollout engine samples ``--prompts`` × ``--n``
responses of up to ``--max-tokens`` tokens (temperature 1, fixed seed), then the trainer recomputes their
logprobs and takes one optimizer step (:func:`fp8rl.engines.train_on_batch`). For every combination it
reports the mismatch of the trainer's logprobs against the rollout's (``mismatch/max_abs_logprob_diff``, 0 =
bitwise equal; ``token_mult_prob_error``; ``gen_kl_k3``) and the median step time (generate + train). The two
settings' engines are built side by side and stepped in alternation — ``--repeats`` rounds after a warm-up round,
which goes first alternating — so a drift of the machine's speed reaches both alike; ``ratio
step_invariant/step_plain`` per recipe and KV dtype is the median of the rounds' ratios, with their range (the cost
of batch invariance; issue 54's target is ≤ 1.10 on every shape).

Without ``--model`` a seeded random model of tiny-arith's shape (4 layers, 256 wide) and random prompts are
used, so nothing needs preparing; ``--model`` takes a preset name or a local HF checkpoint directory, whose
prompts are grade-school word problems in its tokenizer (chat template applied when it has one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import needs  # bench/needs.py: an optional model missing is one line, before any measurement
import torch

from fp8rl.engines import TorchTrainer, TrainerConfig, train_on_batch
from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.rl import MAX_ABS_LOGPROB_DIFF

QUESTIONS = [
    "Tom has 7 apples and buys 5 more. How many apples does he have?",
    "A box holds 12 pencils. How many pencils are in 3 boxes?",
    "Sara read 18 pages on Monday and 23 on Tuesday. How many pages did she read?",
    "A train travels 60 km each hour. How far does it go in 4 hours?",
    "There are 45 birds on a tree and 17 fly away. How many are left?",
    "Each ticket costs 8 dollars. How much do 9 tickets cost?",
    "A baker makes 96 rolls and packs them in bags of 8. How many bags does she fill?",
    "Ben is 14 years old. His sister is 5 years younger. How old is his sister?",
]


def policy_and_prompts(args) -> tuple[CausalLM, list[list[int]], int, list[int]]:
    """(model, prompts, pad id, eos ids)."""
    if args.model is None:
        torch.manual_seed(0)
        cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=256, intermediate_size=768,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 128, (int(n),), generator=g).tolist()
                   for n in torch.randint(6, 30, (args.prompts,), generator=g)]
        return CausalLM(cfg), prompts, 0, [2]
    from fp8rl.model.tokenizer import chat_template_of, render_chat_prompt, stop_token_ids
    from fp8rl.presets import load_policy

    model, tok, _ = load_policy(args.model)
    texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    if chat_template_of(tok) is not None:
        prompts = [tok.encode(render_chat_prompt(tok, t, None), add_bos=False) for t in texts]
    else:
        prompts = [tok.encode(t) for t in texts]
    return model, prompts, tok.pad_id, stop_token_ids(tok)


class Arm:
    """One setting's engines (rollout + trainer) of a recipe × KV dtype, with or without batch invariance."""

    def __init__(self, model, prompts, pad, eos, recipe: str, kv: str, invariant: bool, args) -> None:
        rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=invariant)
        tr = recipe_for_role(recipe, "trainer", kv_cache_dtype=kv, batch_invariant=invariant)
        self.engine = TorchRolloutEngine(model, rr, eos_token_ids=eos, pad_token_id=pad,
                                         max_batch_size=args.prompts * args.n)
        self.trainer = TorchTrainer(model, tr, TrainerConfig(lr=1e-6, micro_batch_size=args.micro_batch))
        self.scales = None
        if kv == "fp8":
            self.scales = QKVCalibrator(model, pad_token_id=pad).calibrate(0, prompts)
            self.engine.load_scales(self.scales)
        self.prompts, self.pad, self.args = prompts, pad, args
        self.metrics, self.tokens = None, 0

    def step(self, seed: int) -> float:
        """One generate + train step's seconds; the trainer stays at version 0's weights (lr 1e-6 and the same
        version every time: each repeat recomputes version 0's samples)."""
        t0 = time.perf_counter()
        params = SamplingParams(temperature=1.0, max_tokens=self.args.max_tokens, n=self.args.n, seed=seed)
        samples = self.engine.generate(self.prompts, params)
        batch = build_train_batch(samples, torch.randn(len(samples)), self.args.n, self.pad)
        if self.trainer.needs_qkv_scales:
            self.trainer.load_qkv_scales(self.scales)
        self.trainer._version = 0  # noqa: SLF001 - see the docstring
        out = train_on_batch(self.trainer, batch)
        self.metrics = self.metrics or out.metrics
        self.tokens = int(batch.loss_mask.sum())
        return time.perf_counter() - t0


def pair(model, prompts, pad, eos, recipe: str, kv: str, args) -> tuple[dict, dict, list[float]]:
    """Both settings' arms, stepped in alternation (which goes first alternates) after a warm-up step each:
    ``(plain, invariant, ratios)`` — each arm's median step and first step's metrics, and the per-repeat ratios."""
    arms = {inv: Arm(model, prompts, pad, eos, recipe, kv, inv, args) for inv in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    for i in range(args.repeats + 1):  # the first round warms both up
        order = (False, True) if i % 2 else (True, False)
        took = {inv: arms[inv].step(seed=i) for inv in order}
        if i:
            for inv in took:
                times[inv].append(took[inv])
            ratios.append(took[True] / took[False])
    rows = []
    for inv in (False, True):
        m = arms[inv].metrics
        rows.append({"step_s": statistics.median(times[inv]), "tmpe": m["token_mult_prob_error"],
                     "max_d": m[MAX_ABS_LOGPROB_DIFF], "kl": m["gen_kl_k3"], "tokens": arms[inv].tokens})
    return rows[0], rows[1], ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="preset name or HF checkpoint directory (default: random tiny)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per setting (after a warm-up)")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8_e2e"])
    ap.add_argument("--kv", nargs="+", default=["auto", "fp8"])
    args = ap.parse_args()
    if args.model is not None:  # a preset that needs its wheel, or a directory: say what is missing, in one line
        needs.model(args.model, instead="or leave --model out (a random model of tiny-arith's shape)")
    model, prompts, pad, eos = policy_and_prompts(args)
    print(f"model {args.model or 'random tiny-arith shape'}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"params, {args.prompts} prompts x {args.n}, <= {args.max_tokens} tokens, torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'recipe':8} {'kv':5} {'invariant':9} {'max |dlogprob|':>14} {'token_mult_prob_error':>22} "
          f"{'gen_kl_k3':>10} {'step s':>8}")
    for recipe in args.recipes:
        for kv in args.kv:
            plain, inv, ratios = pair(model, prompts, pad, eos, recipe, kv, args)
            for flag, r in ((False, plain), (True, inv)):
                print(f"{recipe:8} {kv:5} {str(flag):9} {r['max_d']:14.2e} {r['tmpe']:22.9f} {r['kl']:10.2e} "
                      f"{r['step_s']:8.3f}", flush=True)
            print(f"ratio step_invariant/step_plain {recipe} kv={kv}: {statistics.median(ratios):.3f} "
                  f"(median of {len(ratios)} interleaved repeats, range {min(ratios):.3f} .. {max(ratios):.3f})")

if __name__ == "__main__":
    main()
