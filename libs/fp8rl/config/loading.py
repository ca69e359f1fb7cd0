"""Reading job files: YAML bounded before and while parsing, then the typed schema.

At most ``MAX_JOB_YAML_BYTES`` of YAML, nested at most ``MAX_YAML_DEPTH`` deep (:mod:`fp8rl.limits`);
anchors and aliases (``&a`` / ``*a``, hence ``<<`` merges) are refused from the parse events before
anything is built, so an alias bomb is a one-line error, not a gigabyte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fp8rl import limits

from .fields import ConfigError, clip, from_mapping
from .job import JobConfig

__all__ = ["load_job_config", "parse_job_config"]


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: parsing is the costly part
_OPEN_EVENTS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE_EVENTS = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def _check_events(text: str) -> None:
    """Refuse anchors / aliases and nesting deeper than ``MAX_YAML_DEPTH`` from the parse events alone.

    Runs before anything is built, so an alias bomb (a few hundred bytes that expand to gigabytes) fails at
    its first anchor, with a one-line message.
    """
    loader, depth = _Loader(text), 0
    try:
        while loader.check_event():
            event = loader.get_event()
            where = f"line {event.start_mark.line + 1}"
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise ConfigError(f"{where}: YAML anchors and aliases (&name, *name, << merges) are not allowed in "
                                  f"job files; write the values out")
            if isinstance(event, _OPEN_EVENTS):
                depth += 1
                if depth > limits.MAX_YAML_DEPTH:
                    raise ConfigError(f"{where}: the job file nests deeper than {limits.MAX_YAML_DEPTH} levels")
            elif isinstance(event, _CLOSE_EVENTS):
                depth -= 1
    finally:
        loader.dispose()


def _check_yaml_size(size: int) -> None:
    if size > limits.MAX_JOB_YAML_BYTES:
        raise ConfigError(f"job file is {size} bytes; the limit is {limits.MAX_JOB_YAML_BYTES} bytes")


def _load_yaml(text: str) -> Any:
    _check_yaml_size(len(text.encode("utf-8", "surrogatepass")))
    try:
        _check_events(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader (CSafeLoader / SafeLoader)
    except ConfigError:
        raise
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: e.g. an int of > 4300 digits
        raise ConfigError(f"job file is not valid YAML: {clip(str(e))}") from None


def parse_job_config(data: dict | str | None) -> JobConfig:
    """Validate a mapping (or YAML text) against the schema; raise :class:`ConfigError` on any problem."""
    if isinstance(data, str):
        data = _load_yaml(data)
    return from_mapping(JobConfig, data)


def load_job_config(path: str | Path) -> JobConfig:
    """Read and validate a job YAML file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"job file {str(p)!r} does not exist")
    try:
        _check_yaml_size(p.stat().st_size)  # before reading it: the limit is on work, not only on parsing
        return parse_job_config(p.read_text())
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
