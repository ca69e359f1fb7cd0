"""The contract's own checks: EnvStep's reward/done rule, EnvSpec's validation naming the bad field."""

from __future__ import annotations

import pytest

from fp8rl.envs import EnvSpec, EnvStep


def test_envstep_reward_comes_with_done():
    EnvStep([{"role": "tool", "content": "6"}], None, False, {"tool_calls": 1.0})
    EnvStep([], 1.0, True)
    with pytest.raises(ValueError, match="reward must be a float when done"):
        EnvStep([], None, True)
    with pytest.raises(ValueError, match="None until done"):
        EnvStep([], 0.5, False)


def test_envstep_refuses_bad_messages_and_info():
    with pytest.raises(ValueError, match=r"messages\[0\].*role"):
        EnvStep([{"role": "robot", "content": "x"}], None, False)
    with pytest.raises(ValueError, match=r"messages\[0\].*content"):
        EnvStep([{"role": "user", "content": 3}], None, False)
    with pytest.raises(ValueError, match="info"):
        EnvStep([], 1.0, True, {"x": [1]})


def test_envspec_defaults_and_paths():
    assert EnvSpec("calculator").max_turns >= 1
    EnvSpec("my_pkg.envs:ChessEnv", kwargs={"depth": 3}, max_turns=4, step_timeout_s=2.5)


@pytest.mark.parametrize("field, kwargs", [
    ("name", {"name": "bad name!"}),
    ("name", {"name": "a:b:c"}),
    ("kwargs", {"kwargs": {"f": object()}}),
    ("kwargs", {"kwargs": {1: 2}}),
    ("max_turns", {"max_turns": 0}),
    ("max_turns", {"max_turns": True}),
    ("max_tokens_per_turn", {"max_tokens_per_turn": -1}),
    ("max_trajectory_tokens", {"max_tokens_per_turn": 100, "max_trajectory_tokens": 50}),
    ("step_timeout_s", {"step_timeout_s": 0}),
    ("step_timeout_s", {"step_timeout_s": float("nan")}),
])
def test_envspec_names_the_bad_field(field, kwargs):
    args = {"name": "calculator", **kwargs}
    with pytest.raises(ValueError, match=f"EnvSpec.{field}"):
        EnvSpec(**args)
