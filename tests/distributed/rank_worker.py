"""One rank of a distributed-trainer test, run by ``torchrun`` (or as a single plain process).

    torchrun --nproc-per-node N tests/distributed/rank_worker.py SCENARIO OUT_DIR JSON_ARGS

``JSON_ARGS`` picks the trainer (``backend``: ``torch`` (default) or ``megatron``), its recipe and batch.
Scenarios (rank 0 writes its results into OUT_DIR as ``torch.save`` files the test loads with
``weights_only=True``):

* ``step``: the same seeded model and batch at any world size; logprobs, one train step's metrics and
  the full (gathered) gradients, with the optimizer's update skipped so the gradients stay inspectable.
* ``save``: train ``steps`` steps, save a checkpoint to ``path``; writes the full weights and AdamW state.
* ``load``: load ``path``, write the full weights and AdamW state as loaded, then optionally save again
  to ``save_to`` after one more step (``then_step``).
* ``publish``: load ``path`` and build the refit shards of the weights (``build_shards``, FP8 linears);
  writes the manifest's checksums and sizes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from fp8rl.engines import LoraSettings, TorchTrainer, TrainBatch, TrainerConfig
from fp8rl.engines.parallel import DataParallel, full_tensor, init_from_env
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM, ModelConfig

CONFIG = dict(architecture="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def policy(**overrides) -> CausalLM:
    torch.manual_seed(1234)
    m = CausalLM(ModelConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        m.lm_head.weight.mul_(3.0)
    return m


def batch(rows: int, seed: int = 0) -> TrainBatch:
    """Right-padded rows of uneven prompt and response lengths, seeded."""
    g = torch.Generator().manual_seed(seed)
    t = 24
    ids = torch.zeros(rows, t, dtype=torch.long)
    attn, loss = torch.zeros(rows, t, dtype=torch.long), torch.zeros(rows, t, dtype=torch.long)
    for b in range(rows):
        p = int(torch.randint(3, 9, (1,), generator=g))
        r = int(torch.randint(2, t - p + 1, (1,), generator=g))
        ids[b, :p + r] = torch.randint(3, 128, (p + r,), generator=g)
        attn[b, :p + r] = 1
        loss[b, p:p + r] = 1
    adv = torch.randn(rows, generator=g)
    gen = -torch.rand(rows, t, generator=g) * 3 * loss
    return TrainBatch(ids, attn, loss, adv, gen)


def with_routes(b: TrainBatch, model: dict, seed: int = 5) -> TrainBatch:
    """``b`` with rollout-like routes for the MoE ``model`` (overrides of CONFIG): ``num_experts_per_tok`` distinct
    random experts per token and MoE layer, -1 on padding."""
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(**{**CONFIG, **model})
    rows, t = b.input_ids.shape
    r = torch.rand(rows, t, len(cfg.moe_layers), cfg.num_experts, generator=g).argsort(-1)
    pad = ~b.attention_mask.bool()[:, :, None, None]
    b.routes = r[..., :cfg.num_experts_per_tok].to(torch.int16).masked_fill(pad, -1)
    return b


def trainer(args: dict, parallel: DataParallel | None) -> TorchTrainer:
    """The torch backend (FSDP2), or with ``backend: megatron`` the Megatron-Core one (its DDP)."""
    cfg = TrainerConfig(lr=args.get("lr", 1e-3), micro_batch_size=args["micro_batch_size"],
                        grad_clip=args.get("grad_clip", 1.0), num_minibatches=args.get("num_minibatches", 1),
                        router_replay=args.get("replay", False),
                        lora=LoraSettings(rank=args["lora"], alpha=2.0 * args["lora"]) if args.get("lora") else None)
    recipe = recipe_for_role(args["recipe"], "trainer", scaling=args.get("scaling", "blockwise"))
    model = policy(**args.get("model", {}))
    if args.get("backend", "torch") == "megatron":
        from fp8rl.engines.megatron import MegatronTrainer
        from fp8rl.engines.megatron.model import weights_after_experts

        weights_after_experts().per_source = args.get("experts_per_source", True)

        return MegatronTrainer(model, recipe, cfg, parallel=parallel, tensor_model_parallel_size=args.get("tp", 1),
                               pipeline_model_parallel_size=args.get("pp", 1),
                               expert_model_parallel_size=args.get("ep", 1),
                               moe_token_dispatcher_type=args.get("dispatcher", "allgather"))
    return TorchTrainer(model, recipe, cfg, parallel=parallel)


def full_grads(tr: TorchTrainer) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (gathered from FSDP2 shards or Megatron tensor-parallel slices and pipeline
    stages)."""
    if getattr(tr, "_split", False):
        return tr._full({n.removeprefix("gpt."): p.grad for n, p in tr.model.named_parameters()})
    return {n.removeprefix("gpt."): full_tensor(p.grad).clone() for n, p in tr.model.named_parameters()
            if p.grad is not None}  # a LoRA trainer's frozen base has none


