"""The catalog of presets: name -> how to prepare its checkpoint directory. Each preset module registers itself
(:func:`register_preset`) when imported; :mod:`fp8rl.presets.registry` imports them all and reads the catalog."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["preset_names", "prepare_registered", "register_preset"]

# name -> prepare(progress) -> the checkpoint directory (cached after the first call)
_PRESETS: dict[str, Callable[[bool], Path]] = {}


def register_preset(name: str, prepare: Callable[[bool], Path]) -> None:
    """Add preset ``name``, prepared by ``prepare(progress)``; a second preset of a name is refused."""
    if name in _PRESETS and _PRESETS[name] is not prepare:
        raise ValueError(f"preset {name!r} is registered twice")
    _PRESETS[name] = prepare


def preset_names() -> list[str]:
    """Every registered preset, in registration order."""
    return list(_PRESETS)


def prepare_registered(name: str, progress: bool) -> Path:
    """The checkpoint directory of preset ``name``; KeyError listing the presets when there is none of it."""
    if name not in _PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(_PRESETS)}")
    return _PRESETS[name](progress)
