"""The pre-norm decoder most families share: ``x + attn(norm(x))`` then ``+ mlp(norm(.))``, an unscaled embedding,
one RoPE table, SwiGLU MLPs, RMSNorm ``w * x̂`` — the composition Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3
differ from only in switches (biases, QK-norm, experts, latent attention), each set by its family module."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig, rope_from_hf
from ..family import Family, family_names, get_family
from ..layers import RMSNorm, rope_inv_freq
from ..mla import MLAttention
from ..moe import SparseMoeBlock
from ..transformer import MLP, Attention, DecoderLayer

__all__ = ["StandardFamily", "check_no_experts", "check_experts"]


def check_no_experts(config: ModelConfig) -> None:
    """A dense family refuses experts."""
    if config.num_experts:
        moe = [n for n in family_names() if getattr(get_family(n), "experts", False)]
        raise ValueError(f"num_experts={config.num_experts} on architecture {config.architecture!r}: only "
                         f"{'/'.join(moe)} have experts")


def check_experts(config: ModelConfig) -> None:
    """The settings every mixture-of-experts family needs: positive counts, top-k within the experts, valid
    dense-layer indices, a finite non-negative aux-loss weight."""
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        val = getattr(config, name)
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"ModelConfig.{name} must be a positive int for {config.architecture}, got {val!r}")
    if config.num_experts_per_tok > config.num_experts:
        raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} exceeds num_experts={config.num_experts}")
    bad = [i for i in config.mlp_only_layers if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise ValueError(f"mlp_only_layers {bad} are not layers of a {config.num_hidden_layers}-layer model")
    if not (math.isfinite(config.router_aux_loss_coef) and config.router_aux_loss_coef >= 0):
        raise ValueError(f"router_aux_loss_coef must be finite and >= 0, got {config.router_aux_loss_coef}")


class StandardFamily(Family):
    """The shared pre-norm decoder (module docstring). Subclasses set ``qk_norm`` and override the config.json
    keys, checks and the MLP of a layer where they differ."""

    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (q_norm / k_norm)
    experts: bool = False  # mixture-of-experts layers (where is_moe_layer says)

    def from_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act='silu' (SwiGLU) is supported, got {d['hidden_act']!r}")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if d.get("use_sliding_window"):
            raise ValueError(f"{self.name} with use_sliding_window=True is not supported (full attention only)")
        theta, scaling = rope_from_hf(d)
        return dict(rope_theta=theta, rope_scaling=scaling, qk_norm=self.qk_norm)

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        d["attention_bias"] = bool(config.attention_bias)
        if self.qk_norm:
            d["use_sliding_window"] = False

    def check(self, config: ModelConfig) -> None:
        if config.attention_bias is None:
            config.attention_bias = False
        if config.qk_norm is None:
            config.qk_norm = self.qk_norm
        if config.qk_norm != self.qk_norm:
            having = [n for n in family_names() if getattr(get_family(n), "qk_norm", False)]
            raise ValueError(f"qk_norm={config.qk_norm} contradicts architecture {config.architecture!r} (only "
                             f"{'/'.join(having)} have q_norm/k_norm)")
        (check_experts if self.experts else check_no_experts)(config)

    def build_embedding(self, config: ModelConfig) -> nn.Embedding:
        return nn.Embedding(config.vocab_size, config.hidden_size)

    def build_attention(self, config: ModelConfig, i: int) -> nn.Module:
        return MLAttention(config, i) if self.latent_attention else Attention(config, i)

    def build_mlp(self, config: ModelConfig, i: int) -> nn.Module:
        return SparseMoeBlock(config) if self.is_moe_layer(config, i) else MLP(config)

    def build_layer(self, config: ModelConfig, i: int) -> nn.Module:
        return DecoderLayer(config, self.build_attention(config, i), self.build_mlp(config, i))

    def build_final_norm(self, config: ModelConfig) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rope_inv_freqs(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        return {"default": rope_inv_freq(config)}
