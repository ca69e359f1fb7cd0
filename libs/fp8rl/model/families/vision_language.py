"""What the vision-language families share (not a family itself): their ``config.json`` — the text keys nested
under ``text_config`` (transformers 5) or at the top level (files before transformers 4.52), the vision keys under
``vision_config``, the vision special tokens, multimodal RoPE's sections in the text RoPE parameters — their checks,
and the hooks that make a decoder family a vision-language one (:meth:`~fp8rl.model.family.Family.build_vision`,
``mrope_axes``, ``text_dict``). A family module mixes :class:`VisionLanguage` in before its text family
(``class Qwen25VL(VisionLanguage, Qwen2)``) and sets the class attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..mrope import mrope_axes
from ..vision_language import language_model_config

__all__ = ["VisionLanguage", "VisionLanguageConfig"]

_VISION_KEYS = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size")
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass
class VisionLanguageConfig(ModelConfig):
    """:class:`ModelConfig` with a vision-language model's own settings (HF's names).

    Attributes:
        vision_config: the checkpoint's ``vision_config`` (the family's encoder reads it).
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


class VisionLanguage:
    """The vision-language part of a family (module docstring). Class attributes a family sets:

    Attributes:
        encoder: the vision encoder's class (built on ``vision_config``).
        vision_act: the encoder's ``hidden_act`` (the only one it computes).
        vision_keys: ``vision_config`` ints it needs beyond the common ones.
        interleaved: multimodal RoPE's sections interleaved (Qwen3-VL) or blocked (Qwen2.5-VL).
    """

    config_class = VisionLanguageConfig
    vision = True
    language_model_of = ()  # the text family claims the model_type for the text-only load
    encoder: type[nn.Module]
    vision_act = "silu"
    vision_keys: tuple[str, ...] = ()
    interleaved = False

    def text_dict(self, d: dict[str, Any]) -> dict[str, Any]:
        return language_model_config(d)

    def from_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        vision = d.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError(f"{self.name}: config.json lacks its vision_config")
        return {**super().from_hf(self.text_dict(d)), "vision_config": dict(vision),
                "mrope_section": _mrope_section(d), "mrope_interleaved": self.interleaved,
                **{k: d.get(k) for k in _TOKEN_KEYS}}

    def to_hf(self, config: ModelConfig, d: dict[str, Any]) -> None:
        super().to_hf(config, d)
        keep = ("architectures", "model_type", "tie_word_embeddings", "torch_dtype", "dtype")
        text = {k: d.pop(k) for k in list(d) if k not in keep}
        text["model_type"] = f"{self.name}_text"
        mrope = {"mrope_section": list(config.mrope_section), **({"mrope_interleaved": True} if self.interleaved
                                                                  else {})}
        text["rope_parameters"] = {**text["rope_parameters"], **mrope}
        # transformers-4 readers: Qwen2.5-VL's files say "mrope"; Qwen3-VL's name the default RoPE with its sections
        text["rope_scaling"] = {"rope_type": "default", **mrope} if self.interleaved else {"type": "mrope", **mrope}
        d["text_config"] = text
        d["vision_config"] = dict(config.vision_config or {})
        d.update({k: getattr(config, k) for k in _TOKEN_KEYS})

    def check(self, config: ModelConfig) -> None:
        super().check(config)
        vision = config.vision_config
        keys = _VISION_KEYS + self.vision_keys
        if not isinstance(vision, dict) or any(not isinstance(vision.get(k), int) for k in keys):
            raise ValueError(f"{self.name}: vision_config needs the ints {', '.join(keys)}, got {vision!r}")
        if vision["out_hidden_size"] != config.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size={vision['out_hidden_size']} must be the language "
                             f"model's hidden_size={config.hidden_size}")
        if vision.get("hidden_act", self.vision_act) != self.vision_act:
            raise ValueError(f"{self.name}: vision hidden_act {vision['hidden_act']!r} is not supported "
                             f"({self.vision_act})")
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
        return self.encoder(config.vision_config)
