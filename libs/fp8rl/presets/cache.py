"""Where presets are cached: one directory per preset and version, under ``$FP8RL_CACHE`` (or ``~/.cache/fp8rl``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PRESET_VERSION", "preset_dir"]

PRESET_VERSION = "v1"


def preset_dir(name: str = "tiny-arith") -> Path:
    """Where a preset is cached: ``$FP8RL_CACHE`` or ``~/.cache/fp8rl``, then ``presets/<name>-<ver>``."""
    root = Path(os.environ.get("FP8RL_CACHE", Path.home() / ".cache" / "fp8rl"))
    return root / "presets" / f"{name}-{PRESET_VERSION}"
