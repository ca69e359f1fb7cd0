"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Moonlight), with transformers' ``DeepseekV3Attention`` names.

Shapes: C hidden, H heads, ``r`` = ``kv_lora_rank``, ``n`` = ``qk_nope_head_dim``, ``p`` = ``qk_rope_head_dim``,
``dv`` = ``v_head_dim``, ``dq = n + p``.

* queries: ``q_proj`` ``(H·dq, C)``, or with ``q_lora_rank`` the low-rank ``q_b_proj(q_a_layernorm(q_a_proj(x)))``;
  split per head into ``n`` position-free and ``p`` rotary dims;
* keys and values come from one latent per token: ``kv_a_proj_with_mqa`` ``(r + p, C)`` gives the latent
  ``c = kv_a_layernorm(first r)`` and one rotary key ``k_pe`` (last ``p``) shared by every head; ``kv_b_proj``
  ``(H·(n + dv), r)`` expands ``c`` into each head's ``k_nope`` and value;
* a head's key is ``[k_nope, k_pe]`` and its query ``[q_nope, q_pe]`` (RoPE on the ``p`` dims only: DeepSeek's
  interleaved pairs with ``rope_interleave``, else rotate-half); scores scaled by ``dq ** -0.5``.

**The KV cache stores what MLA compresses**: per token the normalized latent ``c`` (``r``) and the rotated ``k_pe``
(``p``) — in a :class:`~fp8rl.model.KVCache` of one "head", the latent in the K slot and ``k_pe`` in the V slot
(:meth:`KVCache.for_model`): ``r + p`` numbers per token and layer instead of ``H·(dq + dv)``.

