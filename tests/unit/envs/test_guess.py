"""The guess-the-number environment: feedback, and that it is genuinely multi-turn."""

from __future__ import annotations

import pytest

from fp8rl.envs import GuessNumberEnv, make_env, make_guess_tasks
from fp8rl.envs.guess import last_integer


def play(env, task, strategy, max_turns=200):
    """Runs ``strategy(low, high, feedback_so_far) -> text``; returns (turns, reward, feedback)."""
    env.reset(task)
    feedback: list[str] = []
    for turn in range(1, max_turns + 1):
        out = env.step(strategy(feedback))
        if out.done:
            return turn, out.reward, feedback
        feedback += [m["content"] for m in out.messages]
    raise AssertionError("never finished")


def test_feedback_says_higher_or_lower():
    env = make_env("guess_number")
    opening = env.reset({"low": 1, "high": 100, "secret": 37})
    assert [m["role"] for m in opening] == ["system", "user"] and "1 and 100" in opening[1]["content"]
    assert env.step("I guess 50").messages == [{"role": "user", "content": "lower"}]
    assert env.step("maybe 20? no, 30").messages == [{"role": "user", "content": "higher"}]
    out = env.step("37")
    assert (out.done, out.reward) == (True, 1.0)
    assert out.info == {"guesses": 3.0, "invalid_turns": 0.0}


def test_turn_without_a_number_gets_a_reminder():
    env = GuessNumberEnv()
    env.reset({"low": 1, "high": 10, "secret": 3})
    out = env.step("hmm")
    assert not out.done and out.messages[0]["role"] == "user"
    assert "number between 1 and 10" in out.messages[0]["content"]
    assert out.info["invalid_turns"] == 1.0


def bisection():
    """A binary-search player over 1..100 (fresh state per episode)."""
    lo, hi = 1, 100

    def strategy(feedback):
        nonlocal lo, hi
        if feedback:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if feedback[-1] == "higher" else (lo, mid - 1)
        return f"My guess: {(lo + hi) // 2}"

    return strategy


def test_a_bad_strategy_needs_many_turns():
    def linear(feedback):  # counts up from 1
        return str(len(feedback) + 1)

    turns, reward, feedback = play(GuessNumberEnv(), {"low": 1, "high": 100, "secret": 50}, linear)
    assert reward == 1.0 and turns == 50 and len(feedback) == 49 and set(feedback) == {"higher"}


def test_bisection_takes_at_most_seven_and_most_secrets_need_three_feedbacks():
    feedbacks = []
    for secret in range(1, 101):
        turns, reward, feedback = play(GuessNumberEnv(), {"low": 1, "high": 100, "secret": secret}, bisection())
        assert reward == 1.0 and turns <= 7
        feedbacks.append(len(feedback))
    assert sum(n >= 3 for n in feedbacks) == 93  # only 1 + 2 + 4 secrets are found within 3 guesses


def test_tasks_are_deterministic():
    tasks = make_guess_tasks(200, seed=3)
    assert tasks == make_guess_tasks(200, seed=3) != make_guess_tasks(200, seed=4)
    assert all(t["low"] == 1 and t["high"] == 100 and 1 <= t["secret"] <= 100 for t in tasks)
    assert len({t["secret"] for t in tasks}) > 50


def test_step_after_done_and_bad_tasks():
    env = GuessNumberEnv()
    env.reset({"low": 1, "high": 3, "secret": 2})
    assert env.step("2").reward == 1.0
    assert (env.step("2").done, env.step("2").reward) == (True, 0.0)
    with pytest.raises(ValueError, match="'secret' 9 is outside"):
        env.reset({"low": 1, "high": 3, "secret": 9})
    with pytest.raises(ValueError, match="'high'"):
        env.reset({"low": 1, "high": "3", "secret": 2})


def test_last_integer():
    assert last_integer("between 1 and 100 I pick 42.") == 42
    assert last_integer("-7") == -7
    assert last_integer("none") is None
    assert last_integer("9" * 40) is None
