"""Does a recipe learn? The e2e learning judge, run for several recipes on the tiny-arith task.

    python bench/learning.py [--steps 32] [--runs bf16 fp8_e2e:fp8 fp8_e2e:fp8:invariant] [--seed 0]
                             [--model tiny-arith-moe --runs bf16 fp8_e2e:fp8:replay]

Each run is the in-process loop (``fp8rl.loop``) with the settings of the e2e learning test
(``tests/e2e/test_loop.py``: 16 prompts x 8 samples, lr 1e-4, 4 mini-batches, two-operand arithmetic up to 9), a
run spec ``RECIPE[:KV][:invariant][:replay][:mxfp8|tensorwise][:lora]`` choosing the recipe, the KV cache dtype
(default ``auto``), batch-invariant numerics, the FP8 recipe variant (default blockwise), (mixture-of-experts models,
``--model tiny-arith-moe``) routing replay, and LoRA (rank 16, alpha 32, lr 1e-3: LoRA's usual 10x the full
fine-tune's rate). The statistic
is the test's: the rollout engine's expected reward over every distinct problem of the task (126), ``EVAL_SAMPLES``
samples each at temperature 1, before step 0 and after the last step; the gain and its standard error
(:func:`fp8rl.rl.metrics.expected_reward_gain`). Besides it each run reports the median and worst
``token_mult_prob_error`` over its steps and the mean step time.

Prints one ``ratio gain/<run>_vs_<first> VALUE`` per run after the first (the first is the baseline: bf16 by
default), and a table.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fp8rl.fp8 import SCALINGS
from fp8rl.loop import GRPOLoop, LoopConfig, run
from fp8rl.presets import prepare_preset
from fp8rl.rl.metrics import expected_reward_gain

TASK = {"max_operand": 9, "num_terms": 2, "ops": ("+", "-"), "word_problems": False}
EVAL_SAMPLES = 72
EVAL_SEED = 12345


def _spec(spec: str) -> dict:
    parts = spec.split(":")
    out = {"recipe": parts[0], "kv_cache_dtype": "auto", "batch_invariant": False}
    for p in parts[1:]:
        if p in ("auto", "fp8"):
            out["kv_cache_dtype"] = p
        elif p == "invariant":
            out["batch_invariant"] = True
        elif p == "replay":
            out["router_replay"] = True
        elif p in SCALINGS:
            out["fp8_recipe"] = p
        elif p == "lora":
            out.update(lora=True, lora_rank=16, lora_alpha=32.0, lr=1e-3)
        else:
            raise SystemExit(f"run spec {spec!r}: unknown part {p!r} (RECIPE[:auto|fp8][:invariant][:replay]"
                             f"[:{'|'.join(SCALINGS)}][:lora])")
    return out


def one(spec: str, steps: int, seed: int, model: str = "tiny-arith") -> dict:
    cfg = LoopConfig.from_flags(model=model, steps=steps, prompts_per_step=16, group_size=8, num_minibatches=4,
                                eval_size=64, seed=seed, arith=TASK, **{"lr": 1e-4, **_spec(spec)})
    loop = GRPOLoop(cfg)
    problems = loop.task_problems()
    before = loop.solve_rates(problems, n=EVAL_SAMPLES, temperature=1.0, seed=EVAL_SEED)
    t0 = time.perf_counter()
    res = run(cfg, progress=False, loop=loop)
    wall = time.perf_counter() - t0
    after = loop.solve_rates(problems, n=EVAL_SAMPLES, temperature=1.0, seed=EVAL_SEED)
    gain, se = expected_reward_gain(before, after, EVAL_SAMPLES)
    errs = [h["token_mult_prob_error"] for h in res["steps"]]
    out = {"run": spec, "before": statistics.fmean(before), "after": statistics.fmean(after), "gain": gain, "se": se,
           "err_median": statistics.median(errs), "err_max": max(errs), "step_s": wall / steps,
           "reward_first5": statistics.fmean(h["reward_mean"] for h in res["steps"][:5]),
           "reward_last5": statistics.fmean(h["reward_mean"] for h in res["steps"][-5:])}
    print(f"  {spec}: expected reward {out['before']:.4f} -> {out['after']:.4f}, gain {gain:+.4f} (SE {se:.4f}); "
          f"batch reward first 5 steps {out['reward_first5']:.3f}, last 5 {out['reward_last5']:.3f}; "
          f"token_mult_prob_error median {out['err_median']:.6f}, max {out['err_max']:.6f}; "
          f"{out['step_s']:.2f} s/step", flush=True)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--runs", nargs="+", default=["bf16", "fp8_e2e:fp8", "fp8_e2e:fp8:invariant"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny-arith", choices=("tiny-arith", "tiny-arith-moe"))
    args = ap.parse_args(argv)
    for spec in args.runs:
        _spec(spec)  # refuse a bad spec before the first run
    prepare_preset(args.model, progress=False)
    print(f"learning on {args.model} ({args.steps} steps per run, seed {args.seed}); the judge's statistic: expected "
          f"reward over the task's problems, {EVAL_SAMPLES} samples each", flush=True)
    results = [one(spec, args.steps, args.seed, args.model) for spec in args.runs]
    base = results[0]
    for r in results[1:]:
        print(f"ratio gain/{r['run']}_vs_{base['run']} {r['gain'] / base['gain']:.4f}" if base["gain"] else
              f"ratio gain/{r['run']}_vs_{base['run']} nan (baseline gain 0)")
    print("| run | expected reward before → after | gain (SE) | token_mult_prob_error median / max | s/step |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['before']:.4f} → {r['after']:.4f} | {r['gain']:+.4f} ({r['se']:.4f}) | "
              f"{r['err_median']:.6f} / {r['err_max']:.6f} | {r['step_s']:.2f} |")
    return results


if __name__ == "__main__":
    main()
