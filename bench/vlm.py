"""Vision-language RL on tiny-vl (issue 55's measurements), in one process:

    python bench/vlm.py [--steps 6] [--learning-steps 200] [--seeds 0 1 2] [--eval-size 256] [--eval-every 25]

1. **Mismatch per recipe, with and without batch invariance, on picture prompts**: the in-process loop on
   ``data.task: shapes`` for ``--steps`` steps per (recipe × invariance) — bf16, fp8_e2e with an FP8 KV cache —
   reporting the worst step's ``max |Δlogprob|`` and the mean ``token_mult_prob_error`` (1 = exact).
2. **Step time fp8_e2e vs bf16** on the VLM (the mean step of those runs, invariance on; one run each, so the
   ratio carries the VM's run-to-run noise) and **the vision encoder's share of the step**: the encoder's
   forward is timed inside each run (each prompt's picture encoded once per step by the rollout and once by the
   trainer); "without per-group sharing" is that time × the group size (every sample encoding its own copy:
   computed from the measured time, not run).
3. **Learning** (``--learning-only``: this part alone): ``--learning-steps`` steps of the vlm job (fp8_e2e, FP8 KV,
   invariance; ``--train-encoder``: the vision encoder trained too) per seed; the greedy accuracy on ``--eval-size``
   held-out pictures before → after (and every ``--eval-every`` steps), the training reward of the first → last 10
   steps (each step's pictures are new), with the mean gain and its spread over seeds (max − min, and the standard
   deviation).
4. ``--fp8-encoder`` (this part alone): the vision encoder's linears in FP8 too
   (``policy.generation.vllm_cfg.fp8_vision_encoder``) against the high-precision encoder: mismatch with and
   without invariance, step time, the encoder's seconds per step, and one learning run each.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fp8rl.config import JobConfig
from fp8rl.loop import LoopConfig, run
from fp8rl.model.vision import VisionEncoder
from fp8rl.rl import MAX_ABS_LOGPROB_DIFF

ENCODER_SECONDS: list[float] = []


def _timed_encoder() -> None:
    forward = VisionEncoder.forward

    def timed(self, images):
        t = time.perf_counter()
        out = forward(self, images)
        ENCODER_SECONDS.append(time.perf_counter() - t)
        return out

    VisionEncoder.forward = timed


def _run(recipe: str, invariant: bool, steps: int, seed: int, eval_every: int = 0, lr: float = 2e-4,
         train_encoder: bool = False, eval_size: int = 64, fp8_encoder: bool = False) -> dict:
    job = JobConfig().with_settings({"data.task": "shapes", "job.eval_size": eval_size, "job.eval_every": eval_every,
                                     "policy.training.train_vision_encoder": train_encoder,
                                     "policy.generation.vllm_cfg.fp8_vision_encoder": fp8_encoder})
    cfg = LoopConfig.from_flags(job=job, model="tiny-vl", recipe=recipe,
                                kv_cache_dtype="fp8" if recipe != "bf16" else "auto", batch_invariant=invariant,
                                steps=steps, prompts_per_step=16, group_size=8, max_tokens=4, lr=lr,
                                micro_batch_size=64, calibration_max_sequences=16, seed=seed)
    ENCODER_SECONDS.clear()
    out = run(cfg, progress=False)
    return {"steps": out["steps"], "validation": out["validation"], "encoder_s": sum(ENCODER_SECONDS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--learning-steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr", type=float, default=1e-4, help="the learning runs' learning rate")
    ap.add_argument("--learning-only", action="store_true", help="skip parts 1 and 2")
    ap.add_argument("--train-encoder", action="store_true", help="the learning runs train the vision encoder too")
    ap.add_argument("--eval-size", type=int, default=256, help="held-out pictures the learning runs are judged on")
    ap.add_argument("--eval-every", type=int, default=25, help="the learning runs' validation interval")
    ap.add_argument("--fp8-encoder", action="store_true", help="only part 4: the vision encoder's linears in FP8 "
                    "(policy.generation.vllm_cfg.fp8_vision_encoder) against the high-precision encoder")
    args = ap.parse_args()
    _timed_encoder()
    if args.fp8_encoder:
        _fp8_encoder(args)
        return
    if not args.learning_only:
        _mismatch_and_time(args)
    _learning(args)


def _fp8_encoder(args) -> None:
    """fp8_e2e + FP8 KV with the encoder's linears in FP8 or not: mismatch with and without invariance, step time and
    the encoder's time (``--steps`` steps each), then one ``--learning-steps`` learning run per encoder (seed 0)."""
    print("encoder | invariance | max|dlogp| (worst step) | token_mult_prob_error (mean) | step s (mean) | "
          "encoder s per step")
    for fp8_encoder in (False, True):
        for invariant in (True, False):
            r = _run("fp8_e2e", invariant, args.steps, seed=0, fp8_encoder=fp8_encoder)
            worst = max(h[MAX_ABS_LOGPROB_DIFF] for h in r["steps"])
            err = statistics.fmean(h["token_mult_prob_error"] for h in r["steps"])
            mean_s = statistics.fmean(h["time/step"] for h in r["steps"][1:])
            print(f"{'fp8' if fp8_encoder else 'high precision'} | {'on' if invariant else 'off'} | {worst:.3e} | "
                  f"{err:.6f} | {mean_s:.3f} | {r['encoder_s'] / len(r['steps']):.4f}", flush=True)
    for fp8_encoder in (False, True):
        r = _run("fp8_e2e", True, args.learning_steps, seed=0, eval_every=args.eval_every, lr=args.lr,
                 eval_size=args.eval_size, fp8_encoder=fp8_encoder)
        val = {k: v["val_accuracy"] for k, v in sorted(r["validation"].items())}
        print(f"{'fp8' if fp8_encoder else 'high precision'} encoder, seed 0: greedy accuracy by step "
              f"{', '.join(f'{k}: {v:.3f}' for k, v in val.items())}", flush=True)


