"""gymnasium environments whose observations and actions are text, as fp8rl environments: ``env.name: gymnasium``.

``env.kwargs``: ``env_id`` (a gymnasium registry id, made with ``gymnasium.make``) or ``entry_point``
(``package.module:Class`` of a ``gymnasium.Env`` subclass; on the service stack its module must be one the
environment workers were started with), ``env_kwargs`` (its constructor's) and ``system_prompt``.

Each task is an episode: ``reset(seed=task.get("seed"), options={"task": task})`` — the observation (text) follows
the task's question as the user's opening message — then each model turn is ``step(text)``; a later observation
is the next user message, the rewards sum to the episode's return, and ``terminated or truncated`` ends it.
gymnasium ships no text environment of its own: users bring theirs (``gymnasium.spaces.Text`` spaces).
"""

from __future__ import annotations

from typing import Any

from ..base import EnvError, Environment, EnvStep, Message
from ..registry import register
from .common import import_object, opening, package

__all__ = ["GymnasiumEnv"]


@register("gymnasium")
class GymnasiumEnv(Environment):
    IMPORT_KWARGS = ("entry_point",)

    def __init__(self, env_id: str | None = None, entry_point: str | None = None, env_kwargs: dict | None = None,
                 system_prompt: str | None = None) -> None:
        if (env_id is None) == (entry_point is None):
            raise ValueError("env.kwargs: give exactly one of env_id (a gymnasium registry id) and entry_point "
                             "(package.module:Class of a gymnasium.Env)")
        self.env_id, self.entry_point, self.env_kwargs = env_id, entry_point, dict(env_kwargs or {})
        self.system_prompt = system_prompt
        self._env: Any = None
        self._return = 0.0

    def reset(self, task: dict[str, Any]) -> list[Message]:
        gymnasium = package("gymnasium", "gymnasium", "env.name gymnasium")
        if self._env is None:
            if self.entry_point is not None:
                self._env = import_object(self.entry_point, "env.kwargs.entry_point")(**self.env_kwargs)
            else:
                try:
                    self._env = gymnasium.make(self.env_id, **self.env_kwargs)
                except Exception as exc:  # noqa: BLE001 - an unknown id, a constructor's complaint
                    raise ValueError(f"gymnasium.make({self.env_id!r}): {type(exc).__name__}: {exc}") from None
        seed = task.get("seed")
        obs, _ = self._env.reset(seed=seed if isinstance(seed, int) else None, options={"task": task})
        self._return = 0.0
        return opening(task, self.system_prompt, str(obs) if obs not in (None, "") else None)

    def step(self, assistant_text: str) -> EnvStep:
        try:
            obs, reward, terminated, truncated, _ = self._env.step(assistant_text)
        except Exception as exc:  # noqa: BLE001 - the environment's own failure: ungraded, never a 0
            raise EnvError(f"the gymnasium environment failed: {type(exc).__name__}: {exc}") from exc
        self._return += float(reward)
        if terminated or truncated:
            return EnvStep([], self._return, True)
        return EnvStep([{"role": "user", "content": str(obs)}], None, False)
