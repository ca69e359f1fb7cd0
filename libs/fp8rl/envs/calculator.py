"""``calculator``: multi-digit products, with a calculator tool the model may call before it answers.

Task: ``{"question": "What is 347*29?", "answer": "10063"}`` (:func:`make_calculator_tasks` makes them from
a seed). Each model turn is either

* a tool turn — it holds ``<tool_call>`` blocks (:mod:`fp8rl.envs.tools`): every call is answered with one
  ``tool`` message carrying the result (:func:`fp8rl.envs.safe_arith.calculate`) or an ``error: ...`` text;
  the episode goes on; or
* an answer turn — no tool calls: the episode ends, reward 1.0 when the last ``Answer: <n>`` in the text
  equals the task's answer, else 0.0.

``tools_enabled=False`` is the control: the prompt and :meth:`CalculatorEnv.tools` stay the same (so the
control differs from the treatment only in what the tool gives back), and every call is answered with
``error: the calculator is unavailable``. ``info`` counts ``tool_calls`` and ``tool_errors`` for the episode.
"""

from __future__ import annotations

import random
import re
from typing import Any

from .base import Environment, EnvStep, Message
from .registry import register
from .safe_arith import MAX_EXPRESSION_CHARS, calculate
from .tools import answer_tool_calls, parse_tool_calls

__all__ = ["CALCULATOR_TOOL", "SYSTEM_PROMPT", "CalculatorEnv", "extract_answer", "make_calculator_tasks"]

TOOL_NAME = "calculator"
UNAVAILABLE = "error: the calculator is unavailable"

SYSTEM_PROMPT = (
    "You are a careful assistant that solves arithmetic problems. You may call the calculator tool to "
    "evaluate an expression of integers with + - * / and parentheses, for example:\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
    "Then wait for its result. When you know the result, end your reply with the final answer as "
    "`Answer: <number>`."
)

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": f"the expression, at most {MAX_EXPRESSION_CHARS} characters, e.g. '347*29'",
                },
            },
            "required": ["expression"],
        },
    },
}

_ANSWER_RE = re.compile(r"Answer:\s*\**\s*(-?\d[\d,]*)")


def extract_answer(text: str) -> int | None:
    """The integer of the last ``Answer: <n>`` in ``text`` (thousands commas allowed), or None."""
    found = _ANSWER_RE.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits) if digits.lstrip("-").isdigit() else None


@register("calculator")
class CalculatorEnv(Environment):
    """Answer a question, optionally after calling the calculator; see the module docstring."""

    def __init__(self, tools_enabled: bool = True, system_prompt: str = SYSTEM_PROMPT):
        """Args:
            tools_enabled: False is the control (calls answered with an error; prompt unchanged).
            system_prompt: the system message of every episode.
        """
        if not isinstance(tools_enabled, bool):
            raise ValueError(f"CalculatorEnv tools_enabled must be a bool, got {tools_enabled!r}")
        self.tools_enabled = tools_enabled
        self.system_prompt = system_prompt
        self._answer: int | None = None
        self._done = True
        self._info: dict[str, float | str] = {}

    def tools(self) -> list[dict[str, Any]]:
        return [CALCULATOR_TOOL]

    @staticmethod
    def generate_tasks(n: int, seed: int) -> list[dict[str, str]]:
        """``data.task: env``: :func:`make_calculator_tasks` (3-digit by 2-digit products), a pure function of
        ``seed``."""
        return make_calculator_tasks(n, seed)

    def reset(self, task: dict[str, Any]) -> list[Message]:
        question, answer = task.get("question"), task.get("answer")
        if not isinstance(question, str) or not question:
            raise ValueError(f"calculator task needs a non-empty str 'question', got {question!r}")
        try:
            self._answer = int(str(answer).strip())
        except ValueError:
            raise ValueError(f"calculator task 'answer' must be an integer, got {answer!r}") from None
        self._done = False
        self._info = {"tool_calls": 0.0, "tool_errors": 0.0}
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]

    def step(self, assistant_text: str) -> EnvStep:
        if self._done:  # asked past the end (or before reset): end again, nothing earned
            return EnvStep([], 0.0, True, dict(self._info))
        calls = parse_tool_calls(assistant_text)
        if calls:
            messages = answer_tool_calls(calls, TOOL_NAME, "expression", calculate, self._info,
                                         enabled=self.tools_enabled, unavailable=UNAVAILABLE,
                                         usage='error: the calculator takes {"expression": "<arithmetic>"}')
            return EnvStep(messages, None, False, dict(self._info))
        self._done = True
        reward = 1.0 if extract_answer(assistant_text) == self._answer else 0.0
        return EnvStep([], reward, True, dict(self._info))


def make_calculator_tasks(n: int, seed: int, digits: tuple[int, int] = (3, 2)) -> list[dict[str, str]]:
    """``n`` product questions ``a*b`` with ``digits[0]``- and ``digits[1]``-digit factors, a pure function
    of ``seed``.

    Raises:
        ValueError: ``n`` negative, or a digit count outside [1, 9].
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"make_calculator_tasks n must be an int >= 0, got {n!r}")
    if len(digits) != 2 or not all(isinstance(d, int) and 1 <= d <= 9 for d in digits):
        raise ValueError(f"make_calculator_tasks digits must be two ints in [1, 9], got {digits!r}")
    rng = random.Random(f"calculator:{seed}:{digits[0]}:{digits[1]}")
    tasks = []
    for _ in range(n):
        a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in digits)
        tasks.append({"question": f"What is {a}*{b}?", "answer": str(a * b)})
    return tasks
