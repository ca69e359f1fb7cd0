"""A Megatron-Core GPTModel built from a Hugging Face (Llama / Qwen2 / Qwen3 / Qwen3-MoE / DeepSeek-V3) config, FP8 per
recipe. DeepSeek-V3 (``deepseek_v3``, Moonlight) is Megatron-Core's multi-latent attention (:func:`latent_attention`)
and ``MoELayer`` with shared experts, routed by the torch backend's rule (:func:`planned_router`).

Two ways to run FP8 linears, chosen by what the machine has (one decision, in :func:`use_te`):

* **Transformer Engine** (CUDA + ``transformer_engine`` importable): the TE layer spec with
  ``fp8="e4m3"``, ``fp8_recipe`` = the job's scaling (``blockwise``: FP32 128×128 weight / 1×128 activation
  scales; ``mxfp8``: TE's MXFP8BlockScaling, Blackwell only; ``tensorwise``: TE's Float8CurrentScaling — Megatron
  maps the names) and ``first_last_layers_bf16`` for the recipe's high-precision layers. Not testable on CPU.
* **Local spec** (anywhere): Megatron's own modules, with :class:`Fp8ColumnParallelLinear` /
  :class:`Fp8RowParallelLinear` swapped into the spec of every layer the recipe puts in FP8. They
  call :func:`fp8rl.fp8.fp8_linear` — the same reference numerics as the torch backend and the
  rollout, in the recipe's scaling — on each *Hugging Face* tensor of a fused weight separately (Q, K, V; gate,
  up), so the weight blocks (or tensor scales) are exactly the ones the rollout quantizes from the same master
  weights.

:class:`MegatronCausalLM` adapts the GPTModel to the :class:`fp8rl.model.CausalLM` call
``model(input_ids, attention_mask=...) -> (B, T, V) FP32 logits`` the GRPO step uses.

Size (~800 lines): the Megatron-Core layer specs of every mapped family (dense, MoE, latent attention) and the CPU
shims they need are one translation table from fp8rl's model to Megatron's; the weight-name mapping lives in
:mod:`.convert`, the parallel layouts in their own modules.
"""

from __future__ import annotations

import copy
import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl.fp8 import Fp8Recipe, fp8_linear
from fp8rl.model import ModelConfig
from fp8rl.model.mla import LATENT_NORM_EPS
from fp8rl.model.router import RoutingRule
from fp8rl.model.transformer import rope_inv_freq

from .convert import expert_gate_up_rows, gate_up_rows, qkv_rows, shared_gate_up_rows

__all__ = [
    "build_gpt_model", "MegatronCausalLM", "RowPositionRotary", "fp8_parallel_linears", "stage_layers",
    "transformer_config", "use_te",
]