def full_state(tr: TorchTrainer) -> dict[str, torch.Tensor]:
    """Weights and AdamW state, whole, under parameter names (gathered on every rank)."""
    out = {f"w/{k}": v.clone() for k, v in tr.state_dict().items()}
    if getattr(tr, "_split", False):  # Megatron TP / PP: the checkpoint's whole (TP = PP = 1) optimizer state
        names = tr._whole_order
        for i, st in tr._checkpoint_state()["optimizer"]["state"].items():
            out.update({f"opt/{names[i]}/{k}": v.clone() if torch.is_tensor(v) else torch.tensor(v)
                        for k, v in st.items()})
        return out
    names = {id(p): n.removeprefix("gpt.") for n, p in tr.model.named_parameters()}
    for p, st in tr.optimizer.state.items():
        for k, v in st.items():
            out[f"opt/{names[id(p)]}/{k}"] = full_tensor(v).clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def main(scenario: str, out: Path, args: dict) -> None:
    torch.set_num_threads(1)
    par = init_from_env()
    lead = par is None or par.leader
    tr = trainer(args, par)
    res: dict = {}
    if scenario == "step":
        b = batch(args["rows"])
        if args.get("replay"):
            b = with_routes(b, args.get("model", {}))
        b.prev_logprobs = tr.compute_logprobs(b)
        res["logprobs"] = b.prev_logprobs.clone()
        tr.optimizer.step = lambda: None  # keep the gradients for inspection
        metrics = tr.train_step(b)
        res["metrics"] = {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}
        res["grads"] = full_grads(tr)
        res["megatron_ddp"] = torch.tensor(int(getattr(tr, "_ddp", None) is not None))
        experts = {n.split(".local_experts.")[1].split(".")[0] for n, _ in tr.model.named_parameters()
                   if ".local_experts." in n}
        res["local_experts"] = torch.tensor(len(experts))  # experts this rank holds (per layer)
        dispatchers = {type(m.token_dispatcher).__name__ for m in tr.model.modules() if hasattr(m, "token_dispatcher")}
        res["dispatchers"] = sorted(dispatchers)  # the token dispatcher classes that ran
    elif scenario == "save":
        for s in range(args.get("steps", 1)):
            tr.train_step(batch(args["rows"], seed=10 + s))
        tr.save_checkpoint(args["path"])
        res["state"] = full_state(tr)
        res["version"] = torch.tensor(tr.version)
    elif scenario == "load":
        tr.load_checkpoint(args["path"])
        res["state"] = full_state(tr)
        res["version"] = torch.tensor(tr.version)
        if args.get("then_step"):
            tr.train_step(batch(args["rows"], seed=99))
            res["after"] = full_state(tr)
        if args.get("save_to"):
            tr.save_checkpoint(args["save_to"])
    elif scenario == "publish":
        from fp8rl.fp8 import fp8_linear_names
        from fp8rl.refit import build_shards

        tr.load_checkpoint(args["path"])
        sd = tr.state_dict()  # every rank gathers; rank 0 builds
        if lead:
            rollout = recipe_for_role(args["recipe"], "rollout")
            manifest, shards = build_shards(sd, tr.version, job="dist", recipe=args["recipe"], endpoint="",
                                            shard_bytes=1 << 20, fp8_prefixes=fp8_linear_names(policy(), rollout))
            res["manifest"] = manifest.to_json_bytes().decode()
            res["shards"] = [torch.frombuffer(bytearray(memoryview(s).cast("B")), dtype=torch.uint8) for s in shards]
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    if lead:
        torch.save(res, out / "rank0.pt")
    if par is not None:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown can outlive the test's patience
