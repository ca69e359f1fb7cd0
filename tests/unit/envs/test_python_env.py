"""The ``python`` environment (issue 50): the model's code runs in the sandbox and its output is the tool result;
answer tasks grade ``Answer:``, test tasks run the final program against the task's tests in the sandbox; a sandbox
that cannot run ends the trajectory ungraded (EnvError), never scored."""

from __future__ import annotations

import json
import os

import pytest

from fp8rl.envs import EnvError, make_env, make_programming_tasks, make_python_tasks
from fp8rl.envs.python_env import UNAVAILABLE
from fp8rl.envs.sandbox import Sandbox, sandbox_problem
from fp8rl.envs.tools import format_tool_call

_PROBLEM = sandbox_problem()
if _PROBLEM is not None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs the code sandbox: {_PROBLEM}", pytrace=False)
    pytestmark = pytest.mark.skip(reason=f"no code sandbox here: {_PROBLEM}")


def _call(code: str) -> str:
    return format_tool_call("python", {"code": code})


def test_a_tool_call_runs_in_the_sandbox_and_the_answer_is_graded():
    task = make_python_tasks(1, seed=3)[0]
    env = make_env("python")
    msgs = env.reset(task)
    assert msgs[0]["role"] == "system" and msgs[1]["content"] == task["question"]
    expr = task["question"].removeprefix("What is ").removesuffix("?")
    out = env.step(f"Let me compute.\n{_call(f'print({expr})')}")
    assert not out.done and out.reward is None and out.messages[0]["role"] == "tool"
    assert f"stdout:\n{task['answer']}" in out.messages[0]["content"]
    assert out.info["sandbox_runs"] == 1 and out.info["sandbox_wall_s"] > 0
    end = env.step(f"Answer: {task['answer']}")
    assert end.done and end.reward == 1.0
    wrong = make_env("python")
    wrong.reset(task)
    assert wrong.step("Answer: 12").reward == 0.0


def test_a_fenced_block_is_a_call_on_answer_tasks_and_errors_come_back_as_text():
    env = make_env("python")
    env.reset({"question": "q", "answer": "7"})
    out = env.step("```python\nprint(3 + 4)\n```")
    assert "stdout:\n7" in out.messages[0]["content"]
    out = env.step(_call("1/0"))
    assert "ZeroDivisionError" in out.messages[0]["content"] and "exit status: 1" in out.messages[0]["content"]
    out = env.step(_call("while True: pass"))
    assert "killed:" in out.messages[0]["content"]
    assert env.step("Answer: 7").reward == 1.0


def test_test_tasks_grade_the_final_program_in_the_sandbox():
    task = {"question": "Write rev(s).", "tests": "assert rev('abc') == 'cba'"}
    good, bad, none = (make_env("python") for _ in range(3))
    for env in (good, bad, none):
        env.reset(task)
    assert good.step("Here:\n```python\ndef rev(s):\n    return s[::-1]\n```").reward == 1.0
    assert bad.step("```python\ndef rev(s):\n    return s\n```").reward == 0.0
    assert none.step("I cannot.").reward == 0.0
    sneaky = make_env("python")
    sneaky.reset(task)  # a program that ends the process early does not pass the tests it skipped
    assert sneaky.step("```python\nimport os\nos._exit(0)\n```").reward == 0.0
    tasks = make_programming_tasks(4, seed=1)
    assert tasks == make_programming_tasks(4, seed=1) and all("tests" in t for t in tasks)


def test_the_control_answers_every_call_unavailable():
    env = make_env("python", tools_enabled=False)
    env.reset({"question": "q", "answer": "7"})
    out = env.step(_call("print(7)"))
    assert out.messages[0]["content"] == UNAVAILABLE and out.info["sandbox_runs"] == 0


def test_a_sandbox_that_cannot_start_ends_the_trajectory_ungraded(monkeypatch):
    monkeypatch.setattr(Sandbox, "_argv", lambda self, code: ["/nonexistent/bwrap", code])
    env = make_env("python")
    env.reset({"question": "q", "answer": "7"})
    with pytest.raises(EnvError, match="the sandbox could not start"):
        env.step(_call("print(7)"))


def test_bad_tasks_are_refused():
    env = make_env("python")
    for task, match in [({"question": ""}, "non-empty str 'question'"),
                        ({"question": "q"}, "exactly one of 'answer' and 'tests'"),
                        ({"question": "q", "answer": "1", "tests": "x"}, "exactly one of"),
                        ({"question": "q", "answer": 7}, "must be a non-empty str"),
                        ({"question": "q", "answer": " "}, "must be a non-empty str")]:
        with pytest.raises(ValueError, match=match):
            env.reset(task)
    assert make_python_tasks(3, 0) == make_python_tasks(3, 0) != make_python_tasks(3, 1)
    with pytest.raises(ValueError, match="grade must be one of auto, answer, tests"):
        make_env("python", grade="exact")
    with pytest.raises(ValueError, match="grades answers"):
        make_env("python", grade="answer").reset(make_programming_tasks(1, 0)[0])


def test_users_rows_with_tests_are_graded_by_their_tests(tmp_path):
    # a user's JSON-lines file of programming tasks, read as a job reads it (data.answer_key: their tests field);
    # each problem reaches the environment as the loop and the stack hand it over: {"question", "answer"}
    from fp8rl.config import parse_job_config
    from fp8rl.controller.plan import problem_source
    from fp8rl.data import DataRoot

    rows = [{"prompt": "Write sq(x), the square of x.", "tests": "assert sq(3) == 9\nassert sq(-2) == 4"},
            {"prompt": "Write neg(x).", "tests": "assert neg(1) == -1"}]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = parse_job_config({"data": {"task": "jsonl", "path": "tasks.jsonl", "answer_key": "tests"},
                            "grpo": {"num_prompts_per_step": 2},
                            "env": {"name": "python", "kwargs": {"grade": "tests"}}})
    problems = problem_source(job, DataRoot(tmp_path))(0)
    assert [p.answer for p in problems] == [r["tests"] for r in rows]
    programs = {"sq": "def sq(x):\n    return x * x", "neg": "def neg(x):\n    return -x"}
    for p in problems:
        name = "sq" if "sq(" in p.prompt else "neg"
        right, wrong = (make_env(job.env.name, **job.env.kwargs) for _ in range(2))
        for env in (right, wrong):
            env.reset({"question": p.prompt, "answer": p.answer})
        assert right.step(f"```python\n{programs[name]}\n```").reward == 1.0
        assert wrong.step(f"```python\ndef {name}(x):\n    return x\n```").reward == 0.0


def test_the_sandbox_counters_become_step_metrics():
    from fp8rl.envs.trajectory import Trajectory, trajectory_metrics

    env = make_env("python")
    env.reset({"question": "q", "answer": "7"})
    infos = [env.step(_call("print(7)")).info, env.step(_call("import time; time.sleep(60)")).info]
    a, b = Trajectory(0, (1,)), Trajectory(1, (1,))
    a.env_info.update(infos[-1])
    b.env_info.update(infos[0])
    m = trajectory_metrics([a, b])
    assert m["env/info/sandbox_runs"] == 3.0 and m["env/info/killed/timeout"] == 1.0
    assert m["env/info/sandbox_wall_s"] > 5.0 and "env/info/tool_calls" not in m
