"""Small environments written against each ecosystem's own base classes (the packages ship none that fit a unit
test, or none at all): what a user brings to the skyrl / gymnasium / trl adapters."""

from __future__ import annotations

from typing import Any

import gymnasium
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class GuessWordSkyRL(BaseTextEnv):
    """SkyRL-Gym: the model must say the ground-truth word; a wrong turn gets a hint, three turns at most."""

    def __init__(self, env_config: Any = None, extras: dict | None = None) -> None:
        super().__init__()
        self.word = str((extras or {})["reward_spec"]["ground_truth"])
        self.max_turns = 3

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        if self.word in action:
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})
        if self.turns >= self.max_turns:
            return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, metadata={})
        hint = {"role": "user", "content": f"No. It starts with {self.word[0]!r}."}
        return BaseTextEnvStepOutput(observations=[hint], reward=0.0, done=False, metadata={})


class EchoWordGym(gymnasium.Env):
    """gymnasium: a text observation names a word; saying it earns 1 and terminates, three misses truncate."""

    def __init__(self, max_misses: int = 3) -> None:
        charset = "".join(chr(c) for c in range(32, 127))
        self.observation_space = gymnasium.spaces.Text(256, charset=charset)
        self.action_space = gymnasium.spaces.Text(4096, charset=charset)
        self.max_misses, self.word, self.misses = max_misses, "", 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.word, self.misses = str((options or {}).get("task", {}).get("answer", "apple")), 0
        return f"Say the word {self.word}.", {}

    def step(self, action):
        if self.word in action:
            return "", 1.0, True, False, {}
        self.misses += 1
        return f"Not yet: say {self.word}.", 0.0, False, self.misses >= self.max_misses, {}


class CounterTRL:
    """A TRL environment_factory class: the model counts up to the task's answer with its tool."""

    def reset(self, **row) -> str:
        self.count, self.target = 0, int(row.get("answer", 3))
        return "The counter is at 0."

    def increment(self, by: int) -> int:
        """Adds to the counter.

        Args:
            by: how much to add

        Returns:
            the counter's new value
        """
        if by < 0:
            raise ValueError("by must be >= 0")
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else 0.0


class NoRewardTRL:
    """Lacks get_reward: refused by the adapter."""

    def reset(self, **row) -> None:
        return None
