"""Ecosystem environments trained in the loop through their adapters (issue 51): a TRL environment_factory class and
a SkyRL-Gym environment as env.name, the trajectories bitwise the trainer's forward like the built-ins'."""

from __future__ import annotations

import pytest

from fp8rl.config import parse_job_config
from fp8rl.loop import GRPOLoop, LoopConfig

from .test_trajectories import MAX_DIFF, _chat_model, _job

HERE = "tests.unit.envs.ecosystem_envs"
pytestmark = pytest.mark.agents  # whole GRPO steps in the loop: the agents tier (make test-agents)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return _chat_model(tmp_path_factory.mktemp("chat-model-adapters"), max_position_embeddings=2048)


@pytest.mark.parametrize("env", [
    {"name": "trl", "kwargs": {"factory": f"{HERE}:CounterTRL"}},
    {"name": "skyrl", "kwargs": {"entry_point": f"{HERE}:GuessWordSkyRL"}},
    {"name": "gymnasium", "kwargs": {"entry_point": f"{HERE}:EchoWordGym"}},
], ids=["trl", "skyrl", "gymnasium"])
def test_an_adapted_environment_trains_bitwise(chat_model, env):
    job = _job(chat_model, env={**env, "max_turns": 3, "max_tokens_per_turn": 8, "max_trajectory_tokens": 1200},
               data={"task": "arith"})
    m = GRPOLoop(LoopConfig(parse_job_config(job))).step(0)
    assert m[MAX_DIFF] == 0.0 and m["env/ungraded"] == 0.0 and m["env/turns_mean"] >= 1.0
    if env["name"] != "trl":  # a random policy misses the word: the environment answers, its tokens masked (a TRL
        assert m["env/turns_mean"] > 1.0 and m["env/masked_tokens"] > 0  # turn without a tool call is the answer)