def use_te() -> bool:
    """Whether the Transformer Engine path is taken: CUDA present and ``transformer_engine`` importable."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


# ---------------------------------------------------------------------------------------------
# FP8 linears for the local spec
# ---------------------------------------------------------------------------------------------


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    Megatron's tensor-parallel regions all-reduce ``grad.contiguous()`` *in place*; for a non-contiguous
    gradient that is a copy, and the sum is lost (megatron-core 0.16 ``mappings._reduce``). The gradient of
    a transposed view is non-contiguous, so the FP8 linears put this between the region and the transpose.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _fp8_seq_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mod: nn.Module) -> torch.Tensor:
    """``fp8_linear`` on Megatron's ``(S, B, K)`` activations, one call per HF tensor of a fused weight.

    Tokens are fed batch-major, ``(B, S, K)``: the wgrad GEMM quantizes x and dy in 1×128 groups
    *along tokens*, so the token order decides the groups; batch-major is the torch backend's order.
    The output is contiguous ``(S, B, N)``, as Megatron's own linears return it (its regions and
    attention ``view`` it).
    """
    kw = dict(pow2_scale=mod.pow2_weight_scale, pow2_activation_scale=mod.pow2_activation_scale, scaling=mod.scaling)
    if x.dim() == 2:  # an expert's tokens (MoELayer, SequentialMLP): rows in the dispatcher's order, no batch axis
        return _fp8_rows(x, weight, bias, mod, kw)
    xb = _ContiguousGrad.apply(x).transpose(0, 1)  # (B, S, K)
    if mod.hf_rows is None:
        y = fp8_linear(xb, weight, bias, **kw)  # (B, S, N)
    else:
        parts = [fp8_linear(xb, weight.index_select(0, r), None if bias is None else bias.index_select(0, r), **kw)
                 for r in mod.hf_rows]
        y = torch.cat(parts, dim=-1).index_select(-1, mod.hf_inverse)  # back to the fused row order, (B, S, N)
    return y.transpose(0, 1).contiguous()  # (S, B, N)


def _fp8_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mod: nn.Module, kw: dict):
    """``fp8_linear`` on ``(T, K)`` rows (an expert's tokens), one call per HF tensor of a fused weight."""
    if mod.hf_rows is None:
        return fp8_linear(x, weight, bias, **kw)
    parts = [fp8_linear(x, weight.index_select(0, r), None if bias is None else bias.index_select(0, r), **kw)
             for r in mod.hf_rows]
    return torch.cat(parts, dim=-1).index_select(-1, mod.hf_inverse)


def _local_rows(rows: tuple[torch.Tensor, ...], fused: str) -> list[torch.Tensor]:
    """``rows`` (each HF tensor's rows in the TP = 1 fused weight) as rows of this rank's slice of it, in HF
    order: the slice is cut exactly as the weight is (:func:`.tensor_parallel.to_local`)."""
    from megatron.core import parallel_state

    from .tensor_parallel import to_local

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return list(rows)
    n = sum(len(r) for r in rows)
    held = to_local("mlp.linear_fc1.weight" if fused != "qkv" else "linear_qkv.weight", torch.arange(n), 0,
                    parallel_state.get_tensor_model_parallel_rank(), tp)  # full row ids, in local order
    where = torch.full((n,), -1, dtype=torch.long)
    where[held] = torch.arange(len(held))
    return [where[r][where[r] >= 0] for r in rows]


def _init_fp8(mod: nn.Module, fused: str | None, pow2_weight_scale: bool, pow2_activation_scale: bool,
              model_config: ModelConfig | None, scaling: str = "blockwise") -> None:
    from megatron.core import parallel_state

    mod.pow2_weight_scale, mod.pow2_activation_scale = pow2_weight_scale, pow2_activation_scale
    mod.scaling = scaling
    mod.tp = parallel_state.get_tensor_model_parallel_world_size()
    mod.hf_rows = None
    if fused is not None:
        table = {"qkv": qkv_rows, "gate_up": gate_up_rows, "expert_gate_up": expert_gate_up_rows,
                 "shared_gate_up": shared_gate_up_rows}[fused]
        rows = _local_rows(table(model_config), fused)
        mod.hf_rows = [r.to(mod.weight.device) for r in rows]
        mod.hf_inverse = torch.argsort(torch.cat(rows)).to(mod.weight.device)


@functools.cache
def fp8_parallel_linears() -> tuple[type, type]:
    """``(Fp8ColumnParallelLinear, Fp8RowParallelLinear)``: FP8 subclasses of Megatron's local linears.

    Defined on first call, because megatron-core is an optional dependency of this package.
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    class _Column(ColumnParallelLinear):
        """Megatron ``ColumnParallelLinear`` computing in block-scaled FP8 via ``fp8rl.fp8``.

        ``fused`` names the HF tensors stacked in the weight (``"qkv"``, ``"gate_up"`` or None);
        each is quantized and multiplied on its own (its rows on this rank, with TP > 1). The bias (if
        any) is added inside, in FP32. With TP > 1 the input enters Megatron's tensor-parallel region
        (identity forward, all-reduced gradient), as the parent's forward does.
        """

        def __init__(self, *args, fused=None, pow2_weight_scale=False, pow2_activation_scale=False,
                     model_config=None, scaling="blockwise", **kwargs):
            super().__init__(*args, **kwargs)
            _init_fp8(self, fused, pow2_weight_scale, pow2_activation_scale, model_config, scaling)

        def forward(self, input_, weight=None, runtime_gather_output=None):
            w = self.weight if weight is None else weight
            bias = None if self.skip_bias_add else self.bias
            x = input_ if self.tp == 1 else copy_to_tensor_model_parallel_region(input_)
            out = _fp8_seq_first(x, w, bias, self)
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            if gather and self.tp > 1:
                out = gather_from_tensor_model_parallel_region(out)
            return out, (self.bias if self.skip_bias_add else None)

    class _Row(RowParallelLinear):
        """Megatron ``RowParallelLinear`` in block-scaled FP8. With TP > 1 the input is this rank's slice of K
        and the partial outputs are all-reduced (Megatron's region), then the bias (if any) added in FP32."""

        def __init__(self, *args, pow2_weight_scale=False, pow2_activation_scale=False, scaling="blockwise",
                     **kwargs):
            super().__init__(*args, **kwargs)
            _init_fp8(self, None, pow2_weight_scale, pow2_activation_scale, None, scaling)

        def forward(self, input_):
            if self.tp == 1:
                return _fp8_seq_first(input_, self.weight, self.bias, self), None
            out = reduce_from_tensor_model_parallel_region(_fp8_seq_first(input_, self.weight, None, self))
            return (out if self.bias is None else out + self.bias), None

    _Column.__name__ = _Column.__qualname__ = "Fp8ColumnParallelLinear"
    _Row.__name__ = _Row.__qualname__ = "Fp8RowParallelLinear"
    return _Column, _Row


@functools.cache
def batch_major_moe_layer() -> type:
    """``BatchMajorMoELayer``: Megatron's ``MoELayer`` over the tokens in batch-major order.

    A mixture-of-experts layer computes each token on its own, except one thing: FP8's wgrad quantizes an expert's
    x and dy 1×128 *along its tokens*, so the order of the tokens an expert receives decides its scaling groups. The
    dispatcher flattens ``(S, B, H)`` sequence-major and keeps that order within each expert; the torch backend
    (and the rollout) flatten ``(B, T)`` batch-major. This layer hands the dispatcher ``(B, S, H)`` — the same
    tokens, batch-major — and returns the output in Megatron's ``(S, B, H)``, so every expert sees the torch
    backend's token order (its 1×128 groups, hence its gradients); the shared experts (DeepSeek), a dense MLP, get
    Megatron's ``(S, B, H)`` as any MLP does. Its ``allgather`` dispatcher is
    :func:`uneven_allgather_dispatcher`'s (ranks' micro-batches may differ in rows), and its experts
    (:func:`weights_after_experts`) read from the dispatcher which rank each of their tokens came from.
    Defined on first call (megatron-core is optional).
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class BatchMajorMoELayer(MoELayer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if type(self.token_dispatcher) is MoEAllGatherTokenDispatcher:
                self.token_dispatcher.__class__ = uneven_allgather_dispatcher()
            self.experts.dispatcher = self.token_dispatcher  # not a module: no state, no parameters

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            if padding_mask is not None:
                padding_mask = padding_mask.transpose(0, 1).contiguous()
            out, bias = super().forward(hidden_states.transpose(0, 1).contiguous(), intermediate_tensors, padding_mask)
            return out.transpose(0, 1).contiguous(), bias

        def shared_experts_compute(self, hidden_states):
            # the shared experts are a dense MLP: they take Megatron's (S, B, H), whose FP8 linears feed their GEMMs
            # batch-major (the torch backend's 1x128 groups); hidden_states is batch-major here
            out = super().shared_experts_compute(hidden_states.transpose(0, 1).contiguous())
            return None if out is None else out.transpose(0, 1).contiguous()

    return BatchMajorMoELayer


@functools.cache
def uneven_allgather_dispatcher() -> type:
    """``UnevenAllGatherDispatcher``: Megatron's ``allgather`` token dispatcher for ranks whose token counts differ.

    Megatron's all-gathers (and the reduce-scatter that combines) assume every rank of the tensor x expert parallel
    group holds as many tokens; the trainer's rounds give ranks micro-batches of different rows (the last one
    shorter, a one-row filler past the end). This one all-gathers the counts first and passes them as the split
    sizes Megatron's gather / reduce-scatter take, keeping them (:attr:`source_tokens`: tokens per source rank, in
    rank order) for the experts. Nothing else differs."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class UnevenAllGatherDispatcher(MoEAllGatherTokenDispatcher):
        source_tokens: list[int] | None = None

        def token_dispatch(self, hidden_states, probs):
            if self.tp_size == 1 and self.ep_size == 1:
                self.source_tokens = [hidden_states.shape[0]]
                return hidden_states, probs
            group = self.tp_ep_group
            counts = torch.empty(group.size(), dtype=torch.long, device=hidden_states.device)
            dist.all_gather_into_tensor(counts, torch.tensor([hidden_states.shape[0]], device=counts.device),
                                        group=group)
            sizes = self.source_tokens = counts.tolist()
            with torch.no_grad():
                self.routing_map = gather_from_sequence_parallel_region(self.routing_map, group=group,
                                                                        output_split_sizes=sizes)
            probs = gather_from_sequence_parallel_region(probs, group=group, output_split_sizes=sizes)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=group, output_split_sizes=sizes)
            return hidden_states, probs

        def token_combine(self, hidden_states):
            if self.tp_size == 1 and self.ep_size == 1:
                return hidden_states
            return reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.local_probs.dtype), group=self.tp_ep_group,
                input_split_sizes=self.source_tokens).to(hidden_states.dtype)

    return UnevenAllGatherDispatcher