def _mismatch_and_time(args) -> None:
    print("recipe | invariance | max|dlogp| (worst step) | token_mult_prob_error (mean) | step s (mean) | "
          "encoder share | encoder share without sharing")
    step_s = {}
    for recipe in ("bf16", "fp8_e2e"):
        for invariant in (True, False):
            r = _run(recipe, invariant, args.steps, seed=0)
            hs = r["steps"][1:]  # step 0 pays the first forwards' one-off costs
            worst = max(h[MAX_ABS_LOGPROB_DIFF] for h in r["steps"])
            err = statistics.fmean(h["token_mult_prob_error"] for h in r["steps"])
            mean_s = statistics.fmean(h["time/step"] for h in hs)
            total = sum(h["time/step"] for h in r["steps"])
            share = r["encoder_s"] / total
            print(f"{recipe} | {'on' if invariant else 'off'} | {worst:.3e} | {err:.6f} | {mean_s:.3f} | "
                  f"{share:.1%} | {share * 8 / (1 + share * 7):.1%}")
            step_s[recipe, invariant] = mean_s
    print(f"ratio step_seconds fp8_e2e/bf16 (invariance on) {step_s['fp8_e2e', True] / step_s['bf16', True]:.3f}")
    print(f"ratio step_seconds fp8_e2e/bf16 (invariance off) {step_s['fp8_e2e', False] / step_s['bf16', False]:.3f}")


def _learning(args) -> None:
    gains, rewards = [], []
    for seed in args.seeds:
        r = _run("fp8_e2e", True, args.learning_steps, seed=seed, eval_every=args.eval_every, lr=args.lr,
                 train_encoder=args.train_encoder, eval_size=args.eval_size)
        val = {k: v["val_accuracy"] for k, v in sorted(r["validation"].items())}
        acc0, acc1 = val[min(val)], val[max(val)]
        rw = [h["reward_mean"] for h in r["steps"]]
        r0, r1 = statistics.fmean(rw[:10]), statistics.fmean(rw[-10:])
        gains.append(acc1 - acc0)
        rewards.append(r1 - r0)
        print(f"seed {seed}: greedy accuracy {acc0:.3f} -> {acc1:.3f} (by step: "
              f"{', '.join(f'{k}: {v:.3f}' for k, v in val.items())}); reward first 10 -> last 10 steps "
              f"{r0:.3f} -> {r1:.3f}", flush=True)
    for name, g in (("greedy accuracy", gains), ("training reward", rewards)):
        sd = statistics.stdev(g) if len(g) > 1 else 0.0
        print(f"{name} gain: mean {statistics.fmean(g):+.3f}, spread over {len(g)} seeds: max - min "
              f"{max(g) - min(g):.3f}, standard deviation {sd:.3f}; mean / (max - min) "
              f"{statistics.fmean(g) / max(max(g) - min(g), 1e-9):.2f}")


if __name__ == "__main__":
    main()
