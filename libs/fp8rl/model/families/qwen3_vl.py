"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, ``model_type: qwen3_vl``): a Qwen3 text tower (QK-norm) with
interleaved multimodal RoPE and DeepStack — a vision encoder (:mod:`fp8rl.model.vision_deepstack`: learned
positions, no windows) whose further per-cell embeddings are added to the image tokens' hidden states after the
first language layers (:mod:`.vision_language`: what the vision-language families share).

The checkpoint keeps the text tower under ``model.language_model.*`` and the encoder under ``model.visual.*``
(``checkpoint_prefixes``: fp8rl's ``model.*`` and ``visual.*``), ``lm_head.weight`` as it is. The vision encoder is
never FP8. vLLM and Megatron-Core do not run it here; the service stack trains it on its torch engines.
"""

from __future__ import annotations

from ..family import register
from ..vision_deepstack import DeepstackVisionEncoder
from .qwen3 import Qwen3
from .vision_language import VisionLanguage

__all__ = ["Qwen3VL"]


class Qwen3VL(VisionLanguage, Qwen3):
    name, hf_class, max_position_default = "qwen3_vl", "Qwen3VLForConditionalGeneration", 128000
    encoder = DeepstackVisionEncoder
    vision_act = "gelu_pytorch_tanh"
    vision_keys = ("num_position_embeddings",)
    interleaved = True
    checkpoint_prefixes = (("visual.", "model.visual."), ("model.", "model.language_model."))
    refusals = {"vllm": "fp8rl's refit into vLLM's Qwen3-VL is not mapped; use policy.generation.backend: torch",
                "megatron": "the vision encoder is not mapped to Megatron-Core; use policy.training.backend: torch"}


register(Qwen3VL())
