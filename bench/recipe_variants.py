"""The FP8 recipe variants side by side (issue 32): blockwise, mxfp8, tensorwise, each on both engines.

    python bench/recipe_variants.py [--models tiny-arith smollm2-135m-instruct] [--variants blockwise mxfp8 tensorwise]
                                    [--prompts 8] [--n 2] [--max-tokens 32] [--rows 8] [--repeats 3]

Per model and variant (fp8_e2e, FP8 KV cache), measured in one run against baselines of the same run:

* ``token_mult_prob_error`` with and without batch-invariant numerics: the rollout engine samples the prompts, the
  trainer recomputes their logprobs (the observatory's ``total``: what a training step measures), with one standard
  error over sequences; batch-invariant, also the max |Δlogprob| (0 = bitwise: the exactness verdict);
* quantization throughput: every FP8 linear weight of the model quantized in the variant's forward form, as a ratio
  to copying the same weights (``ratio quantize_seconds/copy_seconds``, best of ``--repeats``);
* refit bytes per version: the manifest's total bytes when the trainer publishes the model in the variant
  (:func:`fp8rl.refit.manifest.build_shards`, the bytes every transport moves), and its scale bytes
  (``ratio refit_bytes/<variant>_vs_blockwise``);
* trainer step time: one GRPO train step of the torch trainer on a batch of ``--rows`` sampled rows, the best of
  ``--repeats`` after a warm-up, as a ratio to the bf16 recipe's step on the same batch
  (``ratio train_step_seconds/<variant>_vs_bf16``).

The 32-step learning statistic per variant is ``bench/learning.py --runs bf16 fp8_e2e:fp8 fp8_e2e:fp8:mxfp8
fp8_e2e:fp8:tensorwise``.
"""

from __future__ import annotations

import argparse
import copy
import time

import needs  # bench/needs.py: an optional model missing is one line, before any measurement
import torch

from fp8rl.engines.base import TrainBatch
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import DEFAULT_SCALING, SCALINGS, fp8_linear_names, linear_format, recipe_for_role
from fp8rl.model.tokenizer import stop_token_ids
from fp8rl.observatory.__main__ import prompts_for
from fp8rl.observatory.measure import ObservatoryConfig, Probe
from fp8rl.presets import load_policy
from fp8rl.refit.manifest import build_shards


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def mismatch(model, tok, prompts, variant: str, invariant: bool, args) -> tuple[float, float, int, float]:
    """(token_mult_prob_error, its standard error, tokens, max |Δlogprob|) of the observatory's ``total``."""
    cfg = ObservatoryConfig(recipe="fp8_e2e", kv_cache_dtype="fp8", fp8_recipe=variant, batch_invariant=invariant,
                            n=args.n, max_tokens=args.max_tokens, seed=args.seed)
    probe = Probe(model, prompts, cfg, pad_token_id=tok.pad_id, eos_token_ids=stop_token_ids(tok))
    _, batch, total = probe.total()
    return total.token_mult_prob_error, total.standard_error, int(batch.loss_mask.sum()), total.max_abs_dlogp


def quantize_ratio(weights: list[torch.Tensor], variant: str, repeats: int) -> float:
    fmt = linear_format(variant)
    quant = _best(lambda: [fmt.quantize_weight(w) for w in weights], repeats)
    copy_s = _best(lambda: [w.clone() for w in weights], repeats)
    return quant / copy_s


def refit_bytes(state: dict, prefixes: list[str], variant: str | None) -> tuple[int, int]:
    manifest, _ = build_shards(state, 1, job="bench", recipe="fp8_e2e" if variant else "bf16", endpoint="",
                               fp8_prefixes=prefixes if variant else (), scaling=variant or "blockwise")
    return manifest.total_bytes, sum(e.nbytes for e in manifest.tensors if e.name.endswith(".weight_scale"))


def step_seconds(model, recipe, batch, repeats: int, rows: int) -> float:
    trainer = TorchTrainer(copy.deepcopy(model), recipe, TrainerConfig(micro_batch_size=rows, lr=1e-6))
    trainer.train_step(copy.copy(batch))  # warm-up (and the first quantization)
    return _best(lambda: trainer.train_step(copy.copy(batch)), repeats)


