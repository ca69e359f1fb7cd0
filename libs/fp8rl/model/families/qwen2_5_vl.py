"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, ``model_type: qwen2_5_vl``): a Qwen2 text tower with
multimodal RoPE (:mod:`fp8rl.model.mrope`, blocked sections) and a vision encoder (:mod:`fp8rl.model.vision`) whose
output replaces the embeddings of the image tokens.

``config.json`` nests the text keys under ``text_config`` (transformers 5) or keeps them at the top level (files
written before transformers 4.52); both read, the nested form is written. The checkpoint's tensors are ``model.*``
(the text tower, fp8rl's names), ``visual.*`` (the encoder) and ``lm_head.weight``: the model holds the encoder as
``visual``, so a plain ``load_state_dict`` loads it. The vision encoder is never FP8 (the recipes convert the
language model's layers only). vLLM and Megatron-Core do not run it here; the embedded engines feed it no images yet
(``policy.language_model_only`` trains the text tower of such a checkpoint: :mod:`fp8rl.model.vision_language`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..family import register
from ..mrope import mrope_axes
from ..vision import VisionEncoder
from ..vision_language import language_model_config
from .qwen2 import Qwen2

_VISION_KEYS = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size")
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass
class VisionLanguageConfig(ModelConfig):
    """:class:`ModelConfig` with a vision-language model's own settings (HF's names).

    Attributes:
        vision_config: the checkpoint's ``vision_config`` (:class:`~fp8rl.model.vision.VisionEncoder`).
        image_token_id: the token each merged image cell occupies in the text.
        video_token_id, vision_start_token_id, vision_end_token_id: the other vision special tokens.
        mrope_section: the frequencies of the time, height and width axes (sum ``head_dim / 2``).
        mrope_interleaved: interleaved (Qwen3-VL) rather than blocked sections.
    """

    vision_config: dict[str, Any] | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    mrope_section: tuple[int, ...] | list[int] = ()
    mrope_interleaved: bool = False


def _mrope_section(d: dict[str, Any]) -> list[int]:
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = params.get("mrope_section") if isinstance(params, dict) else None
    if not (isinstance(section, list) and len(section) == 3 and all(isinstance(s, int) and s > 0 for s in section)):
        raise ValueError(f"{d.get('model_type')}: rope mrope_section must be three positive ints, got {section!r}")
    return section


class Qwen25VL(Qwen2):
    name, hf_class, max_position_default = "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", 128000
    config_class = VisionLanguageConfig
    vision = True
    language_model_of = ()  # Qwen2's (its text tower's family) claims this model_type for the text-only load
    refusals = {"vllm": "fp8rl's refit into vLLM's Qwen2.5-VL is not mapped; use policy.generation.backend: torch",
                "megatron": "the vision encoder is not mapped to Megatron-Core; use policy.training.backend: torch"}

    def text_dict(self, d: dict[str, Any]) -> dict[str, Any]:
        return language_model_config(d)

    def from_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        vision = d.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(f"{self.name}: config.json lacks its vision_config")
        return {**super().from_hf(self.text_dict(d)), "vision_config": dict(vision),
                "mrope_section": _mrope_section(d), **{k: d.get(k) for k in _TOKEN_KEYS}}

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        super().to_hf(config, d)
        keep = ("architectures", "model_type", "tie_word_embeddings", "torch_dtype", "dtype")
        text = {k: d.pop(k) for k in list(d) if k not in keep}
        text["model_type"] = f"{self.name}_text"
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(config.mrope_section)}
        text["rope_scaling"] = {"type": "mrope", "mrope_section": list(config.mrope_section)}
        d["text_config"] = text
        d["vision_config"] = dict(config.vision_config or {})
        d.update({k: getattr(config, k) for k in _TOKEN_KEYS})

    def check(self, config: ModelConfig) -> None:
        super().check(config)
        vision = config.vision_config
        if not isinstance(vision, dict) or any(not isinstance(vision.get(k), int) for k in _VISION_KEYS):
            raise ValueError(f"{self.name}: vision_config needs the ints {', '.join(_VISION_KEYS)}, got {vision!r}")
        if vision["out_hidden_size"] != config.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size={vision['out_hidden_size']} must be the language "
                             f"model's hidden_size={config.hidden_size}")
        if vision.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{self.name}: vision hidden_act {vision['hidden_act']!r} is not supported (silu)")
        config.mrope_section = tuple(int(s) for s in config.mrope_section)
        if len(config.mrope_section) != 3 or sum(config.mrope_section) != config.head_dim // 2:
            raise ValueError(f"mrope_section {config.mrope_section} must be three sections summing to head_dim / 2 "
                             f"= {config.head_dim // 2}")
        tid = config.image_token_id
        if not (isinstance(tid, int) and 0 <= tid < config.vocab_size):
            raise ValueError(f"image_token_id {tid!r} is not a token of the {config.vocab_size}-token vocabulary")

    def mrope_axes(self, config: ModelConfig) -> torch.Tensor | None:
        return mrope_axes(config.mrope_section, config.mrope_interleaved)

    def build_vision(self, config: ModelConfig) -> nn.Module | None:
        return VisionEncoder(config.vision_config)


register(Qwen25VL())
