"""Data parallelism for the embedded trainer: FSDP2 over the ``torch.distributed`` default group.

:class:`DataParallel` is what :class:`~fp8rl.engines.TorchTrainer` needs to run one GRPO step over N ranks
(gloo: the embedded trainer computes on the CPU), each rank holding the whole batch (the leader broadcasts it,
see ``services/trainer/ranks.py``) and computing a slice of it:

* **Sharding.** Every decoder layer and the root are ``fully_shard``-ed (FSDP2): parameters, gradients and
  AdamW's ``exp_avg`` / ``exp_avg_sq`` live as 1/N DTensor shards; a layer's full weight exists only
  while its forward or backward runs.
* **Which rows.** A mini-batch is cut into micro-batches of ``micro_batch_size`` rows exactly as on one
  rank; micro-batch ``j`` runs on rank ``j % N`` in round ``j // N``. A rank with no micro-batch left in a
  round runs a one-row, zero-token one (its loss is exactly 0, so its gradient adds exactly 0), because
  every FSDP forward and backward is a collective all ranks must join.
* **The same numbers as one rank.** Because the micro-batches are the very ones one rank would run, FP8's
  1×128 quantization blocks (which run along tokens in the weight gradient) see the same tokens: logprobs
  are bitwise those of one rank, and the gradient differs only by FP32 summation order (the micro-batch
  gradients are added in another order, and across ranks by a reduce-scatter). Losses are normalised by
  the *global* token count of the mini-batch, which every rank reads off the whole batch, so the
  reduce-scatter must *sum* (``set_gradient_divide_factor(1)`` with forced SUM: gloo has no PREMUL_SUM).
* **Agreement.** Whether to stop (a cancelled call) is decided by rank 0 and all-reduced before every
  micro-batch, so all ranks raise :class:`~fp8rl.engines.Cancelled` together; gradient-norm clipping uses
  the global norm (a DTensor reduction); metrics are summed across ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DataParallel", "full_tensor", "init_from_env", "group_for", "WORLD_ENV", "DEFAULT_TIMEOUT_S"]

WORLD_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for each worker
DEFAULT_TIMEOUT_S = 600.0  # most seconds one collective waits for a peer (a dead one fails sooner: its socket closes)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor gathered from its shards (a collective every rank must join), else ``t``."""
    if not dist.is_initialized():  # no group, no DTensor (and no 1 s import of torch.distributed.tensor)
        return t
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DataParallel | None:
    """The default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), as a :class:`DataParallel` — or None for a single process (no ``WORLD_SIZE``, or 1).

    ``backend`` defaults to ``$FP8RL_DIST_BACKEND``, else gloo: the embedded trainer computes on the CPU, and
    NCCL carries only CUDA tensors.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if not dist.is_initialized():
        backend = backend or os.environ.get("FP8RL_DIST_BACKEND", "gloo")
        rank, timeout = int(os.environ["RANK"]), timedelta(seconds=timeout_s)
        # torchrun's agent hosts the store and keeps it across restarts of the group: the keys of an attempt
        # whose rank died (its address among them) would be read again, and a restarted group hang forming.
        # Each attempt gets its own key prefix; outside torchrun rank 0 hosts the store itself.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and not agent, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"fp8rl/attempt{attempt}", store), rank=rank,
                                world_size=world, timeout=timeout)
    return DataParallel.current()


def group_for(dp_size: int, model_parallel: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S) -> DataParallel | None:
    """The group of a trainer over ``policy.training.dp_size`` data-parallel ranks, each ``model_parallel`` ranks
    wide (Megatron's tensor x pipeline parallel sizes; 1 otherwise): checked against the world torchrun started
    (``WORLD_SIZE``), then joined; None for one rank.

    Raises:
        ValueError: the two disagree (the message names the keys and how to launch the ranks).
    """
    world, want = int(os.environ.get("WORLD_SIZE", "1")), dp_size * model_parallel
    if world != want:
        keys = "policy.training.dp_size" + (
            f" ({dp_size}) x megatron_cfg tensor_model_parallel_size x pipeline_model_parallel_size ({model_parallel})"
            if model_parallel > 1 else "")
        how = (f"launch the trainer with `torchrun --nproc-per-node {want} -m services.trainer ...` (the launcher, "
               f"compose and the Helm chart do it from these keys)" if world == 1 else
               (f"set policy.training.dp_size: {world}" if model_parallel == 1 else
                f"set the keys so that they multiply to {world}") + f", or start {want} ranks")
        raise ValueError(f"{keys} is {want}, but this trainer runs as {world} rank(s) (WORLD_SIZE from torchrun): "
                         f"{how}")
    return init_from_env(timeout_s=timeout_s)


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel group a trainer runs in: the default process group, or (a trainer that is also model
    parallel, e.g. Megatron tensor parallel) its data-parallel subgroup.

    Attributes:
        rank: this process's data-parallel rank (global rank 0 serves; see the module docstring).
        world: number of data-parallel ranks.
        group: the data-parallel process group (None: the default group, every rank).

    Row collectives (:meth:`sum`, :meth:`gather_rows`) run within ``group``; :meth:`any` and :meth:`barrier`
    always span every rank, since every rank must stop together.
    """

    rank: int
    world: int
    group: object | None = None

    @classmethod
    def current(cls) -> DataParallel:
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed's default process group (init_from_env)")
        return cls(dist.get_rank(), dist.get_world_size())

    @classmethod
    def over(cls, group) -> DataParallel:
        """The data-parallel subgroup ``group`` (a process group this rank belongs to)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def leader(self) -> bool:
        """Whether this process is global rank 0 (the one that serves and writes)."""
        return (dist.get_rank() if self.group is not None else self.rank) == 0

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with each decoder layer and the root fully sharded (FSDP2), gradients summed across ranks."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from fp8rl.fp8 import Fp8Linear

        for m in model.modules():  # FSDP swaps unsharded storage in without a version bump: no weight cache
            if isinstance(m, Fp8Linear) and not m.frozen_fp8:  # (a frozen LoRA base's is its weight: a buffer,
                m.weight_cache = None                           # whole on every rank, never swapped)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # losses are already divided by the global token count
                m.set_force_sum_reduction_for_comms(True)
        return model

    def rounds(self, num_micro_batches: int) -> int:
        """Rounds of micro-batches every rank runs (the last ones on some ranks are zero-token fillers)."""
        return -(-num_micro_batches // self.world)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (an all-reduce: every rank must call it)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the data-parallel ranks of a float64 vector (in place; returned)."""
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return values

    def gather_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Every data-parallel rank's ``rows`` (same shape on all ranks), in rank order."""
        out = [torch.empty_like(rows) for _ in range(self.world)]
        dist.all_gather(out, rows.contiguous(), group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier()
