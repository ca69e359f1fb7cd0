"""Dotted key paths into nested rows: ``reward_model.ground_truth`` reads ``row["reward_model"]["ground_truth"]``.

A path is one or more non-empty parts joined by ``.``; a part that is all digits indexes a list
(``prompt.0.content``), any other part names a mapping key. Rows of every format arrive as plain Python
values (JSON objects, or Arrow/Parquet rows as dicts and lists), so one lookup serves them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_KEY_CHARS", "KeyPathError", "lookup", "parse_key", "top_level"]

MAX_KEY_CHARS = 256  # a data.prompt_key / data.answer_key longer than this is a typo, not a schema


class KeyPathError(ValueError):
    """A key path is malformed, or a row has nothing at it (the message says which part is missing)."""


def parse_key(key: str) -> tuple[str, ...]:
    """The parts of dotted path ``key``.

    Raises:
        KeyPathError: ``key`` is not a string, is empty, longer than :data:`MAX_KEY_CHARS`, or has an empty part
            (``a..b``, a leading or trailing dot).
    """
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise KeyPathError(f"expected a dotted key path of 1-{MAX_KEY_CHARS} characters, got {key!r:.80}")
    parts = tuple(key.split("."))
    if any(not p or p != p.strip() for p in parts):
        raise KeyPathError(f"{key!r:.80} has an empty or space-padded part (write parts joined by single dots, "
                           f"e.g. reward_model.ground_truth)")
    return parts


def top_level(key: str) -> str:
    """The first part of ``key``: the column a Parquet or Arrow reader must load to look ``key`` up."""
    return parse_key(key)[0]


def lookup(row: Any, key: str) -> Any:
    """The value at dotted path ``key`` in ``row``.

    Raises:
        KeyPathError: a part is missing; the message names the key, the missing part and what is there.
    """
    obj, seen = row, []
    for part in parse_key(key):
        if isinstance(obj, Mapping):
            if part not in obj:
                if not seen:
                    raise KeyPathError(f"missing key {key!r} (row has keys {_keys(obj)})")
                raise KeyPathError(f"missing key {key!r}: no {part!r} under {'.'.join(seen)!r} (keys there: "
                                   f"{_keys(obj)})")
            obj = obj[part]
        elif isinstance(obj, list | tuple) and part.isdigit():
            if int(part) >= len(obj):
                raise KeyPathError(f"missing key {key!r}: {'.'.join(seen)!r} has {len(obj)} items, no item {part}")
            obj = obj[int(part)]
        else:
            at = repr(".".join(seen)) if seen else "the row"
            raise KeyPathError(f"missing key {key!r}: {at} is a {type(obj).__name__}, not a mapping with {part!r}")
        seen.append(part)
    return obj


def _keys(obj: Mapping) -> str:
    names = sorted(str(k) for k in obj)
    return repr(names) if len(names) <= 20 else f"{names[:20]!r}... ({len(names)} keys)"
