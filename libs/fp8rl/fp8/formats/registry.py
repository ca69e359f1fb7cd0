"""The registry of FP8 scaling formats: name -> the shared :class:`~.base.LinearFormat` instance."""

from __future__ import annotations

from .base import LinearFormat

__all__ = ["DEFAULT_SCALING", "format_names", "linear_format", "register"]

DEFAULT_SCALING = "blockwise"  # a job that names no fp8_recipe

_FORMATS: dict[str, LinearFormat] = {}


def register(fmt: LinearFormat) -> LinearFormat:
    """Add ``fmt`` under its ``name`` (its module calls it on import); a second format of a name is refused."""
    if not fmt.name:
        raise ValueError(f"a format needs a name, got {fmt!r}")
    held = _FORMATS.get(fmt.name)
    if held is not None and type(held) is not type(fmt):
        raise ValueError(f"FP8 format {fmt.name!r} is registered twice ({type(held).__name__}, {type(fmt).__name__})")
    _FORMATS[fmt.name] = fmt
    return fmt


def format_names() -> list[str]:
    """Every registered format's name: the default first, the others in registration order."""
    return sorted(_FORMATS, key=lambda n: n != DEFAULT_SCALING)


def linear_format(name: str) -> LinearFormat:
    """The format called ``name``; ValueError naming the choices otherwise."""
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown FP8 scaling {name!r}: expected one of {', '.join(_FORMATS)}") from None
