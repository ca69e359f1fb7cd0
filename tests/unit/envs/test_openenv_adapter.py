"""The openenv adapter against the real ``openenv-core`` (the adapters tier installs it: ``make test-adapters``):
environments defined with OpenEnv's own ``Environment`` / ``Action`` / ``Observation`` classes, stepped in-process
through fp8rl's environment API, and one trained in the loop, bitwise."""

from __future__ import annotations

import os

import pytest

from fp8rl.envs import EnvError, make_env

pytestmark = pytest.mark.adapters  # needs openenv-core: make test-adapters
HERE = "tests.unit.envs.openenv_envs"


@pytest.fixture(autouse=True, scope="module")
def _openenv():
    """openenv-core, or a skip — except in the tier that installed it (a missing package fails there). A fixture,
    not a module-level import: the default tier collects this file and deselects its tests without a word."""
    if os.environ.get("FP8RL_REQUIRE_ADAPTERS"):
        import openenv.core  # noqa: F401
    else:
        pytest.importorskip("openenv.core")


def test_an_openenv_environment_runs_turn_by_turn_with_its_task_and_summed_reward():
    env = make_env("openenv", environment=f"{HERE}:GuessWordOpenEnv", system_prompt="Be brief.")
    opening = env.reset({"question": "A number?", "answer": "42"})
    assert opening == [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "A number?\n\nSay the number."}]  # the observation's text
    s = env.step("7")
    assert (s.done, s.reward, s.messages) == (False, None, [{"role": "user", "content": "No. It has 2 digits."}])
    s = env.step("it is 42")
    assert (s.done, s.reward, s.messages) == (True, 1.0, [])
    env.reset({"question": "Again?", "answer": "5"})  # the same object, a new episode: its return starts at 0
    assert [env.step("x").done for _ in range(3)] == [False, False, True]


def test_the_adapter_says_what_is_wrong_with_an_environment():
    with pytest.raises(ValueError, match="not an openenv Environment"):
        make_env("openenv", environment=f"{HERE}:NotAnEnvironment").reset({"question": "q"})
    with pytest.raises(ValueError, match="cannot import"):
        make_env("openenv", environment="no_such_module_here:Env").reset({"question": "q"})
    with pytest.raises(ValueError, match="has no field 'words'"):
        make_env("openenv", environment=f"{HERE}:Crashing", action_field="words").reset({"question": "q"})
    with pytest.raises(ValueError, match="2 str fields"):  # text and note: which one does the model see?
        make_env("openenv", environment=f"{HERE}:Crashing").reset({"question": "q"})
    env = make_env("openenv", environment=f"{HERE}:Crashing", observation_field="text")
    assert env.reset({"question": "q"})[-1]["content"] == "q\n\ngo"  # reset without **kwargs: no task passed
    with pytest.raises(EnvError, match="the environment's own bug"):  # its trajectory ends ungraded
        env.step("anything")


def test_an_openenv_environment_trains_bitwise_in_the_loop(tmp_path):
    from fp8rl.config import parse_job_config
    from fp8rl.loop import GRPOLoop, LoopConfig
    from tests.e2e.test_trajectories import MAX_DIFF, _chat_model, _job

    model = _chat_model(tmp_path / "chat-model", max_position_embeddings=2048)
    env = {"name": "openenv", "kwargs": {"environment": f"{HERE}:GuessWordOpenEnv"}, "max_turns": 3,
           "max_tokens_per_turn": 8, "max_trajectory_tokens": 1200}
    m = GRPOLoop(LoopConfig(parse_job_config(_job(model, env=env, data={"task": "arith"})))).step(0)
    assert m[MAX_DIFF] == 0.0 and m["env/ungraded"] == 0.0 and m["env/turns_mean"] > 1.0
    assert m["env/masked_tokens"] > 0  # the hints: context, not trained
