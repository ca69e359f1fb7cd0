"""Llama (``LlamaForCausalLM``; Llama 3.x, SmolLM2): the shared pre-norm decoder, q/k/v and o biases both
``attention_bias``, optional llama3 long-context RoPE scaling."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..family import register
from .standard import StandardFamily


class Llama(StandardFamily):
    name, hf_class, max_position_default = "llama", "LlamaForCausalLM", 2048

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        super().to_hf(config, d)
        d["mlp_bias"] = False


register(Llama())
