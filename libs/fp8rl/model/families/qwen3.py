"""Qwen3 (``Qwen3ForCausalLM``): the shared pre-norm decoder with QK-norm (per-head RMSNorm of q and k before
RoPE); biases follow ``attention_bias``."""

from __future__ import annotations

from ..family import register
from .standard import StandardFamily


class Qwen3(StandardFamily):
    name, hf_class, max_position_default = "qwen3", "Qwen3ForCausalLM", 32768
    language_model_of = ("qwen3_vl",)  # their text towers (policy.language_model_only)
    qk_norm = True


register(Qwen3())