def source_segments(dispatcher, num_local: int) -> torch.Tensor | None:
    """``(sources, num_local)`` tokens each local expert received from each source rank, in the order the
    dispatcher lays them out (per expert: source 0's tokens, then source 1's, ...); None with one source."""
    if dispatcher.ep_size * dispatcher.tp_size == 1:
        return None
    if hasattr(dispatcher, "source_tokens"):  # allgather: the gathered rows come rank after rank
        rows = dispatcher.local_map.split(dispatcher.source_tokens, dim=0)
        return torch.stack([r.sum(dim=0) for r in rows]).long().cpu()
    if num_local > 1:  # alltoall: kept per (source, local expert) to sort the received chunks by expert
        return torch.as_tensor(dispatcher.num_global_tokens_per_local_expert).reshape(-1, num_local).long().cpu()
    return torch.as_tensor(dispatcher.output_splits).reshape(-1, 1).long().cpu()


@functools.cache
def planned_router() -> type:
    """``PlannedTopKRouter``: Megatron's ``TopKRouter`` taking the torch backend's routing plans
    (:class:`fp8rl.model.router.Routing`: replay the rollout's routes, record the ones used, count the load).

    The replay goes through Megatron's own hook: with ``moe_enable_routing_replay`` the router hands its top-k to a
    ``RouterReplay`` (``router_replay.get_replay_topk``), which returns the experts to use and their scores. Megatron's
    class replays a whole target tensor; the rollout's routes leave tokens out (-1: padding, a row's last token), so
    this router's replay is a subclass that asks the installed plan, token by token (the router's own top-k where the
    plan gives none, as :meth:`Routing.ids_for` does for the torch backend), and hands the plan what was used. Its
    instances stay out of ``RouterReplay.global_router_replay_instances`` (a class-level list every build appends to):
    each model's routers answer only to the plan installed on *that* model, so a second model built in the same
    process never replays another's routes. Tokens reach the router batch-major (:func:`batch_major_moe_layer`), the
    order of a plan's ``(B, T)`` rows.

    DeepSeek's sigmoid routing (``rule.scoring == "sigmoid"``) is the torch backend's :class:`RoutingRule` on the
    router's FP32 logits, its bias Megatron's ``expert_bias`` buffer (HF's ``e_score_correction_bias``; never updated:
    ``moe_router_bias_update_rate`` 0), and it asks the plan directly. Defined on first call (megatron-core is
    optional).
    """
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class PlanReplay(RouterReplay):
        def __init__(self, router) -> None:  # not super().__init__: that would join the class-level list
            self.target_topk_idx = self.recorded_topk_idx = None
            self.replay_backward_list = []
            self.router_replay_action = RouterReplayAction.REPLAY_FORWARD
            self.router = router

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            plan, index = self.router.plan, self.router.moe_index
            if plan is None:
                return values, own
            ids = plan.ids_for(index, own)
            # the plan's statistics take probabilities over all experts: the scores are those with a pre-softmax
            # router, logits otherwise
            probs = scores if self.router.config.moe_router_pre_softmax else torch.softmax(scores.float(), dim=-1)
            plan.observe(index, ids, own, probs)
            return scores.gather(1, ids), ids

    class PlannedTopKRouter(TopKRouter):
        takes_routing_plan = True  # fp8rl.model.router.routers() finds it

        def __init__(self, *args, rule: RoutingRule, **kwargs):
            super().__init__(*args, **kwargs)
            self.rule = rule
            if self.router_replay is None:
                raise RuntimeError("PlannedTopKRouter needs moe_enable_routing_replay in the TransformerConfig")
            instances = RouterReplay.global_router_replay_instances
            instances[:] = [r for r in instances if r is not self.router_replay]
            self.router_replay = PlanReplay(self)
            self.plan = None  # the Routing of the forward in progress (set by fp8rl.model.router.routing)
            self.moe_index = 0  # this router's place among the model's MoE layers (set by build_gpt_model)

        def routing(self, logits, padding_mask=None):
            if self.rule.scoring == "softmax":
                return super().routing(logits, padding_mask=padding_mask)
            # DeepSeek's rule, as the torch backend computes it (RoutingRule.route): Megatron's sigmoid router scores
            # a group by its top (top_k / group_topk) experts where DeepSeek-V3 takes its top 2, and its
            # torch.sigmoid rounds an element by where the tensor ends (fp8rl.model.router._sigmoid)
            logits = logits.view(-1, self.config.num_moe_experts)
            ids, weights = self.rule.route(logits.float(), self.expert_bias, self.plan, self.moe_index)
            probs = torch.zeros_like(logits, dtype=weights.dtype).scatter(1, ids, weights)
            return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)

    return PlannedTopKRouter


