"""``guess_number``: find a secret integer in ``[low, high]`` from "higher" / "lower" feedback.

Task: ``{"low": 1, "high": 100, "secret": 37}`` (:func:`make_guess_tasks` draws them from a seed). Each model
turn is read as a guess — the last integer in its text. A right guess ends the episode with reward 1.0; a wrong
one is answered with a ``user`` message ``"higher"`` (the secret is above the guess) or ``"lower"``; a turn
without an integer gets a reminder and costs a turn. The environment sets no turn limit of its own (the caller's
``max_turns`` ends an episode, reward 0): over 1..100 binary search needs at most 7 guesses and most secrets
need at least 3 turns of feedback, so it is a genuinely multi-turn task.
"""

from __future__ import annotations

import random
import re
from typing import Any

from .base import Environment, EnvStep, Message
from .registry import register

__all__ = ["GuessNumberEnv", "last_integer", "make_guess_tasks"]

_INT_RE = re.compile(r"-?\d+")
_MAX_DIGITS = 18


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (a leading ``-`` counts), or None; absurdly long digit runs are None."""
    found = _INT_RE.findall(text)
    if not found or len(found[-1].lstrip("-")) > _MAX_DIGITS:
        return None
    return int(found[-1])


def _int_field(task: dict[str, Any], key: str) -> int:
    value = task.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"guess_number task needs an int {key!r}, got {value!r}")
    return value


@register("guess_number")
class GuessNumberEnv(Environment):
    """Guess the secret; see the module docstring."""

    def __init__(self) -> None:
        self._low = self._high = self._secret = 0
        self._done = True
        self._info: dict[str, float | str] = {}

    @staticmethod
    def generate_tasks(n: int, seed: int) -> list[dict[str, Any]]:
        """``data.task: env``: secrets in [1, 100] as ``{"question", "answer", "low", "high", "secret"}`` tasks."""
        return [{"question": f"Guess my number between {t['low']} and {t['high']}.", "answer": str(t["secret"]), **t}
                for t in make_guess_tasks(n, seed)]

    def reset(self, task: dict[str, Any]) -> list[Message]:
        if "secret" not in task and "answer" in task:  # a data row (question, answer): the answer is the secret
            task = {"low": 1, "high": 100, **task, "secret": task["answer"]}
            try:
                task["secret"] = int(str(task["secret"]).strip())
            except ValueError:
                raise ValueError(f"guess_number task 'answer' must be an integer, got {task['answer']!r}") from None
        low, high, secret = (_int_field(task, k) for k in ("low", "high", "secret"))
        if not low <= secret <= high:
            raise ValueError(f"guess_number task: 'secret' {secret} is outside [low, high] = [{low}, {high}]")
        self._low, self._high, self._secret = low, high, secret
        self._done = False
        self._info = {"guesses": 0.0, "invalid_turns": 0.0}
        system = (f"I am thinking of an integer between {low} and {high}. Each turn, guess it by writing one "
                  f"number; I will answer 'higher' if my number is above your guess or 'lower' if it is below.")
        return [{"role": "system", "content": system},
                {"role": "user", "content": f"Guess my number between {low} and {high}."}]

    def step(self, assistant_text: str) -> EnvStep:
        if self._done:  # asked past the end (or before reset): end again, nothing earned
            return EnvStep([], 0.0, True, dict(self._info))
        guess = last_integer(assistant_text)
        if guess is None:
            self._info["invalid_turns"] += 1
            reminder = f"Write your guess as a number between {self._low} and {self._high}."
            return EnvStep([{"role": "user", "content": reminder}], None, False, dict(self._info))
        self._info["guesses"] += 1
        if guess == self._secret:
            self._done = True
            return EnvStep([], 1.0, True, dict(self._info))
        feedback = "higher" if self._secret > guess else "lower"
        return EnvStep([{"role": "user", "content": feedback}], None, False, dict(self._info))


def make_guess_tasks(n: int, seed: int, low: int = 1, high: int = 100) -> list[dict[str, int]]:
    """``n`` tasks with secrets drawn uniformly from ``[low, high]``, a pure function of the arguments.

    Raises:
        ValueError: ``n`` negative or ``low > high``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"make_guess_tasks n must be an int >= 0, got {n!r}")
    if low > high:
        raise ValueError(f"make_guess_tasks needs low <= high, got low={low}, high={high}")
    rng = random.Random(f"guess_number:{seed}:{low}:{high}")
    return [{"low": low, "high": high, "secret": rng.randint(low, high)} for _ in range(n)]
