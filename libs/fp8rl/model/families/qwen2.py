"""Qwen2 (``Qwen2ForCausalLM``; Qwen2.5): q/k/v always carry a bias and o_proj never does (HF hard-codes both, so
``config.json`` has no key for them); full attention only."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..family import register
from .standard import StandardFamily


class Qwen2(StandardFamily):
    name, hf_class, max_position_default = "qwen2", "Qwen2ForCausalLM", 32768
    language_model_of = ("qwen2_vl", "qwen2_5_vl")  # their text towers (policy.language_model_only)

    def from_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        return {**super().from_hf(d), "attention_bias": True}

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        d["use_sliding_window"] = False  # q/k/v bias is implied by the class, no key for it

    def check(self, config: ModelConfig) -> None:
        if config.attention_bias is None:
            config.attention_bias = True
        if not config.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases (HF Qwen2Attention); attention_bias must be True")
        super().check(config)

    def o_proj_bias(self, config: ModelConfig) -> bool:
        return False


register(Qwen2())
