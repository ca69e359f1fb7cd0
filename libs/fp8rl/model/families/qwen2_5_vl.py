"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, ``model_type: qwen2_5_vl``): a Qwen2 text tower with
multimodal RoPE (:mod:`fp8rl.model.mrope`, blocked sections) and a vision encoder (:mod:`fp8rl.model.vision`) whose
output replaces the embeddings of the image tokens (:mod:`.vision_language`: what the vision-language families
share).

The checkpoint's tensors are ``model.*`` (the text tower, fp8rl's names), ``visual.*`` (the encoder) and
``lm_head.weight``: the model holds the encoder as ``visual``, so a plain ``load_state_dict`` loads it. The vision
encoder is never FP8 (the recipes convert the language model's layers only). vLLM and Megatron-Core do not run it
here; the service stack trains it single-turn on its torch engines (the pictures travel with the calls).
"""

from __future__ import annotations

from ..family import register
from ..vision import VisionEncoder
from .qwen2 import Qwen2
from .vision_language import VisionLanguage, VisionLanguageConfig

__all__ = ["Qwen25VL", "VisionLanguageConfig"]


class Qwen25VL(VisionLanguage, Qwen2):
    name, hf_class, max_position_default = "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", 128000
    encoder = VisionEncoder
    refusals = {"vllm": "fp8rl's refit into vLLM's Qwen2.5-VL is not mapped; use policy.generation.backend: torch",
                "megatron": "the vision encoder is not mapped to Megatron-Core; use policy.training.backend: torch"}


register(Qwen25VL())
