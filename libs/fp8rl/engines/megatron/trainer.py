"""The Megatron-Core trainer backend (``policy.training.backend: megatron``).

The policy is a Megatron-Core ``GPTModel`` (see :mod:`.model`) built from the HF config of the
loaded policy; its weights are converted HF → Megatron once at start and Megatron → HF on every
:meth:`MegatronTrainer.state_dict` (what a refit publishes), so the rollout side never sees
Megatron's layout. The GRPO step itself — token-level loss over the global batch, PPO-style
mini-batches with rollback, grad clipping, AdamW — is :class:`~fp8rl.engines.TorchTrainer`'s,
inherited unchanged: the two backends differ in the model only, which is what the equality tests
between them check.

Parallelism:

* **Data parallel** (``policy.training.dp_size`` = N under torchrun, a :class:`~fp8rl.engines.parallel.DataParallel`
  group): Megatron's parallel state is initialised over the N ranks (TP = PP = 1, so DP = N) and the
  GPTModel's gradients go through Megatron-Core's ``DistributedDataParallel``: its contiguous FP32 gradient
  buffers (``param.main_grad``), bucketed and all-reduced by ``finish_grad_sync`` once per update. The
  micro-batch schedule is the torch backend's (micro-batch ``j`` on rank ``j % N``, zero-token fillers), so
  logprobs are bitwise one rank's and gradients differ by FP32 summation order only. Losses are normalised
  by the *global* token count, so the buffers are *summed* (``calculate_per_token_loss``: no 1/N scaling).
  Weights, gradients and AdamW state are replicated across data-parallel ranks: checkpoints are one ``.pt``
  file rank 0 writes and any world size reads.
* **Tensor parallel** (``megatron_cfg.tensor_model_parallel_size`` = T; the trainer then runs as dp_size x T
  ranks): Megatron's column/row-parallel layers, the FP8 ones included, on T ranks per data-parallel replica.
  Each rank loads its slices of the HF weights (:mod:`.tensor_parallel`: the TP = 1 Megatron layout, sliced);
  :meth:`MegatronTrainer.state_dict` (what a refit publishes) all-gathers them whole; checkpoints hold whole
  tensors, weights and AdamW moments, in the TP = 1 layout, so any tensor-parallel size resumes any other.
  The gradient-norm clip sums each slice once and each whole tensor once over the tensor-parallel group.
  FP8 recipes need every rank's slice of a tensor to be whole 128-row / 128-column blocks (otherwise the
  trainer would round the weights in other blocks than the rollout): other sizes are refused, naming the key.
* **Not here**: Megatron's ``DistributedOptimizer`` (ZeRO-1 sharding of the AdamW state) and its other
  optimizers are CUDA-only in megatron-core 0.16 (``clip_grads`` builds ``device='cuda'`` tensors;
  ``DistributedOptimizer`` accepts only ``torch.cuda.*Tensor`` parameters), so the AdamW state is torch's,
  replicated across data-parallel ranks and sliced across tensor-parallel ones; use the torch backend (FSDP2)
  for state sharded over data-parallel ranks. Pipeline parallel needs Megatron's pipeline schedule, which
  the GRPO step (whole forward/backward passes) does not run: refused, naming the key.

On CPU a single process joins a one-rank gloo group, and :mod:`.shims` are applied.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from fp8rl.fp8 import Fp8Recipe
from fp8rl.model import CausalLM, ModelConfig

from ..parallel import DataParallel
from ..torch_trainer import TorchTrainer, TrainerConfig
from . import shims
from .convert import hf_to_megatron, megatron_to_hf
from .model import MegatronCausalLM, build_gpt_model, use_te
from .tensor_parallel import check_tensor_parallel, gather, partition_dims, to_local

__all__ = ["MegatronTrainer", "init_model_parallel"]



def init_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                        seed: int = 0) -> None:
    """Join (or create) the process group and Megatron's model-parallel state, once per process.

    Raises:
        ValueError: pipeline parallel (not run by this backend), a tensor-parallel size that does not divide
            the ranks started, or sizes that differ from the ones this process was already initialised with.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if pp != 1:
        raise ValueError(f"policy.training.megatron_cfg.pipeline_model_parallel_size={pp} is not supported by the "
                         f"megatron backend: its GRPO step runs whole forward/backward passes, not Megatron's "
                         f"pipeline schedule; use tensor_model_parallel_size and policy.training.dp_size")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp < 1 or world % tp:
        raise ValueError(f"policy.training.megatron_cfg.tensor_model_parallel_size={tp} needs a multiple of {tp} "
                         f"ranks (this trainer runs as {world}: start dp_size x {tp} under torchrun)")
    from megatron.core import parallel_state, tensor_parallel

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        shims.apply()
    if not dist.is_initialized():  # a launcher (torchrun) may have done it already
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
        if torch.cuda.is_available():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    held = (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())
    if held != (tp, pp):
        raise ValueError(f"this process already runs Megatron at TP x PP = {held[0]} x {held[1]}, not {tp} x {pp}")


