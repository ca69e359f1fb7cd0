"""MLA decode tokens/s, absorbed vs expanded, at several context lengths, in one run (issue 54).

    python bench/mla_decode.py [--contexts 256 1024 4096] [--batch 4] [--steps 8] [--repeats 3] [--recipe bf16]
                               [--invariant]

A DeepSeek-V3-shaped attention stack (transformers' ``DeepseekV3Config``, random init, nothing downloaded:
``--heads`` 16, ``kv_lora_rank`` 512, ``qk_nope`` 128, ``qk_rope`` 64, ``v`` 128 — V3's per-head shapes with
fewer heads — ``--layers`` dense layers, 1024 wide) decodes ``--steps`` tokens for ``--batch`` rows after a
prefill of ``context`` tokens through the latent KV cache, in the rollout's form of ``--recipe``. The two forms
run on the same weights and cache contents, interleaved, ``--repeats`` times; each prints the median decode
tokens/s and its spread (max − min), and ``ratio tokens_per_s absorbed/expanded`` per context (it should grow
with the context: the expanded form multiplies every cached latent by ``kv_b_proj`` at every step). The
prefill (chunked, 256 tokens a call) is not timed. Plain kernels, or with ``--invariant`` the batch-invariant ones
the jobs run by default (row-tiled GEMMs, split-KV attention).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp8rl.fp8 import recipe_for_role
from fp8rl.fp8.convert import convert_model
from fp8rl.model import KVCache, load_hf_checkpoint
from fp8rl.model.invariant import BatchInvariance
from fp8rl.model.mla import set_absorbed

PREFILL_CHUNK = 256


def build(args):
    import tempfile
    from pathlib import Path

    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=args.layers,
        first_k_dense_replace=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=max(args.contexts) + args.steps + 8, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with tempfile.TemporaryDirectory() as d:
        transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(Path(d))
        model, _ = load_hf_checkpoint(Path(d))
    model.eval()
    if args.recipe != "bf16":
        convert_model(model, recipe_for_role(args.recipe, "rollout", batch_invariant=args.invariant),
                      mode="inference")
    if args.invariant:
        model.set_batch_invariance(BatchInvariance())
    return model


@torch.no_grad()
def decode_rate(model, ids: torch.Tensor, steps: int) -> float:
    """Tokens/s of ``steps`` greedy decode steps after ``ids``'s prefill (not timed)."""
    B, T = ids.shape
    cache = KVCache.for_model(model, batch_size=B, max_len=T + steps)
    for i in range(0, T, PREFILL_CHUNK):
        logits = model(ids[:, i:i + PREFILL_CHUNK], kv_cache=cache, logits_to_keep=1)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = model(nxt, kv_cache=cache, logits_to_keep=1)[:, -1].argmax(-1, keepdim=True)
    return B * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--recipe", default="bf16", help="the rollout's recipe (bf16, fp8_e2e, ...)")
    ap.add_argument("--invariant", action="store_true", help="batch-invariant kernels (the jobs' default)")
    args = ap.parse_args()
    model = build(args)
    print(f"# MLA decode: {args.layers} layers, {args.heads} heads, r 512, batch {args.batch}, {args.steps} steps, "
          f"recipe {args.recipe}, invariant {args.invariant}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    g = torch.Generator().manual_seed(1)
    for ctx in args.contexts:
        ids = torch.randint(3, 2048, (args.batch, ctx), generator=g)
        rates = {"absorbed": [], "expanded": []}
        for _ in range(args.repeats):
            for form in rates:
                set_absorbed(model, form == "absorbed")
                rates[form].append(decode_rate(model, ids, args.steps))
        med = {f: statistics.median(r) for f, r in rates.items()}
        for f, r in rates.items():
            print(f"context {ctx:5d}  {f:8s}  {med[f]:8.1f} tokens/s  (spread {max(r) - min(r):.1f})")
        print(f"ratio tokens_per_s absorbed/expanded context={ctx} {med['absorbed'] / med['expanded']:.2f}")


if __name__ == "__main__":
    main()