**Absorbed attention** (the default, :attr:`MLAttention.absorb`; DeepSeek's inference form): with
``W_UK`` ``(n, r)`` and ``W_UV`` ``(dv, r)`` a head's rows of ``kv_b_proj``, ``q_nope · (W_UK c) = (W_UKᵀ q_nope) · c``
and ``Σ_s P_s W_UV c_s = W_UV Σ_s P_s c_s``. So each head's query is absorbed into the latent space, ``[W_UKᵀ
q_nope, q_pe]`` (``r + p``), attention runs as multi-query attention over the cache as it is — key ``[c, k_pe]``,
value ``c``, one "head" for all — with the scale ``dq ** -0.5``, and each head's latent output goes through
``W_UV``. Nothing is expanded per cached token: a decode step costs ``O(S·H·(2r + p))`` instead of the expansion's
``O(S·r·H·(n + dv))``. Every pass computes this form — the rollout's prefill and decode steps and the trainer's
passes alike — so under batch invariance (the per-head products over the projection's row tiles, split-KV
attention) a decode step's logprobs are bitwise the trainer's. ``W_UK`` / ``W_UV`` are ``kv_b_proj``'s weight as
its forward multiplies it (:func:`fp8rl.fp8.linear.weight_as_computed`: in an FP8 recipe the dequantization of
its E4M3 form, the trainer's gradient straight through to the master). The products are FP32; the latent is not
rounded to E4M3 as the FP8 linear's 1×128 input — the one difference from the expanded form beyond FP32 operation
order (``tests/unit/model/test_deepseek.py`` bounds it). A ``kv_b_proj`` with a LoRA adapter computes the
expanded form (its update is a separate, dropout-carrying product); ``absorb = False`` (:meth:`set_absorbed` on a
model) computes it everywhere: ``kv_b_proj`` expands the cached latents in each forward, every row's expansion a
row of one GEMM (bitwise the trainer's under invariance too).

**FP8 KV for MLA** (``kv_cache_dtype: fp8``): the layer's :class:`~fp8rl.fp8.kv.QKVQuantizer` keeps its three
per-tensor FP32 scales, recalibrated after every step and shipped with each version, but for MLA they mean
*what the cache stores*: ``q_scale`` the query ``[q_nope, q_pe]`` (post-RoPE; FP8 attention rounds it to E4M3),
``k_scale`` the normalized latent ``c`` and ``v_scale`` the rotated ``k_pe``
(absorbed: the query is the absorbed one, ``[W_UKᵀ q_nope, q_pe]``); the calibrator reads the three at
``qkv_point`` (amax over heads and width, per real token). The cache holds ``c`` and ``k_pe`` in E4M3 (``r + p``
bytes per token and layer); each forward dequantizes them and attends over them (absorbed) or expands ``c``
through ``kv_b_proj`` (an FP8 linear in an FP8 recipe, which quantizes its input 1×128 again); FP8 attention also
rounds the softmax probabilities to E4M3.
Without a cache (the trainer's passes) the same quantize → dequantize runs, so both sides see the same latents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl.fp8.kv import QKVQuantizer
from fp8rl.fp8.linear import tiled_mm, weight_as_computed

from .config import ModelConfig
from .invariant import KeyLayout, split_kv_attention
from .kv_cache import KVCache
from .layers import QKVPoint, RMSNorm, apply_rope, apply_rope_interleaved

__all__ = ["MLAttention", "set_absorbed"]

# transformers' DeepseekV3RMSNorm default (q_a_layernorm and kv_a_layernorm are built without the config's eps)
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """``self_attn`` of a ``deepseek_v3`` layer (module docstring); the forward of :class:`~.transformer.Attention`.

    Attributes:
        kv_quant: None (the latent cache in the compute dtype), or a :class:`QKVQuantizer` whose scales are the
            query's, the latent's and the rotary key's (module docstring).
    """

    takes_prefix = False  # a shared prefix's K/V (fp8rl.model.shared_prefix) is not mapped onto the latent cache

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank, self.q_rank = config.kv_lora_rank, config.q_lora_rank
        self.interleave = config.rope_interleave
        dq, bias, hidden = self.nope + self.rope, bool(config.attention_bias), config.hidden_size
        if self.q_rank is None:
            self.q_proj = nn.Linear(hidden, H * dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_rank, H * dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, hidden, bias=bias)
        self.qkv_point = QKVPoint()  # (query, latent, rotary key): what the FP8 scales are calibrated on
        self.kv_quant: QKVQuantizer | None = None
        self.absorb = True  # attention in the latent space (module docstring)
        self.row_tile: int | None = None  # batch-invariant numerics (CausalLM.set_batch_invariance)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        kv_cache: KVCache | None = None,
        layout: KeyLayout | None = None,
        prefix=None,
    ) -> torch.Tensor:
        """As :meth:`fp8rl.model.transformer.Attention.forward`; the cache holds latents (module docstring). No
        shared prefix (``prefix`` must be None)."""
        if prefix is not None:
            raise ValueError("multi-head latent attention takes no shared prefix")
        B, T, _ = x.shape
        H, n, p, dv = self.num_heads, self.nope, self.rope, self.v_dim
        dtype = x.dtype
        q = self.q_proj(x) if self.q_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, n + p).transpose(1, 2)  # (B, H, T, dq)
        q_nope, q_pe = q.split([n, p], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, p], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # (B, 1, T, r)
        k_pe = k_pe[:, None]  # (B, 1, T, p)
        rope = apply_rope_interleaved if self.interleave else apply_rope
        w = weight_as_computed(self.kv_b_proj) if self.absorb else None  # (H·(n + dv), r) FP32, or expanded
        if w is not None:
            w = w.view(H, n + dv, self.rank)
            q = torch.cat([self._per_head(q_nope, w[:, :n].transpose(1, 2)), rope(q_pe, cos, sin).float()], dim=-1)
        else:
            q = torch.cat([q_nope, rope(q_pe, cos, sin)], dim=-1)  # (B, H, T, dq)
        q, latent, k_pe = self.qkv_point(q, latent, rope(k_pe, cos, sin))
        quant = self.kv_quant
        if quant is not None:
            q = quant.fake_quantize_q(q)
        if kv_cache is not None:  # the compressed form is what is stored; every slot so far comes back
            c_st, pe_st = quant.quantize_kv(latent, k_pe) if quant is not None else (latent, k_pe)
            reach = layout.index.shape[1] if layout is not None else 0
            c_st, pe_st = kv_cache.store(self.layer_idx, c_st, pe_st, fp8=quant is not None, reach=reach)
            if quant is not None:
                latent, k_pe = kv_cache.read_dequantized(self.layer_idx, c_st.shape[2], quant.dequantize_kv, dtype)
            else:
                latent, k_pe = c_st.to(dtype), pe_st.to(dtype)
        elif quant is not None:  # the trainer's passes: the numbers a cache round trip gives
            latent, k_pe = quant.fake_quantize_kv(latent, k_pe, dtype)
        S = latent.shape[2]
        if w is not None:  # multi-query attention over the latents: key [c, k_pe], value c
            k, v = torch.cat([latent.float(), k_pe.float()], dim=-1), latent
        else:
            kv = self.kv_b_proj(latent[:, 0]).view(B, S, H, n + dv).transpose(1, 2)  # (B, H, S, n + dv)
            k_nope, v = kv.split([n, dv], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(B, H, S, p)], dim=-1)  # (B, H, S, dq)
        round_probs = quant.round_probs if quant is not None else None
        scale = (n + p) ** -0.5
        if layout is not None:
            out = split_kv_attention(q, k, v, layout, round_probs, scale)  # (B, H, T, dv or r)
        else:  # one key "head" (absorbed): the heads' queries are rows of one product, no key copied per head
            Hk = k.shape[1]
            scores = torch.matmul(q.float().reshape(B, Hk, -1, q.shape[-1]), k.float().transpose(-1, -2))
            probs = F.softmax(scores.view(B, H, T, S) * scale + mask, dim=-1)  # (B, H, T, S)
            if round_probs is not None:
                probs = round_probs(probs)
            out = torch.matmul(probs.reshape(B, Hk, -1, S), v.float()).view(B, H, T, -1)
        if w is not None:
            out = self._per_head(out, w[:, n:])  # each head's latent output through its W_UV: (B, H, T, dv)
        return self.o_proj(out.to(dtype).transpose(1, 2).reshape(B, T, H * dv))

    def _per_head(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x[:, h] @ w[h].T`` for every head ``h``: ``x`` ``(B, H, T, a)``, ``w`` ``(H, b, a)`` → ``(B, H, T, b)``
        FP32. Under batch invariance each head's product runs over whole row tiles (:func:`tiled_mm`), so a row's
        numbers do not depend on how many rows the pass has."""
        B, H, T, a = x.shape
        x = x.float()
        if self.row_tile is None:
            return torch.matmul(x, w.transpose(1, 2))
        rows = x.transpose(0, 1).reshape(H, B * T, a)
        out = torch.stack([tiled_mm(rows[h], w[h].t(), self.row_tile) for h in range(H)])  # (H, B·T, b)
        return out.view(H, B, T, -1).transpose(0, 1)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_lora_rank={self.rank}, q_lora_rank={self.q_rank}, "
                f"nope={self.nope}, rope={self.rope}, v={self.v_dim}, interleave={self.interleave}, "
                f"absorb={self.absorb}")


def set_absorbed(model: nn.Module, on: bool) -> int:
    """Set every MLA layer of ``model`` to the absorbed (``on``) or the expanded form (module docstring); both sides
    of a comparison must compute the same one. Returns how many layers it set."""
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    for m in layers:
        m.absorb = on
    return len(layers)
