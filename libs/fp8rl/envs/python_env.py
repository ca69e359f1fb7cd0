"""``python``: the model writes Python, a sandbox runs it (:mod:`fp8rl.envs.sandbox`), the output comes back.

Two kinds of task, by their keys:

* **answer tasks** ``{"question": ..., "answer": "..."}`` (math with code; :func:`make_python_tasks` makes
  arithmetic no small model does in its head): a turn with a ``python`` tool call (``{"code": "..."}``), or a
  fenced ```` ```python ```` block and no ``Answer:``, runs the code and the tool message carries its exit status,
  stdout and stderr; the episode ends on a turn with neither: reward 1.0 when the last ``Answer: <text>`` equals the
  task's answer (whitespace stripped), else 0.0;
* **test tasks** ``{"question": ..., "tests": "assert f(2) == 4\\n..."}`` (small programs;
  :func:`make_programming_tasks`): tool calls run code as above; the first turn without one ends the episode, and
  its last ```` ```python ```` block followed by the tests runs in the sandbox — reward 1.0 when that exits 0
  having run the tests to their end (a nonce printed after them: a program that exits early skipped them).

Users' own tasks come as data rows (``data.task: dataset`` or ``jsonl``), which reach an environment as
``{"question", "answer"}``: rows of answer tasks as they are; rows of test tasks with ``data.answer_key`` naming
their tests field and ``env.kwargs.grade: tests`` (the task's ``answer`` holds its tests). ``grade: answer`` grades
every task by its answer; ``auto`` (the default) by the key the task has.

A sandbox that cannot run (bubblewrap missing, the pool's queue deadline passed) raises :class:`EnvError`: the
trajectory ends ungraded with that reason, out of the loss and counted — never a score the model earned.
``tools_enabled=False`` is the control: every call is answered ``error: the python tool is unavailable`` (test
tasks still grade their final program). ``info`` counts ``tool_calls``, ``tool_errors``, ``sandbox_runs``,
``sandbox_wall_s``, ``sandbox_start_s`` and ``killed/<reason>``.
"""

from __future__ import annotations

import random
import re
import secrets
import threading
from typing import Any

from .base import EnvError, Environment, EnvStep, Message
from .registry import register
from .sandbox import KILL_REASONS, SandboxLimits, SandboxPool, SandboxResult, SandboxUnavailable
from .tools import ToolCall, answer_tool_calls, parse_tool_calls

__all__ = ["PYTHON_TOOL", "PythonEnv", "make_programming_tasks", "make_python_tasks"]

TOOL_NAME = "python"
GRADES = ("auto", "answer", "tests")
UNAVAILABLE = "error: the python tool is unavailable"
SYSTEM_PROMPT = (
    "You are a careful assistant. You may run Python code with the python tool, for example:\n"
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(12*34)"}}\n</tool_call>\n'
    "Then wait for its output. When you know the result, end your reply with `Answer: <result>`; when asked for a "
    "program, end your reply with it in a ```python block."
)
PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run a Python 3 program in a sandbox (no network, no files kept) and return its exit "
                       "status, stdout and stderr.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                       "required": ["code"]},
    },
}
_FENCE_RE = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)
_ANSWER_RE = re.compile(r"Answer:\s*([^\n]+)")

_pools: dict[tuple, SandboxPool] = {}
_pools_lock = threading.Lock()


def _pool(slots: int, max_starting: int, queue_timeout_s: float, limits: SandboxLimits) -> SandboxPool:
    """The process's pool of these settings (environments of one job share it: the caps are per process)."""
    key = (slots, max_starting, queue_timeout_s, limits)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = SandboxPool(slots, max_starting=max_starting, queue_timeout_s=queue_timeout_s,
                                      limits=limits)
        return _pools[key]


