"""Trainer scaling on this machine: one rank with 2 threads against 2 ranks with 1 thread each.

    python bench/trainer_scaling.py [--hidden 512 --layers 4 --vocab 8000 --rows 32 --seq 64 --mb 8
                                     --recipe bf16 --steps 4 --backend torch|megatron --tp 1|2 --pp 1|2
                                     --model dense|moe|deepseek --ep 1|2 --dispatcher allgather|alltoall]

``--backend megatron`` runs :class:`~fp8rl.engines.megatron.MegatronTrainer` instead (megatron-core installed):
its 2 ranks are data parallel through Megatron-Core DDP, or with ``--tp 2`` one tensor-parallel pair (weights and
AdamW state sliced in two, activations all-reduced per layer), or with ``--pp 2`` two pipeline stages (half the
layers each, Megatron's 1F1B schedule sending activations between them). ``--model moe`` trains a Qwen3-MoE of the
same shape (``--experts`` experts of the dense FFN's width, top-2, every layer); with ``--ep 2`` the 2-rank run
is data parallel with expert parallelism 2 (each rank holds half the experts, tokens moved by ``--dispatcher``).
``--model deepseek`` trains a DeepSeek-V3-shaped MoE instead (multi-latent attention, sigmoid group-limited routing,
a shared expert, layer 0 dense).

Both runs train the same seeded Llama-shaped model on the same global batch (``--rows`` rows of ``--seq``
tokens, micro-batches of ``--mb`` rows) with :class:`fp8rl.engines.TorchTrainer`; the 2-rank run is FSDP2 on
gloo under the real ``torchrun`` (``fp8rl.engines.parallel``), exactly as the trainer service runs it. Per
run, after one warm-up step: the median step time (``train_step``, prev logprobs included), the part of it
spent waiting in collectives (``torch.profiler`` CPU time of the c10d / gloo ops on the step's thread — the
communication the step could not hide), the AdamW state and parameter bytes each rank holds, and each rank's
peak RSS (``ru_maxrss``).

Prints ``ratio NAME VALUE`` lines:

* ``ratio step_time/2x1_vs_1x2`` — 2 ranks × 1 thread over 1 rank × 2 threads (same cores, same batch);
* ``ratio comm_share/2x1`` — the collective share of the 2-rank step;
* ``ratio optimizer_state_per_rank/2_vs_1`` — FSDP2 and Megatron TP=2 target ≈ 1/N = 0.5 (Megatron DDP: 1.0,
  its state is replicated);
* ``ratio peak_rss_per_rank/2_vs_1`` — what a rank's process costs in all (the model build, torch and the
  batch are per process, so this stays above 0.5).

With ``--model moe`` (or ``deepseek``) also ``ratio expert_params_per_rank/2_vs_1`` and
``ratio expert_optimizer_state_per_rank/2_vs_1``
(EP 2 targets 0.5: each rank holds half the experts and their AdamW moments; DDP 1.0) and
``ratio dispatch_share/2x1`` (the all-to-all share of the 2-rank step: ``alltoall`` dispatcher only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import needs  # bench/needs.py: an optional package missing is one line, before any run
import torch

REPO = Path(__file__).resolve().parents[1]
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "barrier", "gloo", "c10d")
DISPATCH = ("all_to_all",)  # the alltoall dispatcher's collective


def _model(args):
    from fp8rl.model import CausalLM, ModelConfig

    torch.manual_seed(0)
    heads = max(args.hidden // 64, 1)
    step = 128 * args.tp  # FFN rows in whole 128-row FP8 blocks on each tensor-parallel rank
    ffn = int(args.hidden * 2.75) // step * step
    experts = dict(num_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=ffn, norm_topk_prob=True)
    kind = {"dense": dict(architecture="llama"), "moe": dict(architecture="qwen3_moe", **experts),
            # DeepSeek-V3 / Moonlight-shaped: MLA (latent hidden/2, rotary and nope 64 per head), layer 0 dense,
            # sigmoid routing over 2 groups, one shared expert
            "deepseek": dict(architecture="deepseek_v3", **experts, n_group=2, topk_group=1, first_k_dense_replace=1,
                             n_shared_experts=1, kv_lora_rank=args.hidden // 2, qk_nope_head_dim=64,
                             qk_rope_head_dim=64, v_head_dim=64, rope_interleave=True)}[args.model]
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=ffn, num_hidden_layers=args.layers, num_attention_heads=heads,
                      num_key_value_heads=heads if args.model == "deepseek" else max(heads // 2, 1), head_dim=64,
                      max_position_embeddings=max(args.seq, 64), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      **kind)
    return CausalLM(cfg)


def _batch(args):
    from fp8rl.engines import TrainBatch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.rows, args.seq), generator=g)
    attn = torch.ones_like(ids)
    loss = torch.zeros_like(ids)
    loss[:, args.seq // 4:] = 1  # a quarter prompt, the rest response
    return TrainBatch(ids, attn, loss, torch.randn(args.rows, generator=g), -torch.rand(ids.shape, generator=g) * loss)


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def worker(args) -> None:
    """One rank (or the single process): train ``--steps`` steps, write this rank's numbers as JSON."""
    from fp8rl.engines import TorchTrainer, TrainerConfig
    from fp8rl.engines.parallel import init_from_env
    from fp8rl.fp8 import recipe_for_role

    torch.set_num_threads(args.threads)
    par = init_from_env()
    recipe, cfg = recipe_for_role(args.recipe, "trainer"), TrainerConfig(lr=1e-4, micro_batch_size=args.mb)
    if args.backend == "megatron":
        from fp8rl.engines.megatron import MegatronTrainer

        tp, pp, ep = (args.tp, args.pp, args.ep) if par is not None else (1, 1, 1)
        tr = MegatronTrainer(_model(args), recipe, cfg, parallel=par, tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                             moe_token_dispatcher_type=args.dispatcher)
    else:
        tr = TorchTrainer(_model(args), recipe, cfg, parallel=par)
    batch = _batch(args)
    times, comm, dispatch = [], [], []
    for step in range(args.steps + 1):  # the first is a warm-up
        b = _batch(args) if step else batch
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tr.train_step(b)
        dt = time.perf_counter() - t0
        if step:
            times.append(dt)
            waited = sum(e.cpu_time_total for e in prof.key_averages()
                         if any(k in e.key.lower() for k in COLLECTIVES) and not e.key.startswith("aten::"))
            comm.append(waited / 1e6 / dt)
            a2a = sum(e.cpu_time_total for e in prof.key_averages()
                      if any(k in e.key.lower() for k in DISPATCH) and not e.key.startswith("aten::"))
            dispatch.append(a2a / 1e6 / dt)
    state = [v for st in tr.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    experts = [p for n, p in tr.model.named_parameters() if ".experts." in n]
    expert_state = [v for p in experts for v in tr.optimizer.state.get(p, {}).values()
                    if torch.is_tensor(v) and v.dim() > 0]
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if par is not None else (0, 1)
    out = {"rank": rank, "world": world, "step_s": statistics.median(times),
           "comm_share": statistics.median(comm), "dispatch_share": statistics.median(dispatch),
           "optimizer_state_bytes": _local_bytes(state), "expert_param_bytes": _local_bytes(experts),
           "expert_optimizer_state_bytes": _local_bytes(expert_state),
           "param_bytes": _local_bytes(list(tr.model.parameters())),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    if par is not None:
        torch.distributed.destroy_process_group()


def run(args, nproc: int, threads: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               __file__, "--worker", "--out", out, "--threads", str(threads),
               *[f"--{k}={v}" for k, v in vars(args).items() if k not in ("worker", "out", "threads")]]
        env = {**os.environ, "PYTHONPATH": str(REPO / "libs"), "OMP_NUM_THREADS": str(threads)}
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{nproc} rank(s) failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--recipe", default="bf16", choices=("bf16", "fp8_e2e"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--backend", default="torch", choices=("torch", "megatron"))
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2),
                    help="megatron: the 2-rank run is tensor parallel (2) instead of data parallel (1)")
    ap.add_argument("--pp", type=int, default=1, choices=(1, 2),
                    help="megatron: the 2-rank run is two pipeline stages (2) instead of data parallel (1)")
    ap.add_argument("--model", default="dense", choices=("dense", "moe", "deepseek"),
                    help="moe: a Qwen3-MoE of the same shape, --experts experts of the FFN's width, top-2; deepseek: a "
                         "DeepSeek-V3-shaped one (MLA, sigmoid group routing, a shared expert, layer 0 dense)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--ep", type=int, default=1, choices=(1, 2),
                    help="megatron, --model moe|deepseek: the 2-rank run holds half the experts per rank (EP 2)")
    ap.add_argument("--dispatcher", default="alltoall", choices=("allgather", "alltoall"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.backend == "megatron" and not args.worker:  # one line naming how to get it, before any run
        needs.package("megatron.core", "`make test-megatron` installs it (pip install -e '.[megatron]'), or use "
                      "--backend torch")
    if (args.tp, args.pp) != (1, 1) and args.backend != "megatron":
        ap.error("--tp / --pp need --backend megatron (the torch backend scales with FSDP2 data parallel)")
    if args.tp * args.pp > 2:
        ap.error("the 2-rank run is one of data, tensor or pipeline parallel: --tp 2 or --pp 2, not both")
    if args.ep > 1 and (args.backend != "megatron" or args.model == "dense" or args.tp * args.pp > 1):
        ap.error("--ep 2 needs --backend megatron --model moe|deepseek (data parallel with the experts split, no "
                 "--tp/--pp)")
    if args.worker:
        worker(args)
        return {}
    params = sum(p.numel() for p in _model(args).parameters())
    how = {"torch": "FSDP2", "megatron": {(1, 1): "Megatron DDP", (2, 1): "Megatron TP=2",
                                          (1, 2): "Megatron PP=2"}[args.tp, args.pp]}[args.backend]
    if args.ep > 1:
        how += f" + EP=2 ({args.dispatcher})"
    experts = sum(p.numel() for n, p in _model(args).named_parameters() if ".experts." in n)
    print(f"trainer scaling ({args.backend} backend, 2 ranks: {how}), torch {torch.__version__}, {os.cpu_count()} "
          f"cores: {params / 1e6:.1f}M params ({experts / 1e6:.1f}M in experts), {args.model} model, recipe "
          f"{args.recipe}, global batch {args.rows} x {args.seq} tokens, micro-batch {args.mb}, median of {args.steps} "
          f"steps after a warm-up")
    one, two = run(args, 1, 2), run(args, 2, 1)
    res = {"1x2": one, "2x1": two}
    for name, ranks in res.items():
        for r in ranks:
            mib = {k: r[k] / 2**20 for k in ("optimizer_state_bytes", "param_bytes", "peak_rss_bytes")}
            print(f"  {name} rank {r['rank']}: step {r['step_s']:.3f} s, collectives {100 * r['comm_share']:.1f}%, "
                  f"AdamW state {mib['optimizer_state_bytes']:.1f} MiB, params {mib['param_bytes']:.1f} MiB, "
                  f"peak RSS {mib['peak_rss_bytes']:.0f} MiB")
    step2 = max(r["step_s"] for r in two)
    print(f"ratio step_time/2x1_vs_1x2 {step2 / one[0]['step_s']:.4f}")
    print(f"ratio comm_share/2x1 {statistics.fmean(r['comm_share'] for r in two):.4f}")
    print(f"ratio optimizer_state_per_rank/2_vs_1 "
          f"{max(r['optimizer_state_bytes'] for r in two) / one[0]['optimizer_state_bytes']:.4f}")
    print(f"ratio peak_rss_per_rank/2_vs_1 {max(r['peak_rss_bytes'] for r in two) / one[0]['peak_rss_bytes']:.4f}")
    if args.model != "dense":
        for key in ("expert_param_bytes", "expert_optimizer_state_bytes"):
            name = key.removesuffix("_bytes").replace("expert_param", "expert_params")
            print(f"ratio {name}_per_rank/2_vs_1 {max(r[key] for r in two) / one[0][key]:.4f}")
        print(f"ratio dispatch_share/2x1 {statistics.fmean(r['dispatch_share'] for r in two):.4f}")
    return res


if __name__ == "__main__":
    main()
