"""Environments for multi-turn, tool-using agent RL — the environment side only (issue 48, DESIGN §4c).

* :mod:`.base` — the contract: :class:`Environment` (``reset`` / ``step`` / ``tools``), :class:`EnvStep`,
  :class:`EnvSpec` (which environment, and the budgets its caller enforces), :class:`EnvError`.
* :mod:`.registry` — environments by name or import path: ``register``, ``make_env``, ``allowed``.
* :mod:`.tools` — Hermes / Qwen ``<tool_call>`` parsing, bounded, errors as entries.
* :mod:`.safe_arith` — the calculator's arithmetic evaluator (a parser, never ``eval``).
* :mod:`.calculator`, :mod:`.guess`, :mod:`.python_env` — the built-ins ``calculator``, ``guess_number`` and
  ``python`` (the model's code run in :mod:`.sandbox`: bubblewrap, an unprivileged uid, limits, a bounded pool).
* :mod:`.render` — :class:`ChatRenderer`: the opening prompt and per-turn deltas as token ids.

Invariant: nothing here imports trainers, engines, the loop, the controller or the service stack (the
environment knows text and, in :mod:`.render`, a tokenizer); importing this package registers the built-ins and
does not import torch or transformers.
"""

from . import adapters, calculator, guess, python_env  # noqa: F401 - registers the built-ins and the adapters
from .base import ROLES, EnvError, Environment, EnvSpec, EnvStep, Message
from .calculator import CalculatorEnv, make_calculator_tasks
from .guess import GuessNumberEnv, make_guess_tasks
from .python_env import PythonEnv, make_programming_tasks, make_python_tasks
from .registry import allowed, env_names, import_paths, make_env, register, resolve
from .render import ChatRenderer
from .tools import ToolCall, ToolCallError, format_tool_call, parse_tool_calls, tool_result_message

__all__ = [
    "ROLES", "CalculatorEnv", "ChatRenderer", "EnvError", "EnvSpec", "EnvStep", "Environment", "GuessNumberEnv",
    "Message", "PythonEnv", "ToolCall", "ToolCallError", "allowed", "env_names", "format_tool_call",
    "make_calculator_tasks", "make_env", "make_guess_tasks", "make_programming_tasks", "make_python_tasks",
    "import_paths", "parse_tool_calls", "register", "resolve", "tool_result_message",
]
