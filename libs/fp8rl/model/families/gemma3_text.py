"""Gemma 3, text (``Gemma3ForCausalLM``, ``model_type: gemma3_text``).

What it brings that the shared pre-norm decoder lacks, each a component it composes:

* interleaved sliding-window and global attention (``layer_types``: ``sliding_attention`` /
  ``full_attention``; ``sliding_window`` keys) — :mod:`fp8rl.model.sliding_window`, the window in the masks of
  the KV-cached decode and the trainer's full forward alike;
* a RoPE base per attention type (``rope_parameters`` keyed by layer type; transformers 4's ``rope_theta`` and
  ``rope_local_base_freq``), linear scaling allowed on the global layers (Gemma 3 4B+);
* scores scaled by ``query_pre_attn_scalar ** -0.5``; QK-norm;
* RMSNorm with a ``(1 + weight)`` gain — :mod:`fp8rl.model.offset_norm`; norms before and after both attention
  and MLP — :mod:`fp8rl.model.sandwich`;
* embeddings scaled by ``sqrt(hidden_size)`` — :mod:`fp8rl.model.scaled_embedding`; GeGLU
  (``gelu_pytorch_tanh``) — :mod:`fp8rl.model.geglu`; tied embeddings by default.

Refused, named: logit soft-capping (Gemma 2's; ``null`` in Gemma 3), bidirectional attention, RoPE types other
than default / linear, another activation. vLLM and Megatron-Core do not run it here (their refit and layer specs
are not mapped): the torch engines do, FP8 and batch-invariant like every family.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..family import Family, register
from ..geglu import GeGLUMLP
from ..layers import rope_inv_freq
from ..offset_norm import OffsetRMSNorm
from ..sandwich import SandwichLayer
from ..scaled_embedding import ScaledEmbedding
from ..sliding_window import SlidingWindowAttention

SLIDING, FULL = "sliding_attention", "full_attention"
_PATTERN = 6  # transformers' default sliding_window_pattern: every 6th layer global


@dataclass
class Gemma3TextConfig(ModelConfig):
    """:class:`ModelConfig` with Gemma 3's own settings (HF's names).

    Attributes:
        sliding_window: keys a sliding layer's query sees, itself included (None: all).
        layer_types: ``"sliding_attention"`` or ``"full_attention"`` per layer (None: every 6th global).
        query_pre_attn_scalar: the scores are scaled by its inverse square root.
        rope_local_base_freq: the RoPE base of the sliding layers (``rope_theta`` is the global layers').
        rope_linear_factor: linear RoPE scaling of the global layers (1: none).
    """

    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] | list[str] | None = None
    query_pre_attn_scalar: int | float = 256  # an int in transformers' config (its strict check)
    rope_local_base_freq: float = 10000.0
    rope_linear_factor: float = 1.0


class Gemma3Text(Family):
    name, hf_class, max_position_default = "gemma3_text", "Gemma3ForCausalLM", 131072
    config_class = Gemma3TextConfig
    refusals = {"vllm": "fp8rl's refit into vLLM's Gemma 3 model is not mapped; use policy.generation.backend: torch",
                "megatron": "Gemma 3's layer spec (sandwich norms, (1 + w) RMSNorm, sliding windows) is not mapped to "
                            "Megatron-Core; use policy.training.backend: torch"}

    # -- config.json --------------------------------------------------------------------------------------------

    def from_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        act = d.get("hidden_activation", d.get("hidden_act")) or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"gemma3_text hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if d.get(key) is not None:
                raise ValueError(f"gemma3_text {key}={d[key]} is not supported (logit soft-capping: null only)")
        if d.get("use_bidirectional_attention"):
            raise ValueError("gemma3_text use_bidirectional_attention=true is not supported (causal only)")
        theta, local, factor = _rope_from_hf(d)
        layers = d["num_hidden_layers"]
        types = d.get("layer_types") or _default_types(layers, d.get("sliding_window_pattern", _PATTERN))
        return dict(rope_theta=theta, rope_local_base_freq=local, rope_linear_factor=factor,
                    sliding_window=d.get("sliding_window", 4096), layer_types=tuple(types),
                    query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256), head_dim=d.get("head_dim", 256),
                    tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), qk_norm=True)

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        d.pop("hidden_act")
        full = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_linear_factor != 1.0:
            full = {"rope_type": "linear", "factor": config.rope_linear_factor, "rope_theta": config.rope_theta}
        d.update(hidden_activation="gelu_pytorch_tanh", attention_bias=bool(config.attention_bias),
                 query_pre_attn_scalar=config.query_pre_attn_scalar, sliding_window=config.sliding_window,
                 layer_types=list(config.layer_types), final_logit_softcapping=None, attn_logit_softcapping=None,
                 use_bidirectional_attention=False,
                 rope_parameters={FULL: full, SLIDING: {"rope_type": "default",
                                                        "rope_theta": config.rope_local_base_freq}},
                 # transformers 4's keys
                 rope_local_base_freq=config.rope_local_base_freq,
                 rope_scaling={"rope_type": "linear", "factor": config.rope_linear_factor}
                 if config.rope_linear_factor != 1.0 else None)

    # -- checks --------------------------------------------------------------------------------------------------

    def check(self, config: ModelConfig) -> None:
        if config.attention_bias is None:
            config.attention_bias = False
        if config.qk_norm is None:
            config.qk_norm = True
        if not config.qk_norm:
            raise ValueError("gemma3_text always has q_norm/k_norm; qk_norm must be True")
        if config.num_experts:
            raise ValueError(f"num_experts={config.num_experts} on architecture 'gemma3_text': it has no experts")
        if config.rope_scaling is not None:
            raise ValueError("gemma3_text scales the global layers' RoPE by rope_linear_factor, not rope_scaling")
        if config.layer_types is None:
            config.layer_types = _default_types(config.num_hidden_layers, _PATTERN)
        config.layer_types = tuple(config.layer_types)
        bad = sorted(set(config.layer_types) - {SLIDING, FULL})
        if len(config.layer_types) != config.num_hidden_layers or bad:
            raise ValueError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the "
                             f"{config.num_hidden_layers} layers, got {list(config.layer_types)}")
        w = config.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"sliding_window must be None or a positive int, got {w!r}")
        for name in ("query_pre_attn_scalar", "rope_local_base_freq", "rope_linear_factor"):
            val = getattr(config, name)
            if not (isinstance(val, int | float) and math.isfinite(val) and val > 0):
                raise ValueError(f"{name} must be finite and > 0, got {val!r}")

    # -- building ------------------------------------------------------------------------------------------------

    def build_embedding(self, config: ModelConfig) -> nn.Embedding:
        return ScaledEmbedding(config.vocab_size, config.hidden_size, config.hidden_size**0.5)

    def build_layer(self, config: ModelConfig, i: int) -> nn.Module:
        kind = config.layer_types[i]
        attn = SlidingWindowAttention(config, i, config.sliding_window if kind == SLIDING else None,
                                      config.query_pre_attn_scalar**-0.5)
        attn.q_norm = OffsetRMSNorm(config.head_dim, config.rms_norm_eps)
        attn.k_norm = OffsetRMSNorm(config.head_dim, config.rms_norm_eps)
        return SandwichLayer(attn, GeGLUMLP(config.hidden_size, config.intermediate_size),
                             lambda: OffsetRMSNorm(config.hidden_size, config.rms_norm_eps), kind)

    def build_final_norm(self, config: ModelConfig) -> nn.Module:
        return OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def rope_inv_freqs(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        full = rope_inv_freq(config) / config.rope_linear_factor
        local = rope_inv_freq(dataclasses.replace(config, rope_theta=config.rope_local_base_freq))
        return {FULL: full, SLIDING: local}


def _default_types(layers: int, pattern: int) -> tuple[str, ...]:
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, float, float]:
    """(global base, sliding base, global linear factor) from ``rope_parameters`` keyed by layer type
    (transformers 5) or ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (transformers 4)."""
    params = d.get("rope_parameters") or {}
    full = params.get(FULL) or {}
    sliding = params.get(SLIDING) or {}
    legacy = d.get("rope_scaling") or {}
    theta = float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0)))
    local = float(sliding.get("rope_theta", d.get("rope_local_base_freq", 10_000.0)))
    scaling = full if full.get("rope_type", "default") != "default" else legacy
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"gemma3_text RoPE type {kind!r} is not supported (default or linear)")
    if sliding.get("rope_type", "default") != "default":
        raise ValueError(f"gemma3_text sliding-layer RoPE type {sliding['rope_type']!r} is not supported (default)")
    factor = float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
    return theta, local, factor


register(Gemma3Text())