class MegatronTrainer(TorchTrainer):
    """Trainer backend on a Megatron-Core GPTModel.

    Args:
        model: the policy as a :class:`CausalLM` (only its config and weights are used; it is not
            modified).
        recipe: the trainer's :class:`Fp8Recipe`; FP8 layers run TE blockwise on CUDA+TE, else
            Megatron's local spec with ``fp8rl.fp8`` linears.
        config: optimisation settings (shared with the torch backend; default ``TrainerConfig()``).
        ref_model: frozen reference policy for the KL term (built as a high-precision GPTModel).
        initial_version: version of ``model``'s weights.
        seed: seeds the trainer's RNG.
        tensor_model_parallel_size: Megatron's tensor-parallel size (ranks per data-parallel replica).
        pipeline_model_parallel_size: must be 1 (see the module doc).
        parallel: the group of every trainer rank (data x tensor parallel; every rank builds the same
            trainer), or None for one process.
    """

    CHECKPOINT_FORMAT = "fp8rl-megatron-trainer/1"

    def __init__(
        self,
        model: CausalLM,
        recipe: Fp8Recipe,
        config: TrainerConfig | None = None,
        *,
        ref_model: CausalLM | None = None,
        initial_version: int = 0,
        seed: int = 0,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        parallel: DataParallel | None = None,
    ) -> None:
        check_tensor_parallel(model.config, recipe, tensor_model_parallel_size)
        init_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, seed)
        from megatron.core import parallel_state

        self.model_config: ModelConfig = model.config
        self.dtype = next(model.parameters()).dtype
        self._ddp = None  # Megatron's DistributedDataParallel over the policy's GPTModel, with a group
        self.tp = tensor_model_parallel_size
        self._tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._tp_dims: dict[str, int | None] = {}  # Megatron name -> split dimension (None: whole), from the build
        if parallel is not None and self.tp > 1:  # micro-batches and row collectives go by data-parallel rank
            parallel = DataParallel.over(parallel_state.get_data_parallel_group())
        # the GRPO step, optimizer and bookkeeping are TorchTrainer's; the modules come from the hooks below
        super().__init__(model, recipe, config if config is not None else TrainerConfig(), ref_model=ref_model,
                         initial_version=initial_version, seed=seed, parallel=parallel)

    @property
    def backend(self) -> str:
        """``"megatron-te"`` on the Transformer Engine path, ``"megatron"`` on the local spec."""
        return "megatron-te" if self.model.gpt.fused_norms else "megatron"

    def _build_policy(self, model: CausalLM, recipe: Fp8Recipe) -> MegatronCausalLM:
        return self._build(model, recipe)

    def _build_reference(self, ref_model: CausalLM) -> MegatronCausalLM:
        return self._build(ref_model, Fp8Recipe(linear="bf16"))

    def _build(self, model: CausalLM, recipe: Fp8Recipe) -> MegatronCausalLM:
        gpt = build_gpt_model(model.config, recipe, self.dtype)
        adapter = MegatronCausalLM(gpt, model.config)
        full = hf_to_megatron(model.state_dict(), model.config, fused_norms=use_te())
        local = {k: v.shape for k, v in adapter.state_dict().items()}
        self._tp_dims = partition_dims(local, {k: v.shape for k, v in full.items()}, self.tp)
        with torch.no_grad():
            adapter.load_state_dict(self._local(full))
        return adapter

    # --- tensor parallel: this rank's slices <-> whole (TP = 1) Megatron tensors ------------------

    def _local(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.tp == 1:
            return full
        return {k: to_local(k, v, self._tp_dims[k], self._tp_rank, self.tp) for k, v in full.items()}

    def _full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors from this rank's slices (all-gathers over the tensor-parallel group, in name order)."""
        if self.tp == 1:
            return local
        return {k: gather(k, local[k], self._tp_dims[k], self._tp_group) for k in sorted(local)}

    def _param_names(self) -> list[str]:
        """Megatron names of the policy's parameters, in ``parameters()`` order (the optimizer's)."""
        return [n.removeprefix("gpt.") for n, _ in self.model.named_parameters()]

    def _checkpoint_state(self) -> dict:
        state = super()._checkpoint_state()
        if self.tp > 1:  # saved whole, in the TP = 1 layout: any tensor-parallel size resumes it
            state["model"] = self._full(state["model"])
            names, opt = self._param_names(), state["optimizer"]
            # new dicts: torch's optimizer state_dict() hands out its live per-parameter state
            opt["state"] = {i: {k: gather(names[i], v, self._tp_dims[names[i]], self._tp_group)
                                if torch.is_tensor(v) and v.dim() > 0 else v for k, v in st.items()}
                            for i, st in sorted(opt["state"].items())}
        return state

    def _restore_checkpoint_state(self, state: dict) -> None:
        if self.tp > 1:
            state["model"] = self._local(state["model"])
            names, opt = self._param_names(), state["optimizer"]
            opt["state"] = {i: {k: to_local(names[i], v, self._tp_dims[names[i]], self._tp_rank, self.tp)
                                if torch.is_tensor(v) and v.dim() > 0 else v for k, v in st.items()}
                            for i, st in opt["state"].items()}
        super()._restore_checkpoint_state(state)

    def _clip_grads(self) -> torch.Tensor:
        """Clip by the global gradient norm; with TP > 1 each slice counts once and each whole tensor (norms)
        once, summed over the tensor-parallel group."""
        if self.tp == 1:
            return super()._clip_grads()
        names = self._param_names()
        sq = torch.zeros((), dtype=torch.float32)
        grads = []
        for name, p in zip(names, self.model.parameters(), strict=True):
            if p.grad is None:
                continue
            grads.append(p.grad)
            if self._tp_dims[name] is not None or self._tp_rank == 0:
                sq += torch.linalg.vector_norm(p.grad.float()) ** 2
        dist.all_reduce(sq, group=self._tp_group)
        gn = sq.sqrt()
        clip = self.config.grad_clip
        if clip > 0 and torch.isfinite(gn):  # torch's clip_grad_norm_: scale by min(1, clip / (norm + 1e-6))
            coef = torch.clamp(clip / (gn + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return gn

    # --- data parallel: Megatron-Core DDP ------------------------------------------------------

    def _distribute(self, model: MegatronCausalLM, trained: bool) -> MegatronCausalLM:
        """The policy's GPTModel under Megatron DDP (its gradient buffers and bucketed all-reduce); the frozen
        reference stays a plain replica on every rank (no gradients, no collectives in its forward)."""
        if not trained:
            return model
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        config = copy.copy(model.gpt.config)
        config.calculate_per_token_loss = True  # the loss is already over the global token count: sum, no 1/N
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        # DDP hooks the parameters' gradient accumulation; the adapter keeps calling the GPTModel itself, so
        # state dict names (and checkpoints) are those of one rank
        self._ddp = DistributedDataParallel(config, ddp_config, module=model.gpt)
        return model

    def _zero_grads(self) -> None:
        if self._ddp is not None:
            self._ddp.zero_grad_buffer()
        super()._zero_grads()

    def _reduce_grads(self) -> None:
        """Sum the gradient buffers over the group (Megatron DDP's ``finish_grad_sync``) and hand them to AdamW
        as ``.grad`` (the hooks accumulate into ``main_grad`` and leave ``.grad`` empty)."""
        self._ddp.finish_grad_sync()
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = p.main_grad.to(p.dtype)

    @property
    def _sharded_state(self) -> bool:
        return False  # replicated on every rank: one .pt checkpoint (see the module doc)

    def save_checkpoint(self, path: str) -> None:
        if path.endswith(".dcp"):
            raise ValueError(f"{path}: the megatron backend writes one .pt checkpoint (its state is replicated "
                             f"across data-parallel ranks), not a .dcp directory")
        super().save_checkpoint(path)

    # --- weights under HF names ---------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Master weights under HF names and layout (fused Q/K/V and gate/up split back out); with TP > 1
        gathered whole from the ranks' slices (every rank of the group must call this, in the same order)."""
        mg = self._full({k: v.detach() for k, v in self.model.state_dict().items()})
        return megatron_to_hf(mg, self.model_config, fused_norms=self.model.gpt.fused_norms)

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the master weights in place from HF-named tensors (each rank keeps its slices)."""
        with torch.no_grad():
            self.model.load_state_dict(self._local(
                hf_to_megatron(tensors, self.model_config, fused_norms=self.model.gpt.fused_norms)))

    # --- checkpoints --------------------------------------------------------------------------

    # save_checkpoint / load_checkpoint are TorchTrainer's, under this class's CHECKPOINT_FORMAT: the state
    # dicts hold Megatron's layout (the optimizer state is keyed by these parameters).
