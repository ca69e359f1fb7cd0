"""The calculator environment: a tool turn then an answer, the tools-disabled control, wrong answers, tasks."""

from __future__ import annotations

import pytest

from fp8rl.envs import CalculatorEnv, format_tool_call, make_calculator_tasks, make_env

TASK = {"question": "What is 347*29?", "answer": "10063"}


def call(expression: str) -> str:
    return "I will use the calculator.\n" + format_tool_call("calculator", {"expression": expression})


def test_full_episode_tool_then_answer():
    env = make_env("calculator")
    opening = env.reset(TASK)
    assert [m["role"] for m in opening] == ["system", "user"]
    assert "Answer: <number>" in opening[0]["content"] and opening[1]["content"] == TASK["question"]
    assert env.tools()[0]["function"]["name"] == "calculator"

    out = env.step(call("347*29"))
    assert out.messages == [{"role": "tool", "content": "10063"}]
    assert (out.done, out.reward) == (False, None)
    out = env.step("The result is 10,063.\nAnswer: 10063")
    assert (out.done, out.reward) == (True, 1.0)
    assert out.info == {"tool_calls": 1.0, "tool_errors": 0.0}


def test_several_calls_and_errors_are_answered_in_order():
    env = CalculatorEnv()
    env.reset(TASK)
    text = call("347*29") + format_tool_call("calculator", {"expression": "1/0"}) + format_tool_call("python", {})
    out = env.step(text + "<tool_call>{oops}</tool_call>")
    assert [m["content"] for m in out.messages[:2]] == ["10063", "error: division by zero"]
    assert "unknown tool 'python'" in out.messages[2]["content"]
    assert "not valid JSON" in out.messages[3]["content"]
    assert out.info == {"tool_calls": 4.0, "tool_errors": 3.0}


def test_tools_disabled_control():
    env = make_env("calculator", tools_enabled=False)
    opening = env.reset(TASK)
    assert opening == CalculatorEnv().reset(TASK) and env.tools() == CalculatorEnv().tools()  # same prompt
    out = env.step(call("347*29"))
    assert out.messages == [{"role": "tool", "content": "error: the calculator is unavailable"}]
    assert out.info["tool_errors"] == 1.0
    assert env.step("Answer: 10063").reward == 1.0  # answering without the tool still counts


@pytest.mark.parametrize("text", ["Answer: 10062", "I think it is 10063.", "Answer: 10063 ... no, Answer: 9"])
def test_wrong_or_missing_answer_scores_zero(text):
    env = CalculatorEnv()
    env.reset(TASK)
    out = env.step(text)
    assert (out.done, out.reward) == (True, 0.0)


def test_step_after_done_ends_again_with_zero():
    env = CalculatorEnv()
    env.reset(TASK)
    assert env.step("Answer: 10063").reward == 1.0
    out = env.step(call("1+1"))
    assert (out.done, out.reward, out.messages) == (True, 0.0, [])
    assert CalculatorEnv().step("Answer: 1").done  # before reset: ends, never raises


def test_bad_task_names_the_key():
    with pytest.raises(ValueError, match="'answer'"):
        CalculatorEnv().reset({"question": "q", "answer": "ten"})
    with pytest.raises(ValueError, match="'question'"):
        CalculatorEnv().reset({"answer": "1"})


def test_tasks_are_deterministic_products():
    tasks = make_calculator_tasks(20, seed=7)
    assert tasks == make_calculator_tasks(20, seed=7) != make_calculator_tasks(20, seed=8)
    for t in tasks:
        a, b = t["question"].removeprefix("What is ").removesuffix("?").split("*")
        assert (len(a), len(b)) == (3, 2) and int(a) * int(b) == int(t["answer"])
    assert all(len(t["question"].split("*")[1]) == 5 for t in make_calculator_tasks(3, 0, digits=(2, 4)))
    with pytest.raises(ValueError, match="digits"):
        make_calculator_tasks(1, 0, digits=(0, 2))