def bench_model(name: str, args) -> list[dict]:
    torch.manual_seed(args.seed)
    model, tok, _ = load_policy(name)
    model.eval()
    prompts = prompts_for(tok, args.prompts, args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"== {name}: {params / 1e6:.1f}M parameters, {len(prompts)} prompts x {args.n}, <= {args.max_tokens} "
          f"tokens, torch threads {torch.get_num_threads()}", flush=True)
    prefixes = fp8_linear_names(model, recipe_for_role("fp8_e2e", "trainer"))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    weights = [state[f"{p}.weight"] for p in prefixes]
    # one sampled batch for every trainer timing (blockwise rollout; the step's numbers do not depend on it)
    probe = Probe(model, prompts, ObservatoryConfig(recipe="fp8_e2e", kv_cache_dtype="auto", n=args.n,
                                                    max_tokens=args.max_tokens, seed=args.seed),
                  pad_token_id=tok.pad_id, eos_token_ids=stop_token_ids(tok))
    _, batch = probe.rollout()
    g = torch.Generator().manual_seed(args.seed)
    rows = min(args.rows, batch.input_ids.shape[0])
    batch = TrainBatch(input_ids=batch.input_ids[:rows], attention_mask=batch.attention_mask[:rows],
                       loss_mask=batch.loss_mask[:rows], gen_logprobs=batch.gen_logprobs[:rows],
                       advantages=torch.randn(rows, generator=g))
    bf16_step = step_seconds(model, recipe_for_role("bf16", "trainer"), batch, args.repeats, rows)
    bf16_bytes, _ = refit_bytes(state, prefixes, None)
    print(f"{name} bf16: train step {bf16_step:.3f} s; refit {bf16_bytes / 1e6:.2f} MB", flush=True)
    out = []
    for variant in args.variants:
        row = {"model": name, "variant": variant}
        for inv in (False, True):
            err, se, tokens, max_d = mismatch(model, tok, prompts, variant, inv, args)
            row["err_bi" if inv else "err"], row["se_bi" if inv else "se"] = err, se
            row["max_d_bi" if inv else "max_d"] = max_d
            row["tokens"] = tokens
        row["quant_vs_copy"] = quantize_ratio(weights, variant, args.repeats)
        row["refit_bytes"], row["scale_bytes"] = refit_bytes(state, prefixes, variant)
        row["step_s"] = step_seconds(model, recipe_for_role("fp8_e2e", "trainer", scaling=variant), batch,
                                     args.repeats, rows)
        row["step_vs_bf16"] = row["step_s"] / bf16_step
        print(f"{name} {variant}: token_mult_prob_error {row['err']:.6f} ± {row['se']:.6f} (batch-invariant "
              f"{row['err_bi']:.6f} ± {row['se_bi']:.6f}, max |dlogprob| {row['max_d_bi']:.1e}; {tokens} tokens); "
              f"quantize/copy {row['quant_vs_copy']:.2f}; "
              f"refit {row['refit_bytes'] / 1e6:.3f} MB (scales {row['scale_bytes'] / 1e3:.1f} kB); train step "
              f"{row['step_s']:.3f} s", flush=True)
        out.append(row)
    base = next((r for r in out if r["variant"] == DEFAULT_SCALING), None)
    for r in out:
        print(f"ratio train_step_seconds/{name}_{r['variant']}_vs_bf16 {r['step_vs_bf16']:.4f}")
        print(f"ratio quantize_seconds/{name}_{r['variant']}_vs_copy {r['quant_vs_copy']:.4f}")
        if base is not None and r is not base:
            print(f"ratio refit_bytes/{name}_{r['variant']}_vs_{DEFAULT_SCALING} "
                  f"{r['refit_bytes'] / base['refit_bytes']:.4f}")
            print(f"ratio scale_bytes/{name}_{r['variant']}_vs_blockwise {r['scale_bytes'] / base['scale_bytes']:.4f}")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-arith", "smollm2-135m-instruct"])
    ap.add_argument("--variants", nargs="+", default=list(SCALINGS), choices=SCALINGS)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8, help="rows of the timed train step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for m in args.models:  # the real model needs its wheel: say so before measuring anything
        needs.model(m, instead="or leave it out: --models tiny-arith")
    rows = [r for m in args.models for r in bench_model(m, args)]
    print("| model | variant | token_mult_prob_error (± SE) | batch-invariant (max abs Δlogprob) | quantize / copy "
          "| refit MB (scales kB) | train step s (vs bf16) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['variant']} | {r['err']:.6f} ± {r['se']:.6f} | {r['err_bi']:.6f} "
              f"({r['max_d_bi']:.1e}) | "
              f"{r['quant_vs_copy']:.2f} | {r['refit_bytes'] / 1e6:.3f} ({r['scale_bytes'] / 1e3:.1f}) | "
              f"{r['step_s']:.3f} ({r['step_vs_bf16']:.3f}) |")
    return rows


if __name__ == "__main__":
    main()