@functools.cache
def weights_after_experts() -> type:
    """``WeightsAfterExperts``: Megatron's ``SequentialMLP`` with each row's routing weight applied to the expert's
    *output*, as the torch backend (and the rollout) combine, instead of to its intermediate activation (Megatron 0.16
    passes it to the expert MLP as ``per_token_scale``, multiplied in before ``linear_fc2``). The two are equal in
    exact arithmetic, but FP8 quantizes ``linear_fc2``'s input and output gradient: scaled rows change its 1×128 groups'
    amaxes, hence its wgrad (4.5 % on the test model). The expert runs with unit weights (an exact multiply by 1) and
    its output is scaled here; the router's gradient flows through this product, as in the torch backend.

    Under expert parallelism an expert receives the tokens of several ranks' micro-batches, one after another; it
    runs on each rank's tokens separately (:func:`source_segments`), so its FP8 wgrad quantizes the 1×128 groups one
    rank's micro-batch makes — those of expert parallelism 1, where each rank runs its own micro-batch — and the
    gradient is their sum, as data parallelism's all-reduce sums them. Per token nothing changes."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    class WeightsAfterExperts(SequentialMLP):
        dispatcher = None  # the MoELayer's token dispatcher (set by BatchMajorMoELayer)
        per_source = True  # False: each expert over all its tokens at once (the tests' negative control)

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            segments = None if self.dispatcher is None or not self.per_source else \
                source_segments(self.dispatcher, self.num_local_experts)
            if segments is None:
                out, bias = super().forward(permuted_local_hidden_states, tokens_per_expert,
                                            torch.ones_like(permuted_probs))
            else:
                out, bias = self._per_source(permuted_local_hidden_states, tokens_per_expert, segments), None
            return out * permuted_probs.unsqueeze(-1).to(out.dtype), bias

        def _per_source(self, hidden, tokens_per_expert, segments):
            per_expert = [int(n) for n in tokens_per_expert.tolist()]
            if segments.sum(dim=0).tolist() != per_expert:
                raise RuntimeError(f"expert token counts {per_expert} differ from their sources' {segments.tolist()}")
            outs = []
            for j, (expert, rows) in enumerate(zip(self.local_experts, hidden.split(per_expert), strict=True)):
                for part in rows.split(segments[:, j].tolist()):
                    if part.shape[0]:
                        out, _ = expert(part, hidden.new_ones(part.shape[0]))
                        outs.append(out)
            if not outs:
                return hidden.new_zeros(0, self.config.hidden_size)
            return torch.cat(outs, dim=0)

    return WeightsAfterExperts


_MLA_COLUMNS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")


@functools.cache
def latent_attention() -> type:
    """``LatentAttention``: Megatron-Core's ``MLASelfAttention`` (multi-head latent attention) with its five
    column-parallel projections computed by fp8rl's FP8 linears in a layer the recipe puts in FP8 (``fp8``: the
    linears' scaling settings; None keeps Megatron's own).

    ``MLASelfAttention`` accepts only Megatron's own classes for its down projections (an identity check on the spec),
    so the FP8 class is put in after construction: the same module, parameters and state, its forward
    :class:`Fp8ColumnParallelLinear`'s. Each projection is one HF tensor (``q_proj`` or ``q_a_proj`` / ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_b_proj``), quantized in its own 128x128 blocks as the rollout does. The output
    projection comes from the spec. Defined on first call (megatron-core is optional).
    """
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LatentAttention(MLASelfAttention):
        def __init__(self, *args, fp8: dict | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            if fp8 is None:
                return
            column, _ = fp8_parallel_linears()
            for name in _MLA_COLUMNS:
                mod = getattr(self, name, None)
                if mod is not None:
                    mod.__class__ = column
                    _init_fp8(mod, None, fp8["pow2_weight_scale"], fp8["pow2_activation_scale"], None, fp8["scaling"])

    return LatentAttention


@functools.cache
def latent_core_attention() -> type:
    """``LatentDotProductAttention``: Megatron's local ``DotProductAttention`` for multi-latent attention, which builds
    its core attention with the key's and value's widths (``k_channels``, ``v_channels``) that the local class does not
    take. Its math needs neither — scores over whatever width the query and key have, at the softmax scale MLA passes —
    only its output width, ``kv_channels`` per head, which the config sets to ``v_head_dim``; this class checks that
    and drops the two. Defined on first call (megatron-core is optional)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentDotProductAttention(DotProductAttention):
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            if v_channels is not None and v_channels != config.kv_channels:
                raise ValueError(f"multi-latent attention: value width {v_channels} but kv_channels "
                                 f"{config.kv_channels} (transformer_config sets it to v_head_dim)")
            super().__init__(config, *args, **kwargs)

    return LatentDotProductAttention


