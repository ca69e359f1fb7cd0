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
* **Pipeline parallel** (``megatron_cfg.pipeline_model_parallel_size`` = P; the trainer runs as dp_size x T x P
  ranks): stage ``p`` holds decoder layers ``[p L/P, (p + 1) L/P)`` (the first stage the embedding, the last the
  final norm and output layer; :mod:`.pipeline_parallel`), and every pass — logprobs, the reference's, each
  update's forward/backward — runs Megatron-Core's own 1F1B schedule (``get_forward_backward_func``) over this
  data-parallel rank's micro-batches, activations sent stage to stage. The last stage computes logprobs and the
  policy loss (per-token: ``calculate_per_token_loss``, the loss already over the global token count), and hands
  the logprobs and metrics back to every stage. Tied embeddings: the last stage's copy of the embedding gets its
  gradient summed with the first stage's over Megatron's embedding group (as its ``finalize_model_grads`` does).
  Checkpoints and published weights are whole, in the P = 1 layout (each tensor broadcast from the stage that
  owns it), so any pipeline size resumes any other. A stop request is agreed by every rank before each
  micro-batch is scheduled, not inside the schedule.
* **Expert parallel** (``megatron_cfg.expert_model_parallel_size`` = EP, a mixture-of-experts model; no extra ranks:
  EP divides the data-parallel ranks, as Megatron-Core defines it): each MoE layer's experts are spread over the EP
  ranks of an expert-parallel group (:mod:`.expert_parallel`), tokens sent to them by Megatron's ``allgather`` or
  ``alltoall`` dispatcher (``moe_token_dispatcher_type``). Megatron DDP reduces the experts' gradients over the
  expert-data-parallel group and the rest over the data-parallel one; the clip counts each expert once. An expert
  runs each source rank's tokens on their own (:func:`.model.weights_after_experts`), so its FP8 wgrad quantizes
  the groups one rank's micro-batch makes, as at EP 1: logprobs are bitwise one rank's and gradients differ by FP32
  summation order only. Checkpoints and published weights are whole, in the EP = 1 layout (each expert from the
  rank holding it), so any EP size resumes any other. MoE runs at TP = PP = 1 here (Megatron's MoE with
  TP > 1 needs sequence parallelism, which the local spec's torch norm refuses).
* **Not here**: Megatron's ``DistributedOptimizer`` (ZeRO-1 sharding of the AdamW state) and its other
  optimizers are CUDA-only in megatron-core 0.16 (``clip_grads`` builds ``device='cuda'`` tensors;
  ``DistributedOptimizer`` accepts only ``torch.cuda.*Tensor`` parameters), so the AdamW state is torch's,
  replicated across data-parallel ranks and sliced across tensor- and pipeline-parallel ones; use the torch
  backend (FSDP2) for state sharded over data-parallel ranks. Virtual (interleaved) pipeline stages are not
  configurable.

On CPU a single process joins a one-rank gloo group, and :mod:`.shims` are applied.
"""

from __future__ import annotations

import copy
import functools
import json
import os

import torch
import torch.distributed as dist

from fp8rl.fp8 import Fp8Recipe
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.rl import LossNorm

from ..base import ShouldStop, TrainBatch
from ..logprob_pass import token_logprobs_and_entropy
from ..parallel import DataParallel
from ..torch_trainer import TorchTrainer, TrainerConfig, _add_metrics
from . import shims
from .convert import hf_to_megatron, megatron_to_hf
from .expert_parallel import check_expert_parallel, expert_owner, is_expert, whole_expert_name, whole_expert_order
from .model import MegatronCausalLM, build_gpt_model, stage_layers, use_te
from .pipeline_parallel import EMBEDDING, TIED_COPY, owner_stage, whole_name, whole_param_order
from .tensor_parallel import check_tensor_parallel, gather, partition_dims, to_local

__all__ = ["MegatronTrainer", "init_model_parallel"]



def init_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                        seed: int = 0, expert_model_parallel_size: int = 1) -> None:
    """Join (or create) the process group and Megatron's model-parallel state, once per process.

    Raises:
        ValueError: tensor- and pipeline-parallel sizes whose product does not divide the ranks started, or
            sizes that differ from the ones this process was already initialised with. (The expert-parallel size is
            checked against the model and the data-parallel ranks by :func:`.expert_parallel.check_expert_parallel`,
            which the trainer calls first.)
    """
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"policy.training.megatron_cfg.tensor_model_parallel_size={tp} x "
                         f"pipeline_model_parallel_size={pp} needs a multiple of {tp * pp} ranks (this trainer runs "
                         f"as {world}: start dp_size x {tp * pp} under torchrun)")
    from megatron.core import parallel_state, tensor_parallel

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        shims.apply()
    if not dist.is_initialized():  # a launcher (torchrun) may have done it already
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
        if torch.cuda.is_available():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    held = (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size())
    if held != (tp, pp, ep):
        raise ValueError(f"this process already runs Megatron at TP x PP x EP = {held[0]} x {held[1]} x {held[2]}, "
                         f"not {tp} x {pp} x {ep}")


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
        pipeline_model_parallel_size: Megatron's pipeline-parallel size (stages per data-parallel replica; it
            must divide the model's layers).
        parallel: the group of every trainer rank (data x tensor x pipeline parallel; every rank builds the same
            trainer), or None for one process.
        expert_model_parallel_size: Megatron's expert-parallel size (a mixture-of-experts model's experts spread
            over this many of the data-parallel ranks; it must divide the experts and the data-parallel size).
        moe_token_dispatcher_type: Megatron's token dispatcher, ``allgather`` or ``alltoall``.
    """

    CHECKPOINT_FORMAT = "fp8rl-megatron-trainer/1"
    supports_lora = False  # Megatron-Core's LoRA is NeMo's PEFT wrappers, not in megatron-core (policy.lora refused)

    fuses_logprobs = False  # its _backward runs Megatron's schedule: the logprob pass stays a pass of its own

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
        expert_model_parallel_size: int = 1,
        moe_token_dispatcher_type: str = "allgather",
    ) -> None:
        check_tensor_parallel(model.config, recipe, tensor_model_parallel_size)
        world = parallel.world if parallel is not None else 1
        check_expert_parallel(model.config, expert_model_parallel_size,
                              world // (tensor_model_parallel_size * pipeline_model_parallel_size),
                              moe_token_dispatcher_type)
        init_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, seed, expert_model_parallel_size)
        from megatron.core import parallel_state

        self.model_config: ModelConfig = model.config
        self.dtype = next(model.parameters()).dtype
        self._ddp = None  # Megatron's DistributedDataParallel over the policy's GPTModel, with a group
        self.tp, self.pp = tensor_model_parallel_size, pipeline_model_parallel_size
        self._tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._pp_group = parallel_state.get_pipeline_model_parallel_group() if self.pp > 1 else None
        self._pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.ep, self.dispatcher = expert_model_parallel_size, moe_token_dispatcher_type
        self._ep_group = parallel_state.get_expert_model_parallel_group() if self.ep > 1 else None
        self._ep_rank = parallel_state.get_expert_model_parallel_rank()
        self._num_local_experts = model.config.num_experts // self.ep if model.config.moe_layers else 0
        self._layers = stage_layers(model.config.num_hidden_layers)  # the global layers of this stage
        self._tp_dims: dict[str, int | None] = {}  # Megatron name -> split dimension (None: whole), from the build
        self._names: dict[str, str] = {}  # this stage's Megatron name -> the whole (TP = PP = 1) model's
        self._whole: dict[str, tuple[torch.Size, torch.dtype]] = {}  # the whole model's tensors: shape, dtype
        self._whole_order: list[str] = []  # the whole model's parameters in its parameters() order
        if parallel is not None and (self.tp > 1 or self.pp > 1):  # micro-batches, row collectives: by DP rank
            parallel = DataParallel.over(parallel_state.get_data_parallel_group())
        config = config if config is not None else TrainerConfig()
        if model.num_moe_layers and config.router_aux_loss_coef:
            raise ValueError("loss.router_aux_loss_coef: the megatron backend does not train a load-balancing loss on "
                             "a mixture-of-experts model yet; use backend torch")
        # the GRPO step, optimizer and bookkeeping are TorchTrainer's; the modules come from the hooks below
        # a mixture-of-experts model routes with Megatron's TopKRouter, which takes the torch backend's routing plans
        # (replay, the moe/* statistics) through Megatron's RouterReplay hook (.model.planned_router)
        super().__init__(model, recipe, config, ref_model=ref_model, initial_version=initial_version, seed=seed,
                         parallel=parallel)

    @property
    def backend(self) -> str:
        """``"megatron-te"`` on the Transformer Engine path, ``"megatron"`` on the local spec."""
        return "megatron-te" if self.model.gpt.fused_norms else "megatron"

    reports_recompute = False  # every pipeline layout reports the same metrics

    def recomputes(self, rows: int, seq_len: int, shared: int = 0) -> bool:
        """Never: activation checkpointing is the torch backend's (Megatron-Core's own recompute options are not
        wired; ``policy.training.activation_checkpointing: true`` is refused for this backend)."""
        return False

    def _prefix_len(self, mb: TrainBatch) -> int:
        """Always 0: running shared leading tokens once (:mod:`fp8rl.model.shared_prefix`) is the embedded
        :class:`CausalLM`'s; Megatron-Core's GPTModel takes no recorded prefix, so every row runs whole."""
        return 0

    def check_memory(self, rows: int, seq_len: int, *, where: str = "the trainer"):
        """Not estimated (None): :mod:`fp8rl.engines.footprint` models the embedded :class:`CausalLM`'s saved
        activations, not Megatron-Core's layers (their saved tensors, fusions and recompute options differ)."""
        return None

    def _build_policy(self, model: CausalLM, recipe: Fp8Recipe) -> MegatronCausalLM:
        built = self._build(model, recipe)
        local = [n.removeprefix("gpt.") for n, _ in built.named_parameters()]
        if self.ep > 1:
            self._whole_order = whole_expert_order(local, self.model_config.num_experts)
        else:
            self._whole_order = local if self.pp == 1 else whole_param_order(local, sorted(self._whole), self._layers)
        return built

    def _build_reference(self, ref_model: CausalLM) -> MegatronCausalLM:
        return self._build(ref_model, Fp8Recipe(linear="bf16"))

    def _build(self, model: CausalLM, recipe: Fp8Recipe) -> MegatronCausalLM:
        gpt = build_gpt_model(model.config, recipe, self.dtype, self.dispatcher)
        adapter = MegatronCausalLM(gpt, model.config)
        full = hf_to_megatron(model.state_dict(), model.config, fused_norms=use_te())
        self._whole = {k: (v.shape, v.dtype) for k, v in full.items()}
        local = {k: v.shape for k, v in adapter.state_dict().items()}
        tied_copy = self.pp > 1 and model.config.tie_word_embeddings and gpt.post_process
        self._names = {k: whole_expert_name(whole_name(k, self._layers, tied_copy), self._ep_rank,
                                            self._num_local_experts) for k in local}
        self._tp_dims = partition_dims(local, {k: full[self._names[k]].shape for k in local}, self.tp)
        with torch.no_grad():
            adapter.load_state_dict(self._local(full))
        return adapter

    # --- model parallel: this rank's slices and stage <-> whole (TP = PP = 1) Megatron tensors ----

    @property
    def _split(self) -> bool:
        """Whether this rank holds less than the whole model (tensor, pipeline or expert parallel)."""
        return self.tp > 1 or self.pp > 1 or self.ep > 1

    def _local(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors (its stage's, sliced) from whole ones under the whole model's names."""
        if not self._split:
            return full
        return {k: to_local(k, full[w], self._tp_dims[k], self._tp_rank, self.tp) for k, w in self._names.items()}

    def _owned(self, name: str) -> bool:
        """Whether this stage owns its tensor ``name`` (the last stage's tied copy of the embedding it does not)."""
        return not (name == TIED_COPY and self._names[name] == EMBEDDING)

    def _full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors under the whole model's names, on every rank, from each rank's ``local`` ones (this
        stage's, under its names): all-gathered over the tensor-parallel group, then each broadcast over the
        pipeline-parallel group from the stage that owns it (every rank calls this, with the same names)."""
        if not self._split:
            return local
        mine = {self._names[k]: gather(k, local[k], self._tp_dims[k], self._tp_group)
                for k in sorted(local) if self._owned(k)}
        if self.ep > 1:  # (pipeline parallel is 1) every rank's experts, one all-gather per local expert tensor
            for k in sorted(local):
                if is_expert(k):
                    parts = [torch.empty_like(local[k]) for _ in range(self.ep)]
                    dist.all_gather(parts, local[k].contiguous(), group=self._ep_group)
                    mine.update({whole_expert_name(k, r, self._num_local_experts): t for r, t in enumerate(parts)})
            return mine
        if self.pp == 1:
            return mine
        return {w: self._from_owner(w, mine.get(w), *self._whole[w]) for w in sorted(self._whole)}

    def _from_owner(self, whole: str, held: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The tensor the owner stage of ``whole`` holds (``held`` there), on every stage (a broadcast)."""
        owner = owner_stage(whole, self.model_config.num_hidden_layers, self.pp)
        t = held.contiguous() if owner == self._pp_rank else torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=dist.get_global_rank(self._pp_group, owner), group=self._pp_group)
        return t

    def _from_expert_owner(self, whole: str, held: torch.Tensor | None, shape: torch.Size,
                           dtype: torch.dtype) -> torch.Tensor:
        """The expert tensor ``whole`` on every rank of the expert-parallel group, from the rank holding it."""
        owner = expert_owner(whole, self._num_local_experts)
        t = held.contiguous() if owner == self._ep_rank else torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=dist.get_global_rank(self._ep_group, owner), group=self._ep_group)
        return t

    def _param_names(self) -> list[str]:
        """Megatron names of the policy's parameters, in ``parameters()`` order (the optimizer's)."""
        return [n.removeprefix("gpt.") for n, _ in self.model.named_parameters()]

    def _checkpoint_state(self) -> dict:
        state = super()._checkpoint_state()
        if not self._split:
            return state
        # saved whole, in the TP = PP = 1 layout (the optimizer state keyed by that model's parameter positions):
        # any tensor- and pipeline-parallel sizes resume it
        state["model"] = self._full(state["model"])
        names, opt = self._param_names(), state["optimizer"]
        if len(opt["param_groups"]) != 1:
            raise RuntimeError(f"expected one optimizer parameter group, got {len(opt['param_groups'])}")
        local = {self._names[n]: st for n, st in zip(names, (opt["state"].get(i) for i in range(len(names))),
                                                     strict=True) if self._owned(n)}
        whole_ix = {self._names[n]: n for n in names if self._owned(n)}
        # every rank's optimizer has stepped as often as every other's: all hold state, or none does
        keys = sorted(next(iter(local.values())).keys()) if all(local.values()) else []
        ref = next(iter(local.values())) if keys else {}  # each key's dtype and rank (moments, or the scalar step)
        out = {}
        for j, w in enumerate(self._whole_order):
            mine = local.get(w)  # this rank's state of w (None: another pipeline stage owns it)
            st = {}
            for key in keys:
                v = None if mine is None else mine[key]
                if v is not None and v.dim() > 0:
                    v = gather(whole_ix[w], v, self._tp_dims[whole_ix[w]], self._tp_group)
                shape = self._whole[w][0] if ref[key].dim() > 0 else torch.Size([])
                if self.pp > 1:
                    v = self._from_owner(w, v, shape, ref[key].dtype)
                elif self.ep > 1 and is_expert(w):
                    v = self._from_expert_owner(w, v, shape, ref[key].dtype)
                st[key] = v
            if st:
                out[j] = st
        opt["state"] = out
        opt["param_groups"] = [{**opt["param_groups"][0], "params": list(range(len(self._whole_order)))}]
        return state

    def _restore_checkpoint_state(self, state: dict) -> None:
        if self._split:
            state["model"] = self._local(state["model"])
            names, opt = self._param_names(), state["optimizer"]
            index = {w: j for j, w in enumerate(self._whole_order)}
            # each local parameter's whole one (the tied copy: the embedding's state, the same numbers)
            held = {i: opt["state"].get(index[self._names[n]]) for i, n in enumerate(names)}
            opt["state"] = {i: {k: to_local(names[i], v, self._tp_dims[names[i]], self._tp_rank, self.tp)
                                if torch.is_tensor(v) and v.dim() > 0 else v for k, v in st.items()}
                            for i, st in held.items() if st is not None}
            opt["param_groups"] = [{**g, "params": list(range(len(names)))} for g in opt["param_groups"][:1]]
        super()._restore_checkpoint_state(state)

    def _clip_grads(self) -> torch.Tensor:
        """Clip by the global gradient norm; with TP or PP > 1 each slice counts once, each whole tensor (norms)
        once and the tied embedding once, summed over the model-parallel (tensor x pipeline) group; with EP > 1 each
        expert once, summed over the expert-parallel group (every other tensor is on every rank)."""
        if not self._split:
            return super()._clip_grads()
        from megatron.core import parallel_state

        names = self._param_names()
        sq, sq_experts = torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32)
        grads = []
        for name, p in zip(names, self.model.parameters(), strict=True):
            if p.grad is None:
                continue
            grads.append(p.grad)
            if self.ep > 1 and is_expert(name):
                sq_experts += torch.linalg.vector_norm(p.grad.float()) ** 2
            elif self._owned(name) and (self._tp_dims[name] is not None or self._tp_rank == 0):
                sq += torch.linalg.vector_norm(p.grad.float()) ** 2
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        if self.ep > 1:
            dist.all_reduce(sq_experts, group=self._ep_group)
            sq = sq + sq_experts
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
        model.gpt.config.calculate_per_token_loss = True  # and the pipeline schedule must not scale it either
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
        as ``.grad`` (the hooks accumulate into ``main_grad`` and leave ``.grad`` empty). With pipeline stages and
        tied embeddings, the first stage's embedding and the last stage's copy then sum their gradients over
        Megatron's embedding group, so the two stay equal."""
        self._ddp.finish_grad_sync()
        if self.pp > 1 and self.model_config.tie_word_embeddings:
            from megatron.core import parallel_state

            if parallel_state.is_rank_in_embedding_group():
                dist.all_reduce(self.model.gpt.shared_embedding_or_output_weight().main_grad,
                                group=parallel_state.get_embedding_group())
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = p.main_grad.to(p.dtype)

    # --- pipeline parallel: every pass through Megatron's schedule ------------------------------

    @torch.no_grad()
    def _logprobs_of(self, model, batch: TrainBatch, should_stop: ShouldStop | None = None, **routing) -> torch.Tensor:
        # ``routing`` (replay, stats): mixture-of-experts only, which runs at pipeline-parallel size 1
        if self.pp == 1:
            return super()._logprobs_of(model, batch, should_stop, **routing)
        rounds = list(self._micro_batches(batch, should_stop))  # the stop agreed by every rank, round by round
        store = self._schedule(model, [mb for _, mb in rounds], forward_only=True)
        last = self._pp_rank == self.pp - 1
        lps = [self._from_last_stage(store[k] if last else None, mb.input_ids.shape)
               for k, (_, mb) in enumerate(rounds)]
        return self._rows_of(batch, ((i, lp) for (i, _), lp in zip(rounds, lps, strict=True)))

    def _backward(self, batch: TrainBatch, norm: LossNorm, should_stop: ShouldStop | None = None, *,
                  fill_prev: bool = False):
        if self.pp == 1:
            return super()._backward(batch, norm, should_stop, fill_prev=fill_prev)
        assert not fill_prev, "the Megatron backend keeps its logprob pass (fuses_logprobs = False)"
        mbs = [mb for _, mb in self._micro_batches(batch, should_stop)]
        store = self._schedule(self.model, mbs, forward_only=False, norm=norm)
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        for loss, m, n_mb in store:  # the last stage's; empty elsewhere
            _add_metrics(totals, weights, loss, m, n_mb)
        return self._json_from_last_stage([totals, weights])

    def _schedule(self, model: MegatronCausalLM, mbs: list[TrainBatch], forward_only: bool,
                  norm: LossNorm | None = None) -> list:
        """Megatron's pipeline schedule over micro-batches ``mbs``: forward only (the last stage's list holds each
        one's ``(rows, T)`` logprobs) or forward and backward of the policy loss over ``norm`` (the update's
        global counts; gradients accumulated; the last stage's list holds ``(loss, metrics, tokens)`` per
        micro-batch)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        temperature = self.config.temperature

        def loss_func(mb: TrainBatch, logits: torch.Tensor, non_loss_data: bool = False):
            curr, ent = token_logprobs_and_entropy(logits, mb.input_ids, temperature, entropy=not non_loss_data)
            if non_loss_data:
                return curr
            loss, m = self._loss(curr, mb, norm, ent)
            return loss, torch.tensor(mb.num_tokens, dtype=torch.int), (float(loss.detach()), m, mb.num_tokens)

        def forward_step(data_iterator, gpt):
            mb = next(data_iterator)
            return model(mb.input_ids, mb.attention_mask), functools.partial(loss_func, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=model.gpt, num_microbatches=len(mbs),
            seq_length=mbs[0].input_ids.shape[1], micro_batch_size=self.config.micro_batch_size,
            forward_only=forward_only, collect_non_loss_data=forward_only)

    def _from_last_stage(self, t: torch.Tensor | None, shape) -> torch.Tensor:
        """The last pipeline stage's FP32 tensor ``t`` of ``shape``, on every stage (a broadcast)."""
        out = t.detach().float().contiguous() if t is not None else torch.empty(shape, dtype=torch.float32)
        dist.broadcast(out, src=dist.get_global_rank(self._pp_group, self.pp - 1), group=self._pp_group)
        return out

    def _json_from_last_stage(self, value):
        """The last pipeline stage's JSON-able ``value`` on every stage (floats round-trip exactly)."""
        last = self._pp_rank == self.pp - 1
        data = json.dumps(value).encode() if last else b""
        n = self._from_last_stage(torch.tensor([float(len(data))]) if last else None, (1,))
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if last else torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, src=dist.get_global_rank(self._pp_group, self.pp - 1), group=self._pp_group)
        return json.loads(buf.numpy().tobytes())

    @property
    def _sharded_state(self) -> bool:
        return False  # replicated on every rank: one .pt checkpoint (see the module doc)

    def save_checkpoint(self, path: str) -> None:
        if path.endswith(".dcp"):
            raise ValueError(f"{path}: the megatron backend writes one .pt checkpoint (its state is replicated "
                             f"across data-parallel ranks), not a .dcp directory")
        super().save_checkpoint(path)

    # --- weights under HF names ---------------------------------------------------------------

    def state_dict(self, *, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """Master weights under HF names and layout (fused Q/K/V and gate/up split back out); with TP > 1
        gathered whole from the ranks' slices (every rank of the group must call this, in the same order)."""
        if adapters_only:
            raise ValueError("adapters_only: the megatron backend trains every weight (no LoRA)")
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
