"""The mixture-of-experts MLP block: router → dispatch → grouped expert GEMMs → combine.

Layout and names (Qwen3-MoE; the next families are switches here, not copies):

* ``mlp.gate`` — the :class:`~fp8rl.model.router.TopKRouter` (FP32, never quantized);
* ``mlp.experts.{e}.{gate,up,down}_proj`` — each expert a SwiGLU :class:`ExpertMLP` of ``nn.Linear``\\ s,
  so the state-dict names are HF's **on-disk** per-expert names (what transformers saves, what vLLM's
  expert loader reads, what Megatron's ``SequentialMLP`` maps to). transformers 5 fuses them in memory
  (``experts.gate_up_proj`` ``(E, 2F, C)``); fp8rl keeps them apart on purpose: every per-linear path —
  FP8 conversion (each expert gets its own 128×128 weight blocks), refit payloads and deltas, checkpoints,
  the observatory's per-linear switches — works on experts unchanged, and the fused form is read by the
  checkpoint loader (:mod:`fp8rl.model.hf_io`) and never needed at run time.

Compute (shapes: C hidden, F expert width, E experts, K top-k, N tokens, R = N·K routed rows):

1. **dispatch** — the router's ``(N, K)`` ids flattened token-major and stably sorted by expert: each
   expert's rows are contiguous and in token order;
2. **experts** — grouped (:mod:`fp8rl.model.grouped`): each of the three linears is one grouped GEMM over every
   expert's contiguous rows with the experts' weights stacked, the expert counts a tensor (no host sync, no Python
   loop over experts in the compute); FP8 experts quantize the layer's routed rows once
   (:mod:`fp8rl.fp8.grouped`), their wgrad scale groups never straddling two experts. Where the experts cannot
   group — LoRA-wrapped, tensorwise FP8 (one scale per expert), hooked, or mixed linears — the reference path
   runs: one call of each expert's MLP on its rows (``.tolist()`` of the counts), with the same numbers;
3. **combine** — each token sums its ``K`` expert outputs times their FP32 routing weights in **slot
   order** (not by atomics or an expert-order ``index_add_``), in FP32, then casts back.

Batch invariance: with :mod:`fp8rl.model.invariant` on, every expert GEMM runs over whole row tiles (each grouped
expert's rows padded to whole tiles) and the router's logits too, and the combine is per token in a fixed order, so a
token's output does not depend on which (or how many) other tokens share its experts — rollout and trainer route and
compute it bitwise alike, grouped or not.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fp8rl.fp8 import grouped as fp8_grouped
from fp8rl.fp8.linear import Fp8InferenceLinear, Fp8Linear
from fp8rl.fp8.quant import BLOCK

from .config import ModelConfig
from .grouped import StackedWeights, group_layout, grouped_linear, wgrad_layout
from .invariant import TiledLinear
from .router import RoutingRule, TopKRouter
from .swiglu import swiglu

__all__ = ["ExpertMLP", "SparseMoeBlock"]


class ExpertMLP(nn.Module):
    """One expert (or a dense layer's MLP): SwiGLU ``down(silu(gate(x)) * up(x))`` of width ``intermediate_size``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))  # silu(g) recomputed in the backward


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP (module docstring): ``(B, T, C)`` -> ``(B, T, C)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.gate = TopKRouter(config.hidden_size, config.num_experts, RoutingRule.of(config))
        self.experts = nn.ModuleList(ExpertMLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        # DeepSeek: shared experts (one SwiGLU of n_shared_experts x the expert width) added to every token
        shared = config.shared_expert_intermediate_size
        self.shared_experts = ExpertMLP(config.hidden_size, shared) if shared else None
        self._stacks: dict[str, StackedWeights] = {}  # the no-gradient passes' stacked expert weights, per linear
        self.grouped = True  # False: always the per-expert reference loop (tests and benchmarks compare the two)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x2d = x.reshape(-1, C)  # (N, C)
        ids, weights = self.gate(x2d)  # (N, K) int64, (N, K) FP32
        K = ids.shape[1]
        flat = ids.reshape(-1)  # (R,) token-major: token n's slot k at n*K + k
        order = torch.argsort(flat, stable=True)  # (R,) rows grouped by expert, token order inside a group
        rows = x2d[order // K]  # (R, C) each routed row's token
        kind = self.grouping()
        routed = self._grouped(rows, flat[order], kind) if kind else self._per_expert(rows, flat)  # (R, C)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        y = routed[back].view(-1, K, C).float()  # (N, K, C) slot order again
        out = y[:, 0] * weights[:, :1]
        for k in range(1, K):  # slot order, FP32: the same sum for a token whatever else is in the batch
            out = out + y[:, k] * weights[:, k:k + 1]
        out = out.to(x.dtype).view(B, T, C)
        if self.shared_experts is not None:  # transformers' order: the routed sum, then + the shared experts
            out = out + self.shared_experts(x)
        return out

    def grouping(self) -> str | None:
        """How the experts compute: ``"dense"`` (plain or tiled ``nn.Linear``\\ s: bf16 / FP32), ``"fp8"`` (FP8
        linears of a grouped format, :func:`fp8rl.fp8.grouped.groups`), or None — the per-expert reference loop (LoRA
        wrappers, tensorwise FP8, mixed or hooked linears) and off the CPU: CUDA's ``grouped_mm`` takes BF16 on sm90
        only and no device has checked it here yet (the GPU tier's to add)."""
        linears = [lin for e in self.experts for lin in (e.gate_proj, e.up_proj, e.down_proj)]
        if not self.grouped or any(m._forward_hooks or m._forward_pre_hooks for m in linears):
            return None
        if linears[0].weight.device.type != "cpu":
            return None
        if all(type(m) in (nn.Linear, TiledLinear) and m.bias is None for m in linears):
            tiles = {getattr(m, "row_tile", None) for m in linears}
            return "dense" if len(tiles) == 1 else None
        if fp8_grouped.groups(linears):
            return "fp8" if len({m.row_tile for m in linears}) == 1 else None
        return None

    def _per_expert(self, rows: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """The reference: each expert's MLP on its rows (the counts read on the host), in expert order."""
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.experts[e](rows[start:start + n]))  # this expert's tokens, one GEMM per linear
            start += n
        routed = torch.cat(outs) if outs else rows.new_zeros(0, rows.shape[1])  # (R, C) expert order
        unused = [e for e, n in enumerate(counts) if not n]
        if unused and torch.is_grad_enabled():
            # Data-parallel trainers reduce every parameter's gradient: an expert no token of this rank chose must
            # still get one (exactly 0), or the ranks' gradient collectives would differ in size (FSDP2, DDP).
            touch = sum(p.reshape(-1)[:1].sum() for e in unused for p in self.experts[e].parameters())
            routed = routed + 0.0 * touch
        return routed

    def _grouped(self, rows: torch.Tensor, experts_sorted: torch.Tensor, kind: str) -> torch.Tensor:
        """Every expert's rows through the three linears as grouped GEMMs (:mod:`fp8rl.model.grouped`)."""
        first = self.experts[0].gate_proj
        tile = getattr(first, "row_tile", None)
        layout = group_layout(experts_sorted, self.num_experts, tile or 1)
        wgrad = None
        if kind == "fp8" and isinstance(first, Fp8Linear):  # trainable: wgrad's 128-row layout
            wgrad = wgrad_layout(layout, experts_sorted, self.num_experts, BLOCK)
        buf = layout.scatter(rows)  # (P, C)
        gate = self._linear(buf, layout.offs, "gate_proj", kind, tile, wgrad)
        up = self._linear(buf, layout.offs, "up_proj", kind, tile, wgrad)
        return layout.gather(self._linear(swiglu(gate, up), layout.offs, "down_proj", kind, tile, wgrad))

    def _linear(self, buf: torch.Tensor, offs: torch.Tensor, name: str, kind: str, tile: int | None,
                wgrad) -> torch.Tensor:
        linears = [getattr(e, name) for e in self.experts]
        if kind == "fp8":
            stack = None
            if not torch.is_grad_enabled() and not self.training and \
                    isinstance(linears[0], Fp8InferenceLinear):
                stack = self._stack(name).get([fp8_grouped.inference_weight(m) for m in linears])
            trains = isinstance(linears[0], Fp8Linear)
            return fp8_grouped.fp8_grouped_linear(buf, offs, linears, invariant=tile is not None, stack=stack,
                                                  wgrad=wgrad, stacks=self._stack(name) if trains else None)
        weights = [m.weight for m in linears]
        # an engine that only generates (eval mode: the rollout, a reference model) keeps the stack per version; the
        # trainer's passes stack per call (no second copy of its experts between steps)
        keep = not torch.is_grad_enabled() and not self.training
        return grouped_linear(buf, self._stack(name).get(weights) if keep else weights, offs)

    def _stack(self, name: str) -> StackedWeights:
        """Where linear ``name``'s stacked expert weights are kept per version."""
        return self._stacks.setdefault(name, StackedWeights())

    def drop_stacks(self) -> None:
        """Release the stacked weights (a shared rollout engine's memory between its generations)."""
        self._stacks.clear()

    def __deepcopy__(self, memo):  # a copy starts without stacks: its weights are other tensors
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = {} if k == "_stacks" else copy.deepcopy(v, memo)
        return new

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}"
