"""User environments the env-stack tests run by import path (``stack_envs:PausingGuess``): the reward service is
started with ``--env-module stack_envs`` and imports this module in its env workers."""

from __future__ import annotations

import os
import time

from fp8rl.envs import EnvStep, GuessNumberEnv


class PausingGuess(GuessNumberEnv):
    """guess_number whose first step of the whole stack (the one that creates ``marker``) writes the marker and
    pauses ``pause_s`` seconds: a window in which a test kills a rollout replica mid-trajectory."""

    def __init__(self, marker: str = "", pause_s: float = 0.0) -> None:
        super().__init__()
        self.marker, self.pause_s = marker, pause_s

    def step(self, assistant_text: str) -> EnvStep:
        if self.marker:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                time.sleep(self.pause_s)
        return super().step(assistant_text)


class SlowGuess(GuessNumberEnv):
    """guess_number whose every step takes ``delay_s`` seconds (a tool that calls a slow service): trajectories
    that span a training step in asynchronous GRPO."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s

    def step(self, assistant_text: str) -> EnvStep:
        time.sleep(self.delay_s)
        return super().step(assistant_text)
