"""The machinery of typed config sections: a :func:`setting` per field (default, docstring, bounds) and a
:class:`Section` base whose ``__post_init__`` checks every field and names it by its dotted key.

Invariant: a section object that exists is valid. Whether it was built from YAML (:func:`from_mapping`) or
in Python (``GenerationConfig(temperature=0.7)``), construction checks type, finiteness, range and
choices, coerces ints given for floats and lists given for tuples, and raises :class:`ConfigError`
whose message starts with the NeMo-RL-style dotted key (``policy.generation.temperature: ...``) and
quotes at most a short prefix of a bad value.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from fp8rl import limits

__all__ = ["ConfigError", "Section", "setting", "section", "from_mapping", "to_dict", "walk", "short"]

_SHOWN_CHARS = 80  # how much of a bad value or key an error message quotes


class ConfigError(ValueError):
    """A job file is invalid; the message names the dotted key."""


def short(val: Any) -> str:
    """``repr(val)``, cut to 80 characters (a 1 MiB bad value must not make a 1 MiB message)."""
    text = repr(val)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def clip(text: str, limit: int = 400) -> str:
    """``text`` cut to ``limit`` characters (messages from parsers and validators can quote whole inputs)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_KINDS = {bool: "bool", int: "int", float: "float", str: "str", tuple: "list", dict: "mapping"}


def setting(default: Any, doc: str, *, kind: type | None = None, optional: bool = False, gt: float | None = None,
            ge: float | None = None, le: float | None = None, choices: tuple | None = None) -> Any:
    """A scalar field: its ``default``, its docstring ``doc`` and its checks.

    ``kind`` is taken from the default unless given (needed when the default is None); ``optional``
    admits None; ``gt`` / ``ge`` / ``le`` bound it; ``choices`` lists the values allowed.
    """
    kind = kind or type(default)
    if kind not in _KINDS:
        raise TypeError(f"setting kind {kind!r} is not one of {', '.join(k.__name__ for k in _KINDS)}")
    meta = {"doc": doc, "kind": kind, "optional": optional, "gt": gt, "ge": ge, "le": le, "choices": choices}
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type[Section], doc: str) -> Any:
    """A nested section field (defaulting to ``cls()``), with its docstring."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "section": cls})


class Section:
    """Base of every config section. Subclasses are frozen dataclasses with a ``KEY`` (their dotted path)
    and may add cross-field checks in :meth:`check` (run after every field passed its own)."""

    KEY: ClassVar[str] = ""
    # A function of fp8rl.config.views that builds the library's own object of this section (LossConfig,
    # ArithConfig): its checks run too, and what it refuses is reported under this section's key.
    VIEW: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            val = getattr(self, f.name)
            sub = f.metadata.get("section")
            if sub is not None:
                if not isinstance(val, sub):
                    raise ConfigError(f"{self.key(f.name)}: expected a mapping, got {short(val)}")
                continue
            checked = _check_value(self.key(f.name), f.metadata, val)
            if checked is not val:
                object.__setattr__(self, f.name, checked)
        self.check()
        if self.VIEW:
            from . import views

            try:
                getattr(views, self.VIEW)(self)
            except ValueError as e:
                raise ConfigError(f"{self.KEY}: {clip(str(e))}") from None

    def check(self) -> None:
        """Cross-field checks of this section (none by default); raise :class:`ConfigError` naming the key."""

    @classmethod
    def key(cls, name: str) -> str:
        return f"{cls.KEY}.{name}" if cls.KEY else name


def _check_value(key: str, meta: Mapping, val: Any) -> Any:
    kind = meta["kind"]
    if val is None and meta["optional"]:
        return val
    if kind is bool:
        ok = isinstance(val, bool)
    elif kind is int:
        ok = isinstance(val, int) and not isinstance(val, bool)
    elif kind is float:
        ok = isinstance(val, int | float) and not isinstance(val, bool)
        val = float(val) if ok and not isinstance(val, float) else val
    elif kind is str:
        ok = isinstance(val, str)
    elif kind is dict:  # a YAML mapping of plain data (string keys), e.g. an environment's constructor arguments
        ok = isinstance(val, Mapping) and all(isinstance(k, str) for k in val)
        if ok:
            try:
                val = json.loads(json.dumps(dict(val), allow_nan=False))
            except (TypeError, ValueError):
                raise ConfigError(f"{key}: expected a mapping of plain data (strings, numbers, booleans, lists, "
                                  f"mappings), got {short(val)}") from None
    else:  # tuple: a YAML list
        ok = isinstance(val, list | tuple)
        val = tuple(val) if isinstance(val, list) else val
    if not ok:
        raise ConfigError(f"{key}: expected {_KINDS[kind]}, got {short(val)}")
    if isinstance(val, float) and not math.isfinite(val):
        raise ConfigError(f"{key}: must be a finite number, got {val}")
    le = meta["le"]
    if kind is int:
        magnitude = max(limits.MAX_CONFIG_INT, le or 0)
        if abs(val) > magnitude:
            raise ConfigError(f"{key}: {short(val)} is out of range (at most {magnitude} in magnitude)")
    if le is not None and val > le:
        raise ConfigError(f"{key}: must be <= {le}, got {val}")
    if meta["choices"] is not None and val not in meta["choices"]:
        raise ConfigError(f"{key}: {short(val)} is not one of {', '.join(map(str, meta['choices']))}")
    if meta["gt"] is not None and not val > meta["gt"]:
        raise ConfigError(f"{key}: must be > {meta['gt']}, got {val}")
    if meta["ge"] is not None and val < meta["ge"]:
        raise ConfigError(f"{key}: must be >= {meta['ge']}, got {val}")
    return val


def from_mapping(cls: type, data: Any, path: str = "") -> Any:
    """Build section ``cls`` from a parsed YAML mapping: unknown keys are refused (naming the known ones),
    absent keys take their defaults, ``None`` for a section means all defaults."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'job file'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, val in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        f = fields.get(key) if isinstance(key, str) else None
        if f is None:
            raise ConfigError(f"unknown key {short(dotted)} (known keys here: {', '.join(sorted(fields))})")
        sub = f.metadata.get("section")
        kwargs[key] = from_mapping(sub, val, dotted) if sub is not None else val
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    """A section as plain YAML-able data (tuples as lists), in field order."""
    out = {}
    for f in dataclasses.fields(obj):
        val = getattr(obj, f.name)
        out[f.name] = to_dict(val) if "section" in f.metadata else (list(val) if isinstance(val, tuple) else val)
    return out


def walk(cls: type, path: str = ""):
    """``(dotted key, field)`` of every scalar setting of section ``cls``, depth first in field order."""
    for f in dataclasses.fields(cls):
        dotted = f"{path}.{f.name}" if path else f.name
        if "section" in f.metadata:
            yield from walk(f.metadata["section"], dotted)
        else:
            yield dotted, f
