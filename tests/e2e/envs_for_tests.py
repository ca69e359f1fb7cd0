"""User environments loaded by import path in the trajectory tests (``envs_for_tests:FlakyEnv``): they fail on
purpose, the way a real environment's bug or stuck subprocess would."""

from __future__ import annotations

import time
from typing import Any

from fp8rl.envs import Environment, EnvStep, GuessNumberEnv


class FlakyEnv(Environment):
    """guess_number, except that a task whose answer is odd raises on its second step (``mode: crash``) or never
    returns from it (``mode: hang``: sleeps far past any step timeout)."""

    def __init__(self, mode: str = "crash") -> None:
        self.mode, self.inner, self.steps, self.odd = mode, GuessNumberEnv(), 0, False

    def reset(self, task: dict[str, Any]) -> list[dict]:
        self.steps, self.odd = 0, int(task["answer"]) % 2 == 1
        return self.inner.reset(task)

    def step(self, assistant_text: str) -> EnvStep:
        self.steps += 1
        if self.odd and self.steps == 2:
            if self.mode == "hang":
                time.sleep(120)
            raise RuntimeError("the environment's backend went away")
        return self.inner.step(assistant_text)
