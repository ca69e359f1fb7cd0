"""The mixture-of-experts MLP block: router → dispatch → one GEMM group per expert → combine.

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
2. **experts** — one call of each expert's MLP on its contiguous rows (one GEMM per linear per expert,
   never a loop over tokens). An FP8 expert quantizes its own rows 1×128 — its wgrad's column-wise groups
   run over its own tokens only, so no scale group straddles two experts;
3. **combine** — each token sums its ``K`` expert outputs times their FP32 routing weights in **slot
   order** (not by atomics or an expert-order ``index_add_``), in FP32, then casts back.

Batch invariance: with :mod:`fp8rl.model.invariant` on, every expert GEMM runs over whole row tiles and the
router's logits too, and the combine is per token in a fixed order, so a token's output does not depend on
which (or how many) other tokens share its experts — rollout and trainer route and compute it bitwise alike.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x2d = x.reshape(-1, C)  # (N, C)
        ids, weights = self.gate(x2d)  # (N, K) int64, (N, K) FP32
        K = ids.shape[1]
        flat = ids.reshape(-1)  # (R,) token-major: token n's slot k at n*K + k
        order = torch.argsort(flat, stable=True)  # (R,) rows grouped by expert, token order inside a group
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x2d[order // K]  # (R, C) each routed row's token
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.experts[e](rows[start:start + n]))  # this expert's tokens, one GEMM per linear
            start += n
        routed = torch.cat(outs) if outs else rows.new_zeros(0, C)  # (R, C) expert order
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        y = routed[back].view(-1, K, C).float()  # (N, K, C) slot order again
        out = y[:, 0] * weights[:, :1]
        for k in range(1, K):  # slot order, FP32: the same sum for a token whatever else is in the batch
            out = out + y[:, k] * weights[:, k:k + 1]
        unused = [e for e, n in enumerate(counts) if not n]
        if unused and torch.is_grad_enabled():
            # Data-parallel trainers reduce every parameter's gradient: an expert no token of this rank chose must
            # still get one (exactly 0), or the ranks' gradient collectives would differ in size (FSDP2, DDP).
            touch = sum(p.reshape(-1)[:1].sum() for e in unused for p in self.experts[e].parameters())
            out = out + 0.0 * touch
        out = out.to(x.dtype).view(B, T, C)
        if self.shared_experts is not None:  # transformers' order: the routed sum, then + the shared experts
            out = out + self.shared_experts(x)
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}"