class LatentNorm:
    """The RMSNorm of MLA's compressed query and latent (``q_layernorm``, ``kv_layernorm``): Megatron's torch norm at
    transformers' epsilon for them (:data:`~fp8rl.model.mla.LATENT_NORM_EPS`), which Megatron would take from the
    model's ``rms_norm_eps``."""

    def __new__(cls, config, hidden_size: int, eps: float = LATENT_NORM_EPS, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return WrappedTorchNorm(config, hidden_size, eps=LATENT_NORM_EPS, **kwargs)


# ---------------------------------------------------------------------------------------------
# config and spec
# ---------------------------------------------------------------------------------------------


def _check_supported(config: ModelConfig) -> None:
    config.family.require("megatron")
    if config.is_mla:
        if not config.rope_interleave:
            raise ValueError(f"{config.architecture} with rope_interleave=false: Megatron-Core's multi-latent "
                             f"attention always de-interleaves the rotary dims (transformers' rope_interleave=true); "
                             f"use policy.training.backend: torch")
        if config.attention_bias:
            raise ValueError(f"{config.architecture} with attention_bias=true: Megatron-Core's multi-latent attention "
                             f"builds its projections without biases; use policy.training.backend: torch")
    if config.attention_bias and config.o_proj_bias:
        raise ValueError(f"{config.architecture} with attention_bias=True puts a bias on o_proj but not on the MLP; "
                         f"Megatron's add_bias_linear cannot express that (use backend: torch)")


def transformer_config(config: ModelConfig, recipe: Fp8Recipe, dtype: torch.dtype, te: bool,
                       moe_token_dispatcher_type: str = "allgather"):
    """The Megatron ``TransformerConfig`` equal to ``config`` (dropout off, fusions off on CPU)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    _check_supported(config)
    kw = _moe_config(config, moe_token_dispatcher_type) | _mla_config(config, te)
    if te and recipe.fp8_linears:
        n_first, n_last = recipe.num_first_layers_in_bf16, recipe.num_last_layers_in_bf16
        kw |= dict(fp8="e4m3", fp8_recipe=recipe.scaling, first_last_layers_bf16=bool(n_first or n_last),
                  num_layers_at_start_in_bf16=n_first, num_layers_at_end_in_bf16=n_last)
    tc = (MLATransformerConfig if config.is_mla else TransformerConfig)(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_key_value_heads,
        kv_channels=config.v_head_dim if config.is_mla else config.head_dim, ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, qk_layernorm=config.qk_norm,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=bool(config.attention_bias),
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,
        persist_layer_norm=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        pipeline_dtype=dtype,  # pipeline stages send activations in the model's dtype
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        **kw,
    )
    # a step's last micro-batch may have fewer rows: pipeline stages exchange shapes before each transfer (set
    # after construction: the config's check of it concerns the MoE token dispatcher, which a dense model lacks)
    tc.variable_seq_lengths = True
    return tc


def _unsliced(what: str, why: str) -> None:
    """Refuse tensor or pipeline parallelism > 1 for ``what``, saying ``why`` and what to scale with instead."""
    from megatron.core import parallel_state

    tp, pp = (parallel_state.get_tensor_model_parallel_world_size(),
              parallel_state.get_pipeline_model_parallel_world_size())
    if (tp, pp) != (1, 1):
        raise ValueError(f"policy.training.megatron_cfg: {what} runs at tensor_model_parallel_size 1 and "
                         f"pipeline_model_parallel_size 1 on the megatron backend (got {tp} / {pp}): {why}; scale it "
                         f"with dp_size and expert_model_parallel_size")


def _mla_config(config: ModelConfig, te: bool) -> dict:
    """The ``MLATransformerConfig`` keys of a multi-latent-attention model (empty for another): its ranks and head
    widths, plain RoPE (``rope_type="rope"``: transformers' rotary without YaRN, which fp8rl refuses; Megatron's
    softmax scale is then ``(qk_nope + qk_rope) ** -0.5``, transformers')."""

    if not config.is_mla:
        return {}
    if te:
        raise ValueError(f"{config.architecture} (multi-head latent attention) on the Transformer Engine path (CUDA + "
                         f"transformer_engine) is not mapped: TE's MLA spec fuses the latent norms into the up "
                         f"projections under other names than the local spec's, which the HF conversion does not "
                         f"know; run it where transformer_engine is not installed (the local spec)")
    _unsliced("a multi-latent-attention model", "slicing MLA's projections over tensor-parallel ranks is not mapped")
    return dict(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_head_dim=config.qk_nope_head_dim,
                qk_pos_emb_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rope_type="rope",
                rotary_base=config.rope_theta, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)


def _moe_config(config: ModelConfig, dispatcher: str = "allgather") -> dict:
    """The ``TransformerConfig`` keys of a mixture-of-experts model (empty for a dense one): Megatron's ``MoELayer``
    with ``SequentialMLP`` experts where :attr:`~fp8rl.model.ModelConfig.moe_layers` says, routing as the torch
    backend's :class:`~fp8rl.model.router.TopKRouter` — FP32 softmax top-k (``moe_router_pre_softmax``: softmax over
    all experts, then top-k, when the weights are not renormalised; else top-k of the logits, then softmax over them,
    the same renormalised weights), no load-balancing loss, no capacity (no token dropped), the experts spread over
    Megatron's expert-parallel group, tokens moved by ``dispatcher`` (``allgather`` or ``alltoall``). DeepSeek's
    routing (sigmoid, the selection-only ``expert_bias``, groups, ``routed_scaling_factor``) is :func:`planned_router`'s
    rule, the keys here saying the same; its shared experts are Megatron's ``SharedExpertMLP`` (no gate)."""
    from megatron.core import parallel_state

    if not config.moe_layers:
        return {}
    _unsliced(f"a mixture-of-experts model ({config.num_experts} experts)", "Megatron's MoE with TP > 1 needs "
              "sequence parallelism, which the local spec's torch norm refuses")
    deepseek = {}
    if RoutingRule.of(config).scoring == "sigmoid":  # PlannedTopKRouter routes by the rule; Megatron's keys agree
        deepseek = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_bias_update_rate=0.0, moe_router_topk_scaling_factor=config.routed_scaling_factor)
        if config.n_group > 1:
            deepseek |= dict(moe_router_num_groups=config.n_group, moe_router_group_topk=config.topk_group)
        if config.shared_expert_intermediate_size:
            deepseek |= dict(moe_shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                             moe_shared_expert_overlap=False)
    return deepseek | dict(num_moe_experts=config.num_experts, moe_router_topk=config.num_experts_per_tok,
                moe_ffn_hidden_size=config.moe_intermediate_size,
                moe_layer_freq=[int(config.is_moe_layer(i)) for i in range(config.num_hidden_layers)],
                moe_router_pre_softmax=not config.norm_topk_prob and not deepseek, moe_router_dtype="fp32",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=dispatcher,
                expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                moe_enable_routing_replay=True,  # the hook planned_router's replay answers through
                moe_permute_fusion=False, moe_grouped_gemm=False)


def stage_layers(num_layers: int) -> range:
    """The (global) decoder layers this pipeline stage holds: an even split, stage ``p`` of ``P`` holding layers
    ``[p L/P, (p + 1) L/P)`` (Megatron's default split, no embedding accounted; ``L % P`` must be 0)."""
    from megatron.core import parallel_state

    pp, rank = (parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_rank())
    if num_layers % pp:
        raise ValueError(f"policy.training.megatron_cfg.pipeline_model_parallel_size={pp} must divide the model's "
                         f"{num_layers} layers")
    per = num_layers // pp
    return range(rank * per, (rank + 1) * per)


def _layer_specs(config: ModelConfig, recipe: Fp8Recipe, te: bool):
    """``TransformerBlockSubmodules``: one layer spec per layer of this pipeline stage, FP8 linears where the recipe
    says (the recipe's first / last high-precision layers counted over the whole model)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if te:  # TE handles FP8 (and the high-precision first/last layers) through the config
        if config.moe_layers:
            raise ValueError(f"{config.architecture}: a mixture-of-experts model on the Transformer Engine path (CUDA "
                             f"+ transformer_engine) is not mapped yet: TE's grouped experts keep their weights under "
                             f"other names than SequentialMLP's, which the HF conversion does not know; run it where "
                             f"transformer_engine is not installed (the local spec, fp8rl's FP8 linears)")
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_norm)
    mla = config.is_mla
    kw = dict(normalization="RMSNorm", qk_layernorm=config.qk_norm or mla, multi_latent_attention=mla)
    base = _latent_norms(get_gpt_layer_local_spec(**kw), mla)
    moe = None
    if config.moe_layers:
        moe = _latent_norms(get_gpt_layer_local_spec(num_experts=config.num_experts, moe_grouped_gemm=False, **kw), mla)
        moe.submodules.mlp.module = batch_major_moe_layer()
        moe.submodules.mlp.submodules.router = functools.partial(planned_router(), rule=RoutingRule.of(config))
        moe.submodules.mlp.submodules.experts.module = weights_after_experts()
        if not config.shared_expert_intermediate_size:
            moe.submodules.mlp.submodules.shared_experts = None
    column, row = fp8_parallel_linears()
    pow2 = dict(pow2_weight_scale=recipe.pow2_weight_scaling_factors,
                pow2_activation_scale=recipe.pow2_activation_scaling_factors, scaling=recipe.scaling)
    n = config.num_hidden_layers
    specs = []
    for i in stage_layers(n):
        spec = moe if config.is_moe_layer(i) else base
        if not recipe.layer_in_fp8(i, n):
            specs.append(spec)
            continue
        layer = copy.deepcopy(spec)  # each FP8 layer edits its own submodule specs
        attn, mlp = layer.submodules.self_attention.submodules, layer.submodules.mlp.submodules
        if mla:
            layer.submodules.self_attention.params["fp8"] = pow2
        else:
            attn.linear_qkv = ModuleSpec(module=column, params=dict(fused="qkv", model_config=config, **pow2))
        attn.linear_proj = ModuleSpec(module=row, params=pow2)
        fc1 = "gate_up"
        if config.is_moe_layer(i):  # every expert's linears FP8, each HF tensor its own blocks; the router stays FP32
            if mlp.shared_experts is not None:
                shared = mlp.shared_experts.submodules
                shared.linear_fc1 = ModuleSpec(module=column, params=dict(fused="shared_gate_up", model_config=config,
                                                                          **pow2))
                shared.linear_fc2 = ModuleSpec(module=row, params=pow2)
            mlp, fc1 = mlp.experts.submodules, "expert_gate_up"
        mlp.linear_fc1 = ModuleSpec(module=column, params=dict(fused=fc1, model_config=config, **pow2))
        mlp.linear_fc2 = ModuleSpec(module=row, params=pow2)
        specs.append(layer)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=WrappedTorchNorm)


def _latent_norms(spec, mla: bool):
    """``spec`` with, for multi-latent attention, :func:`latent_attention` and the latent norms at transformers'
    epsilon (:class:`LatentNorm`)."""
    if mla:
        attn = spec.submodules.self_attention
        attn.module = latent_attention()
        attn.submodules.core_attention = latent_core_attention()
        attn.submodules.q_layernorm = attn.submodules.kv_layernorm = LatentNorm
    return spec


class RowPositionRotary(nn.Module):
    """RoPE at per-row positions, in place of Megatron's ``RotaryEmbedding`` (positions ``0..S-1`` for all rows).

    Our model (and HF) place token ``t`` of a row at ``cumsum(attention_mask)[t] - 1`` (clamped at
    0): padded rows keep the positions of the unpadded sequence, and a pad token sits at the
    position of the last real one. Megatron's table cannot express that, and the pad tokens' hidden
    states *do* reach real numbers — in FP8 they share 1×128 scaling groups with real tokens in the
    wgrad GEMMs. So :class:`MegatronCausalLM` sets :attr:`position_ids` before each forward and this
    module returns the ``(S, B, 1, D)`` angle table Megatron's rotate-half RoPE broadcasts over heads.
    """

    def __init__(self, inv_freq: torch.Tensor, replaced: nn.Module) -> None:
        super().__init__()
        self.inv_freq = inv_freq  # FP32 (D/2,); a plain attribute so a dtype cast of the model cannot touch it
        self._replaced = [replaced]  # kept for get_rotary_seq_len; a list, so it is not a submodule
        self.position_ids: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self._replaced[0].get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        pos = self.position_ids
        if pos is None:
            raise RuntimeError("RowPositionRotary needs position_ids set by MegatronCausalLM.forward")
        if packed_seq or offset or pos.shape[1] != max_seq_len:
            raise ValueError(f"RowPositionRotary: unsupported call (seq {max_seq_len}, offset {offset}, "
                             f"packed {packed_seq}) for position_ids of shape {tuple(pos.shape)}")
        freqs = pos.float()[:, :, None] * self.inv_freq.to(pos.device)[None, None, :]  # (B, S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, S, D), rotate-half layout
        return emb.transpose(0, 1)[:, :, None, :]  # (S, B, 1, D)


def build_gpt_model(config: ModelConfig, recipe: Fp8Recipe, dtype: torch.dtype = torch.float32,
                    moe_token_dispatcher_type: str = "allgather"):
    """A Megatron ``GPTModel`` with the architecture of ``config`` (weights uninitialised: load them).

    Needs ``megatron.core.parallel_state`` initialised (the trainer does it) and, on CPU, the shims. With pipeline
    parallel, the GPTModel of this rank's stage: its layers (:func:`stage_layers`), the embedding on the first
    stage, the final norm and output layer on the last.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    te = use_te()
    gpt = GPTModel(
        transformer_config(config, recipe, dtype, te, moe_token_dispatcher_type), _layer_specs(config, recipe, te),
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(config.rope_theta), rotary_percent=1.0,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        parallel_output=False,  # whole-vocabulary logits on every tensor-parallel rank (a no-op at TP = 1)
    )
    # RoPE at per-row positions from our inverse frequencies (theta as a float, llama3 scaling if set); multi-latent
    # attention layers each own their RoPE (the GPTModel builds none): one shared module serves them all
    if config.is_mla:
        attns = [layer.self_attention for layer in gpt.decoder.layers]
        gpt.rotary_pos_emb = RowPositionRotary(rope_inv_freq(config), attns[0].rotary_pos_emb)
        for attn in attns:
            attn.rotary_pos_emb = gpt.rotary_pos_emb
    else:
        gpt.rotary_pos_emb = RowPositionRotary(rope_inv_freq(config), gpt.rotary_pos_emb)
    gpt.fused_norms = te
    for i, router in enumerate(m for m in gpt.modules() if getattr(m, "takes_routing_plan", False)):
        router.moe_index = i  # a route's layer axis: the model's MoE layers in order
    held = stage_layers(config.num_hidden_layers)
    if [layer.layer_number - 1 for layer in gpt.decoder.layers] != list(held):  # Megatron's own offset agrees
        raise RuntimeError(f"Megatron built layers {[layer.layer_number - 1 for layer in gpt.decoder.layers]} on "
                           f"this pipeline stage, expected {list(held)}")
    return gpt


class MegatronCausalLM(nn.Module):
    """A GPTModel behind the :class:`~fp8rl.model.CausalLM` call used by the GRPO step.

    Padding semantics are CausalLM's: causal + key-padding mask, RoPE positions ``cumsum(mask) - 1``
    (see :class:`RowPositionRotary`), so every token — pad tokens included — gets the hidden states
    the torch backend gives it.
    """

    def __init__(self, gpt: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, T, V)`` FP32 logits of ``input_ids`` ``(B, T)``; ``attention_mask`` ``(B, T)`` 1 keep / 0 pad.

        On a pipeline stage other than the last, this stage's output activations ``(T, B, H)`` instead (the next
        stage's input); on one other than the first, the input activations are the ones the GPTModel's
        ``set_input_tensor`` gave (``input_ids`` then only sets the shapes, positions and mask)."""
        B, T = input_ids.shape
        device = input_ids.device
        visible = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None].expand(B, 1, T, T)
        if attention_mask is not None:  # same semantics as CausalLM: key padding on top of causal
            visible = visible & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
        else:
            position_ids = torch.arange(T, device=device).expand(B, T)  # (B, T)
        rotary = self.gpt.rotary_pos_emb
        rotary.position_ids = position_ids
        try:
            # Megatron's mask is True where attention is *blocked*; always explicit (its default is built on CUDA)
            out = self.gpt(input_ids, position_ids, ~visible)  # (B, T, V) logits on the last stage
        finally:
            rotary.position_ids = None
        return out.float() if self.gpt.post_process else out

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The GPTModel's weights under Megatron names (no ``gpt.`` prefix, no ``_extra_state``)."""
        return {k: v for k, v in self.gpt.state_dict(*args, **kwargs).items() if not k.endswith("_extra_state")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load Megatron-named weights (as :meth:`state_dict` returns them); every weight must be given."""
        missing, unexpected = self.gpt.load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if strict and (missing or unexpected):
            raise ValueError(f"Megatron state dict: missing {missing[:3]} ({len(missing)}), "
                             f"unexpected {unexpected[:3]} ({len(unexpected)})")
        return missing, unexpected
