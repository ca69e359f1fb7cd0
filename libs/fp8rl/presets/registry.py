"""The built-in presets by name: prepare one (cached on first use) or load a preset or a local checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from fp8rl.model.hf_io import load_hf_checkpoint
from fp8rl.model.tokenizer import Tokenizer, load_tokenizer
from fp8rl.model.transformer import CausalLM

from . import smollm2, tiny_arith, tiny_arith_moe, tiny_arith_python, tiny_arith_tool, tiny_vl  # noqa: F401  (each registers)
from .catalog import prepare_registered, preset_names

__all__ = ["PRESETS", "load_policy", "prepare_preset"]

PRESETS = tuple(sorted(preset_names()))  # every registered preset


def prepare_preset(name: str, *, progress: bool = True) -> Path:
    """The checkpoint directory of preset ``name``, prepared (and cached) on first use.

    Raises:
        KeyError: ``name`` is not one of :data:`PRESETS` (the message lists them).
    """
    return prepare_registered(name, progress)


def load_policy(name_or_path: str, *, dtype: torch.dtype = torch.float32,
                language_model_only: bool = False) -> tuple[CausalLM, Tokenizer, Path]:
    """Load a preset (:data:`PRESETS`, prepared on first use) or a local HF checkpoint directory (of a
    vision-language one, with ``language_model_only`` (``policy.language_model_only``), its text tower).

    The model's ``name_or_path`` is the preset name or the directory's absolute path (as HF's): trainer
    checkpoints record it, so :mod:`fp8rl.export` finds the tokenizer without being told.
    """
    if name_or_path in PRESETS:
        path = prepare_preset(name_or_path)
    else:
        path = Path(name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a local checkpoint directory"
            )
    model, _ = load_hf_checkpoint(path, dtype=dtype, language_model_only=language_model_only)
    model.name_or_path = name_or_path if name_or_path in PRESETS else str(path.resolve())
    return model, load_tokenizer(path), path