@register("python")
class PythonEnv(Environment):
    """Run the model's Python in a sandbox; see the module docstring.

    Args:
        tools_enabled: False is the control.
        wall_seconds, memory_mb, output_kb: the :class:`~fp8rl.envs.sandbox.SandboxLimits` of a run.
        slots, max_starting, queue_timeout_s: the process's :class:`~fp8rl.envs.sandbox.SandboxPool`.
        system_prompt: the system message of every episode.
        grade: ``auto`` (a task's ``answer`` or ``tests``, whichever it has), ``tests`` (a task's ``answer`` holds
            its tests: users' data rows, ``data.answer_key: <their tests field>``) or ``answer``.
    """

    def __init__(self, tools_enabled: bool = True, wall_seconds: float = 5.0, memory_mb: int = 512,
                 output_kb: int = 64, slots: int = 4, max_starting: int = 2, queue_timeout_s: float = 10.0,
                 system_prompt: str = SYSTEM_PROMPT, grade: str = "auto") -> None:
        if not isinstance(tools_enabled, bool):
            raise ValueError(f"PythonEnv tools_enabled must be a bool, got {tools_enabled!r}")
        if grade not in GRADES:
            raise ValueError(f"PythonEnv grade must be one of {', '.join(GRADES)}, got {grade!r}")
        self.grade = grade
        limits = SandboxLimits(wall_seconds=wall_seconds, cpu_seconds=max(1, int(wall_seconds)),
                               memory_bytes=int(memory_mb) * 2**20, output_bytes=int(output_kb) * 2**10)
        self.pool = _pool(slots, max_starting, queue_timeout_s, limits)
        self.tools_enabled = tools_enabled
        self.system_prompt = system_prompt
        self._task: dict[str, Any] = {}
        self._done = True
        self._info: dict[str, float | str] = {}

    def tools(self) -> list[dict[str, Any]]:
        return [PYTHON_TOOL]

    @staticmethod
    def generate_tasks(n: int, seed: int) -> list[dict[str, str]]:
        """``data.task: env``: :func:`make_python_tasks`, a pure function of ``seed``."""
        return make_python_tasks(n, seed)

    def reset(self, task: dict[str, Any]) -> list[Message]:
        question = task.get("question")
        if not isinstance(question, str) or not question:
            raise ValueError(f"python task needs a non-empty str 'question', got {question!r}")
        if self.grade == "tests" and "answer" in task and "tests" not in task:  # a data row: its answer is tests
            task = {"question": question, "tests": task["answer"]}
        if self.grade == "answer" and "tests" in task:
            raise ValueError("python task has 'tests' but the environment grades answers (env.kwargs.grade: answer)")
        if ("answer" in task) == ("tests" in task):
            raise ValueError(f"python task needs exactly one of 'answer' and 'tests', got keys {sorted(task)}")
        graded = task.get("answer", task.get("tests"))
        if not isinstance(graded, str) or not graded.strip():
            raise ValueError(f"python task 'answer' / 'tests' must be a non-empty str, got {graded!r:.80}")
        self._task = dict(task)
        self._done = False
        self._info = {"tool_calls": 0.0, "tool_errors": 0.0, "sandbox_runs": 0.0, "sandbox_wall_s": 0.0,
                      "sandbox_start_s": 0.0, **{f"killed/{r}": 0.0 for r in KILL_REASONS}}
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]

    def _run(self, code: str) -> SandboxResult:
        try:
            r = self.pool.run(code)
        except SandboxUnavailable as e:
            raise EnvError(f"python: {e}") from None
        except ValueError as e:  # code over the size cap: the model's doing, answered as an error
            return SandboxResult("", f"error: {e}", 1)
        self._info["sandbox_runs"] += 1
        self._info["sandbox_wall_s"] += r.wall_s
        self._info["sandbox_start_s"] += r.start_s
        if r.killed:
            self._info[f"killed/{r.killed}"] += 1
        return r

    def step(self, assistant_text: str) -> EnvStep:
        if self._done:
            return EnvStep([], 0.0, True, dict(self._info))
        calls = parse_tool_calls(assistant_text)
        fenced = _FENCE_RE.findall(assistant_text)
        if not calls and fenced and "answer" in self._task and not _ANSWER_RE.search(assistant_text):
            calls = [ToolCall(TOOL_NAME, {"code": fenced[-1]})]  # a fenced block is a call on answer tasks
        if calls:
            messages = answer_tool_calls(calls, TOOL_NAME, "code", lambda code: self._run(code).as_tool_result(),
                                         self._info, enabled=self.tools_enabled, unavailable=UNAVAILABLE,
                                         usage='error: the python tool takes {"code": "<program>"}')
            return EnvStep(messages, None, False, dict(self._info))
        self._done = True
        if "answer" in self._task:
            found = _ANSWER_RE.findall(assistant_text)
            ok = bool(found) and found[-1].strip().strip("`*").strip() == self._task["answer"].strip()
            return EnvStep([], 1.0 if ok else 0.0, True, dict(self._info))
        if not fenced:
            return EnvStep([], 0.0, True, dict(self._info))
        # a nonce printed after the tests: a program that exits early (status 0) skipped them and does not pass
        nonce = secrets.token_hex(16)
        r = self._run(f"{fenced[-1]}\n\n{self._task['tests']}\nprint({nonce!r})\n")
        passed = r.exit_status == 0 and not r.killed and r.stdout.rstrip().endswith(nonce)
        return EnvStep([], 1.0 if passed else 0.0, True, dict(self._info))


def make_python_tasks(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` arithmetic questions a small model cannot do in its head (a 4- by 3-digit product plus a 3-digit
    number), a pure function of ``seed``; the answer is what ``print(<expression>)`` prints."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"make_python_tasks n must be an int >= 0, got {n!r}")
    rng = random.Random(f"python:{seed}")
    tasks = []
    for _ in range(n):
        a, b, c = rng.randint(1000, 9999), rng.randint(100, 999), rng.randint(100, 999)
        tasks.append({"question": f"What is {a}*{b}+{c}?", "answer": str(a * b + c)})
    return tasks


_PROGRAMS = [
    ("Write a function `rev(s)` that returns the string s reversed.",
     "assert rev('abc') == 'cba'\nassert rev('') == ''"),
    ("Write a function `digit_sum(n)` that returns the sum of the decimal digits of a non-negative int n.",
     "assert digit_sum(0) == 0\nassert digit_sum(1234) == 10"),
    ("Write a function `is_prime(n)` that says whether the int n is prime.",
     "assert [k for k in range(20) if is_prime(k)] == [2, 3, 5, 7, 11, 13, 17, 19]"),
    ("Write a function `fib(n)` returning the n-th Fibonacci number, fib(0) = 0 and fib(1) = 1.",
     "assert [fib(k) for k in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]"),
    ("Write a function `vowels(s)` that counts the vowels (a, e, i, o, u, either case) in s.",
     "assert vowels('Hello World') == 3\nassert vowels('xyz') == 0"),
    ("Write a function `gcd(a, b)` returning the greatest common divisor of two positive ints.",
     "assert gcd(12, 18) == 6\nassert gcd(7, 13) == 1"),
]


def make_programming_tasks(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` small programming tasks with tests (drawn from a bundled set), a pure function of ``seed``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"make_programming_tasks n must be an int >= 0, got {n!r}")
    rng = random.Random(f"programs:{seed}")
    return [dict(zip(("question", "tests"), rng.choice(_PROGRAMS), strict=True)) for _ in range(n)]
