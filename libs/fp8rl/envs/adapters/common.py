"""What the adapters share: importing the foreign class an import path names, and the opening messages."""

from __future__ import annotations

import importlib
from typing import Any

from ..base import Message

__all__ = ["import_object", "opening", "package"]


def package(name: str, pip: str, what: str) -> Any:
    """Import an adapter's package, or say how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"{what} needs the {pip!r} package ({exc}); pip install {pip}") from None


def import_object(path: str, what: str) -> Any:
    """The object an import path ``package.module:Name`` names (ValueError naming what failed)."""
    module, _, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not (module and attr and all(p.isidentifier() for p in (*module.split("."), attr))):
        raise ValueError(f"{what}: expected an import path package.module:Name, got {path!r}")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - importing runs the user's code: any failure is "not importable"
        raise ValueError(f"{what}: cannot import {module!r} ({type(exc).__name__}: {exc})") from None
    if not hasattr(mod, attr):
        raise ValueError(f"{what}: {module!r} has no {attr!r}")
    return getattr(mod, attr)


def opening(task: dict[str, Any], system_prompt: str | None, extra: str | None = None) -> list[Message]:
    """A task's opening messages: the system prompt (if any), then the question (plus ``extra`` text) as the user's."""
    if "question" not in task:
        raise ValueError("the task has no 'question'")
    text = str(task["question"]) + (f"\n\n{extra}" if extra else "")
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user",
                                                                                           "content": text}]
