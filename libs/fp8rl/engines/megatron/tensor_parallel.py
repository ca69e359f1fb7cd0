"""Megatron tensor parallelism for the trainer: which slice of each full (TP = 1) Megatron tensor a rank holds.

:mod:`.convert` moves weights between Hugging Face and Megatron's TP = 1 layout; this module moves a TP = 1
tensor to rank ``r``'s slice of ``T`` ranks and back. Both are pure index moves, so a round trip is exact,
and what holds for weights holds for every tensor of their shape (AdamW's moments are sliced the same way).

Where the slice is (Megatron-Core's local layers):

* column-parallel weights (``linear_qkv``, ``linear_fc1``, ``output_layer``) and the vocab-parallel
  ``word_embeddings`` are split along dim 0, row-parallel ones (``linear_proj``, ``linear_fc2``) along dim 1;
  norms are whole on every rank. The split dimension of each tensor is read off its shape: the one
  dimension where the rank's parameter is ``1/T`` of the full tensor (:func:`partition_dims`).
* ``linear_qkv`` holds Q, K, V grouped by query group (:mod:`.convert`), so a contiguous split gives each
  rank whole query groups: Q heads with their K and V heads.
* ``linear_fc1`` is ``[gate; up]`` at TP = 1, but each rank holds ``[gate_r; up_r]`` (its GLU halves its own
  output), so it is split per half (``glu``).

FP8 across the split: a rank's FP8 linear quantizes its slice of each Hugging Face tensor in 128×128 blocks
and its activations in 1×128 groups along its slice of K. They are the rollout's blocks (the rollout
quantizes whole tensors) when every slice is a multiple of 128 rows (column-parallel) or columns
(row-parallel): :func:`check_tensor_parallel` refuses other shapes for FP8 recipes, naming the key. The
row-parallel outputs (and column-parallel input gradients) are then sums of the same blocks' products over
ranks: they differ from one rank's only by FP32 summation order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from fp8rl.fp8 import Fp8Recipe
from fp8rl.model import ModelConfig

__all__ = ["check_tensor_parallel", "partition_dims", "is_glu", "to_local", "to_full", "gather", "BLOCK"]

BLOCK = 128  # FP8 weight blocks are BLOCK x BLOCK, activation groups 1 x BLOCK (the recipe's)
_KEY = "policy.training.megatron_cfg.tensor_model_parallel_size"


def check_tensor_parallel(config: ModelConfig, recipe: Fp8Recipe, tp: int) -> None:
    """Refuse a tensor-parallel size the model's shape cannot be split by, or (FP8 linears) one whose slices
    would not be whole 128-row / 128-column blocks of the rollout's tensors.

    Raises:
        ValueError: naming the key, the dimension and why.
    """
    if tp == 1:
        return
    dims = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    for name, n in dims.items():
        if n % tp:
            raise ValueError(f"{_KEY}={tp} does not divide the model's {name} ({n}): Megatron splits it evenly "
                             f"across tensor-parallel ranks")
    if not recipe.fp8_linears:
        return
    d = config.head_dim
    slices = {"q_proj rows / o_proj columns": config.num_attention_heads // tp * d,
              "k_proj / v_proj rows": config.num_key_value_heads // tp * d,
              "gate_proj / up_proj rows, down_proj columns": config.intermediate_size // tp}
    for what, n in slices.items():
        if n % BLOCK:
            raise ValueError(f"{_KEY}={tp} gives each rank {n} {what}, not a multiple of {BLOCK}: its FP8 "
                             f"{BLOCK}x{BLOCK} weight blocks would not be the rollout's (which quantizes whole "
                             f"tensors), so trainer and rollout would round the same weights differently; choose a "
                             f"size that keeps the slices whole blocks, or the bf16 recipe")


def is_glu(name: str) -> bool:
    """Whether ``name`` is a fused ``[gate; up]`` tensor (split per half)."""
    return ".mlp.linear_fc1." in f".{name}"


def partition_dims(local: Mapping[str, torch.Size], full: Mapping[str, torch.Size], tp: int) -> dict[str, int | None]:
    """Per tensor name, the dimension it is split along over ``tp`` ranks (None: whole on every rank).

    Raises:
        ValueError: names differ, or a local shape is not the full one with one dimension divided by ``tp``.
    """
    if set(local) != set(full):
        raise ValueError(f"tensor-parallel layout: names differ ({sorted(set(local) ^ set(full))[:4]})")
    out: dict[str, int | None] = {}
    for name, shape in local.items():
        f = full[name]
        diff = [i for i in range(len(f)) if shape[i] != f[i]] if len(shape) == len(f) else None
        if diff is None or len(diff) > 1 or (diff and shape[diff[0]] * tp != f[diff[0]]):
            raise ValueError(f"tensor-parallel layout: {name} is {tuple(shape)} on this rank, {tuple(f)} whole; "
                             f"expected one dimension split {tp} ways")
        out[name] = diff[0] if diff else None
    return out


def to_local(name: str, full: torch.Tensor, dim: int | None, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s slice (a copy) of the TP = 1 tensor ``full``."""
    if dim is None:
        return full.clone()
    if is_glu(name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank].clone()


def to_full(name: str, parts: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """The TP = 1 tensor from every rank's slice, in rank order (inverse of :func:`to_local`)."""
    if dim is None:
        return parts[0]
    if is_glu(name):
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def gather(name: str, local: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    """The TP = 1 tensor from this rank's slice (an all-gather over the tensor-parallel ``group``: every rank
    of it must call this, for the same names in the same order)."""
    if dim is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return to_full(name, parts, dim)
