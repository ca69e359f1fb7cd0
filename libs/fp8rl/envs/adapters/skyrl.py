"""SkyRL-Gym text environments (``skyrl_gym``: ``BaseTextEnv``) as fp8rl environments: ``env.name: skyrl``.

``env.kwargs``: ``env_id`` (an id of SkyRL-Gym's registry: ``gsm8k``, ``aime``, ... or one a user module
registered with ``skyrl_gym.register``) or ``entry_point`` (``package.module:Class`` of a ``BaseTextEnv``
subclass; on the service stack its module must be one the environment workers were started with), ``env_config``
(the environment's config mapping), ``extras`` (merged into each episode's extras) and ``system_prompt``.

Each task becomes an episode: ``extras["reward_spec"] = {"method": "rule", "ground_truth": task["answer"]}``
(SkyRL's convention), ``init(prompt)`` gives the opening messages, and each model turn is ``step(text)``: its
``observations`` are the environment's messages, its ``reward`` adds to the episode's return (SkyRL's envs reward
the final step; a per-step reward sums), ``done`` ends the trajectory with that return.
"""

from __future__ import annotations

from typing import Any

from ..base import EnvError, Environment, EnvStep, Message, check_message
from ..registry import register
from .common import import_object, opening, package

__all__ = ["SkyRLEnv"]


@register("skyrl")
class SkyRLEnv(Environment):
    IMPORT_KWARGS = ("entry_point",)

    def __init__(self, env_id: str | None = None, entry_point: str | None = None, env_config: dict | None = None,
                 extras: dict | None = None, system_prompt: str | None = None) -> None:
        if (env_id is None) == (entry_point is None):
            raise ValueError("env.kwargs: give exactly one of env_id (a skyrl_gym registry id) and entry_point "
                             "(package.module:Class of a BaseTextEnv)")
        self.env_id, self.entry_point, self.env_config = env_id, entry_point, env_config
        self.extras, self.system_prompt = dict(extras or {}), system_prompt
        self._env: Any = None
        self._return = 0.0

    def reset(self, task: dict[str, Any]) -> list[Message]:
        skyrl_gym = package("skyrl_gym", "skyrl-gym", "env.name skyrl")
        extras = dict(self.extras)
        if "answer" in task:
            extras["reward_spec"] = {"method": "rule", "ground_truth": str(task["answer"])}
        if self.entry_point is not None:
            cls = import_object(self.entry_point, "env.kwargs.entry_point")
            self._env = cls(env_config=self.env_config, extras=extras)
        else:
            try:
                self._env = skyrl_gym.make(self.env_id, env_config=self.env_config, extras=extras)
            except Exception as exc:  # noqa: BLE001 - an unknown id, a constructor's complaint
                raise ValueError(f"skyrl_gym.make({self.env_id!r}): {type(exc).__name__}: {exc}") from None
        self._return = 0.0
        messages, _ = self._env.init(opening(task, self.system_prompt))
        out = [dict(m) for m in messages]
        for i, m in enumerate(out):
            check_message(m, f"the SkyRL environment's opening message {i}")
        return out

    def step(self, assistant_text: str) -> EnvStep:
        if self._env is None:
            return EnvStep([], 0.0, True)
        try:
            out = self._env.step(assistant_text)
            reward, done = float(out.get("reward") or 0.0), bool(out.get("done"))
            messages = [dict(m) for m in out.get("observations") or []]
        except Exception as exc:  # noqa: BLE001 - the environment's own failure: ungraded, never a 0
            raise EnvError(f"the SkyRL environment failed: {type(exc).__name__}: {exc}") from exc
        self._return += reward
        if done:
            self._env.close()
            self._env = None
            return EnvStep([], self._return, True)
        for i, m in enumerate(messages):
            check_message(m, f"the SkyRL environment's observation {i}")
        return EnvStep(messages, None, False)
