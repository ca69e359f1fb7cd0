"""A TRL ``environment_factory`` class as an fp8rl environment: ``env.name: trl``, ``env.kwargs.factory``.

TRL's contract (GRPOTrainer, ``environment_factory``): a class constructed without arguments, whose ``reset(**row)``
starts an episode from a data row (a returned text is appended to the user's message), whose public methods (not
``reset`` / ``get_reward``, no leading ``_``) are the model's tools — their schemas from type hints and a
Google-style docstring (``transformers.utils.get_json_schema``, as the chat template's tool rendering builds them)
— and whose ``get_reward()`` scores the episode. Here each model turn's ``<tool_call>`` blocks call those methods
(a failing call answers ``{"error": ...}`` to the model, as TRL does); a turn without a tool call is the answer,
and ends the trajectory with ``get_reward()``. ``factory`` is ``package.module:Class`` (on the service stack its
module must be one the environment workers were started with).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from ..base import EnvError, Environment, EnvStep, Message
from ..registry import register
from ..tools import ToolCallError, parse_tool_calls
from .common import import_object, opening

__all__ = ["TRLEnvironment"]

_NOT_TOOLS = ("reset", "get_reward")


@register("trl")
class TRLEnvironment(Environment):
    IMPORT_KWARGS = ("factory",)

    def __init__(self, factory: str, system_prompt: str | None = None) -> None:
        self.factory, self.system_prompt = factory, system_prompt
        self._cls: Any = None
        self._inst: Any = None
        self._schemas: list[dict[str, Any]] = []
        self._calls = 0

    def _methods(self, inst: Any) -> dict[str, Any]:
        return {name: m for name, m in inspect.getmembers(inst, predicate=inspect.ismethod)
                if name not in _NOT_TOOLS and not name.startswith("_")}

    def reset(self, task: dict[str, Any]) -> list[Message]:
        if self._cls is None:
            from transformers.utils import get_json_schema

            cls = import_object(self.factory, "env.kwargs.factory")
            if not callable(getattr(cls, "reset", None)) or not callable(getattr(cls, "get_reward", None)):
                raise ValueError(f"env.kwargs.factory {self.factory!r}: a TRL environment class needs reset(**row) "
                                 f"and get_reward() (the reward of its episode)")
            self._cls = cls
            try:
                self._schemas = [get_json_schema(m) for m in self._methods(cls()).values()]
            except Exception as exc:  # noqa: BLE001 - transformers' docstring parser: name the method's fix
                raise ValueError(f"env.kwargs.factory {self.factory!r}: its tools need type hints and a "
                                 f"Google-style docstring (Args:) for every argument: {exc}") from None
        self._inst, self._calls = self._cls(), 0
        obs = self._inst.reset(**task)
        return opening(task, self.system_prompt, obs if isinstance(obs, str) and obs else None)

    def tools(self) -> list[dict[str, Any]]:
        return self._schemas

    def step(self, assistant_text: str) -> EnvStep:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            try:
                reward = float(self._inst.get_reward())
            except Exception as exc:  # noqa: BLE001 - the environment's own failure: ungraded
                raise EnvError(f"{self.factory}.get_reward failed: {type(exc).__name__}: {exc}") from exc
            return EnvStep([], reward, True, {"tool_calls": float(self._calls)})
        methods, out = self._methods(self._inst), []
        for c in calls:
            if isinstance(c, ToolCallError):
                out.append({"role": "tool", "content": json.dumps({"error": c.error})})
                continue
            self._calls += 1
            fn = methods.get(c.name)
            try:
                if fn is None:
                    raise ValueError(f"no tool {c.name!r}; the tools are {sorted(methods)}")
                result = str(fn(**c.arguments))
            except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's feedback, as in TRL
                result = json.dumps({"error": str(exc)})
            out.append({"role": "tool", "name": c.name, "content": result})
        return EnvStep(out, None, False, {"tool_calls": float(self._calls)})
