"""Vision-language checkpoints (transformers' ``*ForConditionalGeneration``) read as their language model alone, and
written back whole.

A Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint is a decoder-only language model (a Qwen2 or Qwen3 text tower) plus a
vision encoder whose output replaces the image tokens' embeddings. With ``policy.language_model_only: true`` fp8rl
trains the text tower as the plain causal LM of its family and keeps everything else as it was:

* **config**: the text tower's keys (``text_config``, or the top level of the older flat files) with ``model_type``
  set to the text family. The checkpoint's multimodal RoPE (M-RoPE: three position axes, each owning a section of the
  frequencies) is the family's plain RoPE on a text-only sequence — the three axes then hold the same position — so
  its ``mrope_section`` is dropped, not approximated. Prompts with images are what the full VLM is for.
* **weights**: the text tower under fp8rl's (= the text model's) names. The files use one of two layouts —
  ``model.layers.*`` beside ``visual.*`` (Qwen2-VL, Qwen2.5-VL) or ``model.language_model.*`` beside
  ``model.visual.*`` (Qwen3-VL, transformers 5) — and :func:`split_tensors` reads either; the vision tensors (and
  anything else that is not the text tower's) are left out of the model.
* **export**: :func:`whole_checkpoint_tensors` puts the trained text tensors back under the source's own names beside
  the source's untouched vision tensors, and the source's ``config.json`` is written as it was, so transformers
  loads the result as the model the run started from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .family import family_names, get_family

__all__ = ["LM_ONLY_KEY", "VlArchitecture", "language_model_config", "split_tensors",
           "vision_language_of", "whole_checkpoint_tensors"]

LM_ONLY_KEY = "policy.language_model_only"


@dataclass(frozen=True)
class VlArchitecture:
    """A vision-language ``model_type``, its transformers class and the registered family of its text tower (the
    family whose ``language_model_of`` names it)."""

    model_type: str
    hf_class: str
    text_family: str


def _wrappers() -> dict[str, str]:
    """Vision-language ``model_type`` -> the family of its text tower, as the families declare them."""
    return {mt: name for name in family_names() for mt in get_family(name).language_model_of}


# the keys of a flat (older) file that are the wrapper's, not the text tower's
_WRAPPER_KEYS = ("vision_config", "text_config", "architectures", "model_type", "image_token_id", "video_token_id",
                 "vision_start_token_id", "vision_end_token_id", "vision_token_id", "image_token_index",
                 "video_token_index")
# text-tower prefixes of the two layouts -> fp8rl's
_TEXT_PREFIXES = (("model.language_model.", "model."),)
_VISION_PREFIXES = ("visual.", "model.visual.")


def vision_language_of(d: dict[str, Any]) -> VlArchitecture | None:
    """The :class:`VlArchitecture` of a parsed ``config.json``, or None for a text-only model.

    Raises:
        ValueError: a multimodal file (``vision_config`` / ``text_config``) of a ``model_type`` fp8rl does not read.
    """
    mt = d.get("model_type")
    wrappers = _wrappers()
    if isinstance(mt, str) and mt in wrappers:
        names = d.get("architectures")
        hf_class = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else mt
        return VlArchitecture(mt, hf_class, wrappers[mt])
    if isinstance(d.get("vision_config"), dict) or isinstance(d.get("text_config"), dict):
        raise ValueError(f"model_type {mt!r} is a multimodal checkpoint fp8rl cannot read; {LM_ONLY_KEY} reads "
                         f"{', '.join(sorted(wrappers))}")
    return None


def language_model_config(d: dict[str, Any]) -> dict[str, Any]:
    """The text tower's ``config.json`` dict of vision-language config ``d`` (module docstring), for
    :meth:`~fp8rl.model.ModelConfig.from_hf_dict`.

    Raises:
        ValueError: ``d`` is not a vision-language config fp8rl reads, or its RoPE is not plain / M-RoPE.
    """
    arch = vision_language_of(d)
    if arch is None:
        raise ValueError(f"model_type {d.get('model_type')!r} is not a vision-language checkpoint "
                         f"({', '.join(sorted(_wrappers()))})")
    nested = d.get("text_config")
    text = dict(nested) if isinstance(nested, dict) else {k: v for k, v in d.items() if k not in _WRAPPER_KEYS}
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{arch.model_type}: text rope parameters must be a dict, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"{arch.model_type}: text RoPE type {kind!r} is not supported (plain or multimodal RoPE)")
    theta = params.get("rope_theta", text.get("rope_theta", d.get("rope_theta", 10000.0)))
    text.pop("rope_scaling", None)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    text["model_type"] = arch.text_family
    # transformers reads the tie from the top-level config of a *ForConditionalGeneration
    text["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return text


def _text_name(name: str) -> str | None:
    """fp8rl's name of a text-tower tensor of either layout, None for anything else."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for theirs, ours in _TEXT_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name if name.startswith("model.") or name.startswith("lm_head.") else None


def split_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(text tower by fp8rl's names, every other tensor by its own name)`` of a vision-language checkpoint's
    tensors (either layout of the module docstring)."""
    text, rest = {}, {}
    for name, t in tensors.items():
        ours = _text_name(name)
        if ours is None:
            rest[name] = t
        else:
            text[ours] = t
    return text, rest


def whole_checkpoint_tensors(text: dict[str, torch.Tensor], source: dict[str, torch.Tensor]
                             ) -> dict[str, torch.Tensor]:
    """The whole checkpoint to write: the text tower ``text`` (fp8rl's names) under the names the ``source``
    checkpoint's tensors use, with the source's other tensors (the vision encoder) as they are.

    Raises:
        ValueError: a text tensor the source does not hold (the trained model is not the source's text tower).
    """
    ours_to_theirs = {}
    for name in source:
        ours = _text_name(name)
        if ours is not None:
            ours_to_theirs[ours] = name
    unknown = sorted(set(text) - set(ours_to_theirs))
    if unknown:
        raise ValueError(f"the language model holds tensors its vision-language source does not: {unknown[:5]}")
    _, rest = split_tensors(source)
    return {**{ours_to_theirs[k]: v for k, v in text.items()}, **rest}

