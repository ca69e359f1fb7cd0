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
(:meth:`KVCache.for_model`): ``r + p`` numbers per token and layer instead of ``H·(dq + dv)``. Each forward
expands the cached latents through ``kv_b_proj`` (the naive form, not the weight-absorbed one): every row's expansion
is a row of one GEMM, so under batch invariance (the projection's row tiles) a decode step's keys and values are
bitwise those of the trainer's full forward.

**FP8 KV for MLA** (``kv_cache_dtype: fp8``): the layer's :class:`~fp8rl.fp8.kv.QKVQuantizer` keeps its three
per-tensor FP32 scales, recalibrated after every step and shipped with each version, but for MLA they mean
*what the cache stores*: ``q_scale`` the query ``[q_nope, q_pe]`` (post-RoPE; FP8 attention rounds it to E4M3),
``k_scale`` the normalized latent ``c`` and ``v_scale`` the rotated ``k_pe``; the calibrator reads the three at
``qkv_point`` (amax over heads and width, per real token). The cache holds ``c`` and ``k_pe`` in E4M3 (``r + p``
bytes per token and layer); each forward dequantizes them and expands ``c`` through ``kv_b_proj`` (an FP8 linear in
an FP8 recipe, which quantizes its input 1×128 again); FP8 attention also rounds the softmax probabilities to E4M3.
Without a cache (the trainer's passes) the same quantize → dequantize runs, so both sides see the same latents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl.fp8.kv import QKVQuantizer

from .config import ModelConfig
from .invariant import KeyLayout, split_kv_attention
from .kv_cache import KVCache
from .layers import QKVPoint, RMSNorm, apply_rope, apply_rope_interleaved

__all__ = ["MLAttention"]

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
        kv = self.kv_b_proj(latent[:, 0]).view(B, S, H, n + dv).transpose(1, 2)  # (B, H, S, n + dv)
        k_nope, v = kv.split([n, dv], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, H, S, p)], dim=-1)  # (B, H, S, dq)
        round_probs = quant.round_probs if quant is not None else None
        if layout is not None:
            out = split_kv_attention(q, k, v, layout, round_probs)  # (B, H, T, dv)
        else:
            scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * ((n + p) ** -0.5)  # (B, H, T, S)
            probs = F.softmax(scores + mask, dim=-1)
            if round_probs is not None:
                probs = round_probs(probs)
            out = torch.matmul(probs, v.float())
        return self.o_proj(out.to(dtype).transpose(1, 2).reshape(B, T, H * dv))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_lora_rank={self.rank}, q_lora_rank={self.q_rank}, "
                f"nope={self.nope}, rope={self.rope}, v={self.v_dim}, interleave={self.interleave}")
