"""The environment contract: what multi-turn agent RL asks of an environment, and nothing about trainers.

An episode is driven by a caller (the loop, or a sandboxed env worker of the service stack)::

    messages = env.reset(task)               # opening messages: system + user
    while True:
        text = <the model's turn, decoded>    # one assistant turn, sampled by a rollout engine
        out = env.step(text)                  # once per model turn
        if out.done: break                    # out.reward is the episode's reward
        messages += out.messages              # tool results ("tool") and feedback ("user")

Invariants every :class:`Environment` keeps:

* ``step`` is called exactly once per model turn, with the decoded text of that turn (tool calls and all,
  without the end-of-turn token); it never sees token ids.
* ``reward`` is None on every step with ``done=False`` and a float on the one step with ``done=True``.
  An environment asked to step after it is done answers ``done=True, reward=0.0`` again (it never raises).
* The environment does not count tokens or turns against a budget: the caller enforces
  :class:`EnvSpec`'s ``max_turns`` / token budgets and ends the trajectory itself (reward as it decides).
* Messages a done step returns are not rendered into the trajectory: no model turn follows them.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ROLES", "EnvError", "EnvSpec", "EnvStep", "Environment", "Message", "check_message"]

Message = dict[str, Any]
"""A chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``, optionally ``"tool_calls"``."""

ROLES = ("system", "user", "assistant", "tool")

# A registered name ("calculator") or an import path ("package.module:ClassName").
_NAME_RE = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")


class EnvError(RuntimeError):
    """An environment failed (a bug in it, a crashed sandbox, a step past its timeout): the trajectory is
    ungraded, never scored 0 — the model did nothing wrong."""


def check_message(message: Any, where: str = "message") -> None:
    """Raises ValueError (naming ``where``) unless ``message`` is a :data:`Message`."""
    if not isinstance(message, dict):
        raise ValueError(f"{where}: expected a dict with 'role' and 'content', got {type(message).__name__}")
    if message.get("role") not in ROLES:
        raise ValueError(f"{where}: 'role' must be one of {ROLES}, got {message.get('role')!r}")
    if not isinstance(message.get("content"), str):
        raise ValueError(f"{where}: 'content' must be a str, got {type(message.get('content')).__name__}")


@dataclass(frozen=True)
class EnvStep:
    """What one :meth:`Environment.step` returns.

    Attributes:
        messages: what the environment appends to the conversation: tool results as role ``"tool"``
            (one per tool call, in call order), feedback as role ``"user"``. Empty when done.
        reward: the episode's reward, None until ``done``.
        done: the episode is over; no model turn follows.
        info: per-episode counters and notes for metrics (``tool_calls``, ``tool_errors`` ...), cumulative.
    """

    messages: list[Message]
    reward: float | None
    done: bool
    info: dict[str, float | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list):
            raise ValueError(f"EnvStep.messages must be a list, got {type(self.messages).__name__}")
        for i, m in enumerate(self.messages):
            check_message(m, f"EnvStep.messages[{i}]")
        if self.done and self.reward is None:
            raise ValueError("EnvStep.reward must be a float when done=True")
        if not self.done and self.reward is not None:
            raise ValueError(f"EnvStep.reward must be None until done, got {self.reward!r}")
        if self.reward is not None and not (isinstance(self.reward, int | float) and math.isfinite(self.reward)):
            raise ValueError(f"EnvStep.reward must be a finite float, got {self.reward!r}")
        bad = {k: v for k, v in self.info.items()
               if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int | float | str)}
        if bad:
            raise ValueError(f"EnvStep.info values must be float or str, got {bad!r}")


class Environment(ABC):
    """A multi-turn environment: opening messages from a task, then one :meth:`step` per model turn.

    Subclasses take their options as keyword arguments of ``__init__`` (:func:`fp8rl.envs.registry.make_env`
    passes :attr:`EnvSpec.kwargs`), hold one episode's state at a time, and are reusable: ``reset`` starts over.
    They must not import trainers, engines or the service stack.
    """

    name: str = ""
    """Set by :func:`fp8rl.envs.registry.register` for built-ins."""

    @abstractmethod
    def reset(self, task: dict[str, Any]) -> list[Message]:
        """Starts an episode for ``task`` (a row of the job's data) and returns its opening messages
        (a system message, then the user's request).

        Raises:
            ValueError: the task lacks a key the environment needs, or holds a bad value (the message names it).
        """

    @abstractmethod
    def step(self, assistant_text: str) -> EnvStep:
        """Answers one model turn: ``assistant_text`` is the decoded text of the turn (without its
        end-of-turn token). Called once per turn; see the module docstring for the reward/done rules.

        Raises:
            EnvError: the environment itself failed (never for a bad model turn: that is a message or reward 0).
        """

    def tools(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas (``{"type": "function", "function": {...}}``) passed to the chat
        template as ``tools=``; [] when the environment has no tools."""
        return []


def _positive_int(owner: str, name: str, value: Any, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise ValueError(f"{owner}.{name} must be an int in [1, {hi}], got {value!r}")


@dataclass(frozen=True)
class EnvSpec:
    """Which environment a job runs, and the budgets its caller enforces.

    Attributes:
        name: a registered name (``"calculator"``) or an import path ``"package.module:ClassName"``.
        kwargs: keyword arguments for the environment's constructor; JSON-able (they travel to workers).
        max_turns: most model turns in one trajectory; the caller ends it (reward 0) past this.
        max_tokens_per_turn: most tokens the model may generate in one turn.
        max_trajectory_tokens: most tokens in a whole trajectory (prompt, model turns and environment deltas).
        step_timeout_s: seconds one ``step`` (or ``reset``) may take before the worker is killed (EnvError).
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8
    max_tokens_per_turn: int = 1024
    max_trajectory_tokens: int = 8192
    step_timeout_s: float = 10.0

    MAX_TURNS = 1024
    MAX_TOKENS = 2**31 - 1
    MAX_STEP_TIMEOUT_S = 3600.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or len(self.name) > 200 or not _NAME_RE.match(self.name):
            raise ValueError(f"EnvSpec.name must be a registered name or 'package.module:ClassName', "
                             f"got {self.name!r}")
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise ValueError(f"EnvSpec.kwargs must be a dict with str keys, got {self.kwargs!r}")
        try:
            json.dumps(self.kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"EnvSpec.kwargs must be JSON-able (they are sent to env workers): {e}") from None
        _positive_int("EnvSpec", "max_turns", self.max_turns, self.MAX_TURNS)
        _positive_int("EnvSpec", "max_tokens_per_turn", self.max_tokens_per_turn, self.MAX_TOKENS)
        _positive_int("EnvSpec", "max_trajectory_tokens", self.max_trajectory_tokens, self.MAX_TOKENS)
        if self.max_trajectory_tokens < self.max_tokens_per_turn:
            raise ValueError(f"EnvSpec.max_trajectory_tokens ({self.max_trajectory_tokens}) must be at least "
                             f"max_tokens_per_turn ({self.max_tokens_per_turn})")
        t = self.step_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= self.MAX_STEP_TIMEOUT_S:
            raise ValueError(f"EnvSpec.step_timeout_s must be a number in (0, {self.MAX_STEP_TIMEOUT_S:g}], "
                             f"got {t!r}")
