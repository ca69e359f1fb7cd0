"""OpenEnv environments (``openenv-core``: ``Environment`` with ``reset`` / ``step`` / ``state``) as fp8rl
environments: ``env.name: openenv``.

``env.kwargs``: ``environment`` (``package.module:Class`` of an ``openenv`` ``Environment`` subclass; on the service
stack its module must be one the environment workers were started with), ``env_kwargs`` (its constructor's),
``action_field`` (the ``Action`` field the model's text goes into; default: the action class's one ``str`` field),
``observation_field`` (the ``Observation`` field shown to the model; default: its one ``str`` field beside
``done`` / ``reward`` / ``metadata``) and ``system_prompt``. The action class is the first type argument of the
class's ``Environment[ActT, ObsT, StateT]`` base.

The environment runs in-process (the worker's): no HTTP server, no container — OpenEnv's server only wraps this same
class. Each task is an episode: ``reset(seed=task["seed"])`` (and ``task=task`` where ``reset`` takes it) — the
observation's text follows the task's question as the user's opening message — then each model turn is
``step(Action(**{action_field: text}))``; a later observation is the next user message, the observations'
rewards sum to the episode's return, and ``done`` ends it.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from ..base import EnvError, Environment, EnvStep, Message
from ..registry import register
from .common import import_object, opening, package

__all__ = ["OpenEnvEnv"]

_OBS_BASE_FIELDS = {"done", "reward", "metadata"}


def _str_fields(model: type, skip: set[str] = frozenset()) -> list[str]:
    """The ``str`` fields of a pydantic model class (OpenEnv's actions and observations are pydantic)."""
    fields = getattr(model, "model_fields", {})
    return [n for n, f in fields.items() if n not in skip and f.annotation is str]


def _action_class(cls: type) -> type:
    """The ``ActT`` of ``cls``'s ``Environment[ActT, ObsT, StateT]`` base (searched along the MRO)."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    raise ValueError(f"env.kwargs.environment: {cls.__name__} does not name its action class "
                     f"(subclass Environment[MyAction, MyObservation, State])")


def _only(fields: list[str], what: str, key: str) -> str:
    if len(fields) != 1:
        raise ValueError(f"env.kwargs.{key}: the {what} has {len(fields)} str fields ({', '.join(fields) or 'none'}); "
                         f"name the one to use")
    return fields[0]


@register("openenv")
class OpenEnvEnv(Environment):
    IMPORT_KWARGS = ("environment",)

    def __init__(self, environment: str | None = None, env_kwargs: dict | None = None, action_field: str | None = None,
                 observation_field: str | None = None, system_prompt: str | None = None) -> None:
        if environment is None:
            raise ValueError("env.kwargs.environment: give package.module:Class of an openenv Environment")
        self.environment, self.env_kwargs = environment, dict(env_kwargs or {})
        self.action_field, self.observation_field, self.system_prompt = action_field, observation_field, system_prompt
        self._env: Any = None
        self._action: type | None = None
        self._return = 0.0

    def _make(self) -> None:
        core = package("openenv.core", "openenv-core", "env.name openenv")
        cls = import_object(self.environment, "env.kwargs.environment")
        if not (isinstance(cls, type) and issubclass(cls, core.Environment)):
            raise ValueError(f"env.kwargs.environment: {self.environment!r} is not an openenv Environment subclass")
        self._action = _action_class(cls)
        if self.action_field is None:
            self.action_field = _only(_str_fields(self._action), f"action {self._action.__name__}", "action_field")
        elif self.action_field not in getattr(self._action, "model_fields", {}):
            raise ValueError(f"env.kwargs.action_field: {self._action.__name__} has no field {self.action_field!r}")
        self._env = cls(**self.env_kwargs)

    def _text(self, obs: Any) -> str:
        if self.observation_field is None:
            self.observation_field = _only(_str_fields(type(obs), _OBS_BASE_FIELDS),
                                           f"observation {type(obs).__name__}", "observation_field")
        if not hasattr(obs, self.observation_field):
            raise EnvError(f"the observation {type(obs).__name__} has no field {self.observation_field!r}")
        return str(getattr(obs, self.observation_field))

    def reset(self, task: dict[str, Any]) -> list[Message]:
        if self._env is None:
            self._make()
        seed = task.get("seed")
        kwargs: dict[str, Any] = {"seed": seed if isinstance(seed, int) else None}
        params = inspect.signature(self._env.reset).parameters
        if "task" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs["task"] = task
        obs = self._env.reset(**kwargs)
        self._return = 0.0
        text = self._text(obs)
        return opening(task, self.system_prompt, text or None)

    def step(self, assistant_text: str) -> EnvStep:
        try:
            obs = self._env.step(self._action(**{self.action_field: assistant_text}))
        except Exception as exc:  # noqa: BLE001 - the environment's own failure: ungraded, never a 0
            raise EnvError(f"the openenv environment failed: {type(exc).__name__}: {exc}") from exc
        if obs.reward is not None:
            self._return += float(obs.reward)
        if obs.done:
            return EnvStep([], self._return, True)
        return EnvStep([{"role": "user", "content": self._text(obs)}], None, False)
