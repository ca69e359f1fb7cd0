"""Environments by name: the built-ins register themselves; a user's environment is an import path.

* ``register("calculator")`` — class decorator; the built-ins use it and ``fp8rl.envs`` imports them.
* ``make_env("calculator", tools_enabled=False)`` or ``make_env("my_pkg.chess:ChessEnv", depth=3)``.
* ``allowed(name_or_path, modules)`` — the service stack's gate: env workers are started with the set of
  user modules they may import, and refuse any other path *before* importing it (importing runs code).

Invariant: a registered name never contains ``:``, so a name and an import path cannot be confused.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from .base import Environment

__all__ = ["allowed", "env_names", "import_paths", "make_env", "register", "resolve"]

_REGISTRY: dict[str, type[Environment]] = {}


def register(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator registering an :class:`Environment` subclass under ``name``.

    Raises:
        ValueError: ``name`` is empty or holds ``:``; it is taken by another class; the class is not an
            Environment subclass.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"environment name must be a non-empty str without ':', got {name!r}")

    def deco(cls: type[Environment]) -> type[Environment]:
        if not (inspect.isclass(cls) and issubclass(cls, Environment)):
            raise ValueError(f"register({name!r}): {cls!r} is not an Environment subclass")
        held = _REGISTRY.get(name)
        if held is not None and held.__qualname__ != cls.__qualname__:
            raise ValueError(f"environment name {name!r} is taken by {held.__module__}.{held.__qualname__}")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def env_names() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(_REGISTRY)


def _split_path(path: str) -> tuple[str, str] | None:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr or ":" in attr:
        return None
    if not all(p.isidentifier() for p in module.split(".")) or not attr.isidentifier():
        return None
    return module, attr


def resolve(name_or_path: str) -> type[Environment]:
    """The environment class of a registered name or of an import path ``"package.module:ClassName"``.

    Raises:
        ValueError: an unknown name (the message lists the registered ones), a malformed path, a module
            that cannot be imported, a missing attribute, or a class that is not a concrete Environment.
    """
    if not isinstance(name_or_path, str):
        raise ValueError(f"environment must be a name or 'package.module:ClassName', got {name_or_path!r}")
    if name_or_path in _REGISTRY:
        return _REGISTRY[name_or_path]
    parts = _split_path(name_or_path)
    if parts is None:
        raise ValueError(f"unknown environment {name_or_path!r}: registered are {env_names()}, "
                         f"or give an import path 'package.module:ClassName'")
    module_name, attr = parts
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import runs arbitrary code: any failure is "not importable"
        raise ValueError(f"environment {name_or_path!r}: module {module_name!r} is not importable "
                         f"({type(e).__name__}: {e})") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"environment {name_or_path!r}: module {module_name!r} has no attribute {attr!r}")
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ValueError(f"environment {name_or_path!r}: {attr} is not an Environment subclass "
                         f"(fp8rl.envs.base.Environment), got {cls!r}")
    if inspect.isabstract(cls):
        raise ValueError(f"environment {name_or_path!r}: {attr} is abstract "
                         f"(missing {sorted(cls.__abstractmethods__)})")
    return cls


def make_env(name_or_path: str, **kwargs: Any) -> Environment:
    """A new environment: the class of :func:`resolve` called with ``kwargs``.

    Raises:
        ValueError: as :func:`resolve`, or ``kwargs`` do not fit the constructor (the message names them).
    """
    cls = resolve(name_or_path)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"environment {name_or_path!r} does not take arguments {sorted(kwargs)}: {e}") from None
    return cls(**kwargs)


def import_paths(name: str, kwargs: dict[str, Any] | None) -> list[str]:
    """The import paths a registered adapter would import from its ``kwargs`` (its ``IMPORT_KWARGS``: e.g. the
    ``skyrl`` adapter's ``entry_point``); [] for the other built-ins and for import paths."""
    cls = _REGISTRY.get(name)
    names = getattr(cls, "IMPORT_KWARGS", ()) if cls is not None else ()
    return [v if isinstance(v, str) else repr(v) for k in names if (v := (kwargs or {}).get(k)) is not None]


def allowed(name_or_path: str, modules: Iterable[str], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether a worker started with the user modules ``modules`` may run ``name_or_path`` with ``kwargs``.

    Registered built-ins are always allowed — an adapter only when every import path of its ``kwargs``
    (:func:`import_paths`) has its module in ``modules``; an import path only when its module is exactly one of
    ``modules`` (a package does not allow its submodules: list each). Nothing is imported here.
    """
    if not isinstance(name_or_path, str):
        return False
    mods = set(modules)
    if name_or_path in _REGISTRY:
        return all((p := _split_path(path)) is not None and p[0] in mods
                   for path in import_paths(name_or_path, kwargs))
    parts = _split_path(name_or_path)
    return parts is not None and parts[0] in mods
