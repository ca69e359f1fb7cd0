"""The small layers every decoder block uses: RMSNorm, rotary position embeddings (both of HF's conventions) and the
calibration point of attention."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig

__all__ = ["QKVPoint", "RMSNorm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "apply_rope_interleaved"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)``; the statistics in FP32, the product in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # cast back *before* the weight multiply, as HF does, so BF16 numbers match theirs
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


# ---------------------------------------------------------------------------------------------
# RoPE (rotate-half convention of HF Llama: dims [0, D/2) pair with [D/2, D))
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """FP32 inverse frequencies ``(D/2,)``, with the llama3 long-context adjustment when configured.

    llama3 scaling (Llama 3.1): wavelengths shorter than ``original / high_freq_factor`` keep
    their frequency, longer than ``original / low_freq_factor`` are divided by ``factor``, and
    the band between blends the two linearly in ``original / wavelength``.
    """
    d = config.head_dim
    # explicit CPU: the model may be built under torch.device("meta"), and these must be real
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    inv = 1.0 / (config.rope_theta**exponents)
    rs = config.rope_scaling
    if rs is None:
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
    scaled = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)  # 0 at the low-frequency edge, 1 at the high one
    blended = (1 - smooth) * inv / factor + smooth * inv
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``(B, T, D)`` for ``position_ids`` ``(B, T)``; angles in FP32, tables in ``dtype``."""
    freqs = position_ids.float()[:, :, None] * inv_freq[None, None, :]  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, H, T, D)`` by the tables ``(B, T, D)``."""
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D): broadcast over heads
    return x * cos + _rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE (``rope_interleave``): the pairs are ``(x0, x1), (x2, x3), ...``, each rotated by
    one frequency, and the result is laid out de-interleaved (evens' rotation first, then the odds'), as
    transformers' ``apply_rotary_pos_emb_interleave`` writes it. ``x`` ``(B, H, T, D)``, tables ``(B, T, D)`` (the
    usual ``cat(freqs, freqs)``: the first half holds each pair's angle)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]  # (B, 1, T, D/2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)



class QKVPoint(nn.Module):
    """Identity on ``(q, k, v)``; a named spot where calibration hooks read the tensors an FP8 KV cache is scaled for:
    post-RoPE Q/K/V of standard attention, and for multi-head latent attention the query, the latent and the rotary
    key (:mod:`fp8rl.model.mla`)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return q, k, v
