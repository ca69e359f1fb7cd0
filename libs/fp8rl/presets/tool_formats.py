"""What a tool-calling warm start teaches, per tool: the environment, its tasks, the call that solves a task, where
the tool's reply holds the answer, and how a reply of a bare value reads (the ``copy`` rows).

:data:`CALCULATOR` is ``tiny-arith-tool``'s (:class:`~fp8rl.envs.calculator.CalculatorEnv`: a product of a 3- and
a 2-digit number, called as ``{"expression": "347*29"}``, answered with the bare result). :data:`PYTHON` is
``tiny-arith-python``'s (:class:`~fp8rl.envs.python_env.PythonEnv`: ``What is 4071*283+517?``, called as
``{"code": "print(4071*283+517)"}`` and run in the sandbox, answered ``exit status: 0`` then ``stdout:`` and the
printed result).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fp8rl.envs import CalculatorEnv, Environment, PythonEnv, format_tool_call, make_calculator_tasks
from fp8rl.envs.python_env import make_python_tasks
from fp8rl.envs.sandbox import SandboxResult

__all__ = ["CALCULATOR", "PYTHON", "ToolFormat"]


@dataclass(frozen=True)
class ToolFormat:
    """One tool's shape for :mod:`fp8rl.presets.tiny_arith_tool`'s curriculum (module docstring)."""

    make_env: Callable[..., Environment]
    """``make_env(tools_enabled=...)``: a fresh environment."""
    tasks: Callable[[int, int], list[dict[str, str]]]
    """``tasks(n, seed)``: the environment's generated tasks (``data.task: env``)."""
    call: Callable[[dict[str, str]], str]
    """The assistant turn that calls the tool to solve ``task``."""
    answer: Callable[[str], str]
    """The answer, read off the tool message that replied to :attr:`call`."""
    reply: Callable[[str], str]
    """The tool message's content for the bare value ``s`` (``copy`` rows)."""
    expression: Callable[[Any], str]
    """A question's expression for ``copy`` rows, from digit strings ``d(lo, hi)``."""


_PRODUCT_RE = re.compile(r"(\d+)\s*\*\s*(\d+)")
_QUESTION_RE = re.compile(r"What is (.+)\?")


def _calculator_call(task: dict[str, str]) -> str:
    a, b = _PRODUCT_RE.search(task["question"]).groups()
    return format_tool_call("calculator", {"expression": f"{a}*{b}"})


def _python_call(task: dict[str, str]) -> str:
    return format_tool_call("python", {"code": f"print({_QUESTION_RE.search(task['question']).group(1)})"})


def _stdout(content: str) -> str:
    """The printed result in a python tool reply (``exit status: 0`` / ``stdout:`` / the value)."""
    return content.split("stdout:\n", 1)[1].strip() if "stdout:\n" in content else ""


CALCULATOR = ToolFormat(CalculatorEnv, make_calculator_tasks, _calculator_call, str.strip,
                        lambda s: s, lambda d: f"{d(1, 4)}*{d(1, 4)}")
PYTHON = ToolFormat(PythonEnv, make_python_tasks, _python_call, _stdout,
                    lambda s: SandboxResult(f"{s}\n", "", 0).as_tool_result(),
                    lambda d: f"{d(1, 4)}*{d(1, 3)}+{d(1, 3)}")
