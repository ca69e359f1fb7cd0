"""Environments that misbehave on purpose, imported by the environment workers in test_worker_pool.py (by their
import path ``pool_envs:...``): what a buggy or hostile user environment would do inside a worker."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from fp8rl.envs import Environment, EnvStep


class Misbehave(Environment):
    """Echo for one step; the step whose text is a command does what it says: ``raise``, ``sleep`` (far past any
    bound), ``exit`` (the process ends at once), ``hog`` (allocates 8 GiB), ``nan`` (a NaN reward),
    ``bad`` (a message without content); anything else ends the episode with reward 1."""

    def reset(self, task: dict[str, Any]) -> list[dict]:
        return [{"role": "user", "content": str(task.get("question", ""))}]

    def step(self, assistant_text: str) -> EnvStep:
        cmd = assistant_text.strip()
        if cmd == "raise":
            raise RuntimeError("the environment's backend went away")
        if cmd == "sleep":
            time.sleep(600)
        if cmd == "exit":
            os._exit(3)
        if cmd == "hog":
            blob = bytearray(8 << 30)
            return EnvStep([{"role": "user", "content": str(len(blob))}], None, False)
        if cmd == "nan":
            return EnvStep.__new__(EnvStep)  # skips the checks: the worker sends what it has
        if cmd == "bad":
            return _Unchecked([{"role": "user"}], None, False, {})
        if cmd == "again":
            return EnvStep([{"role": "user", "content": "go on"}], None, False)
        return EnvStep([], 1.0, True, {"echo": cmd})


class Fickle(Misbehave):
    """Misbehave, except that ``again`` answers a random number: replaying it cannot give the same replies."""

    def step(self, assistant_text: str) -> EnvStep:
        if assistant_text.strip() == "again":
            return EnvStep([{"role": "user", "content": str(random.random())}], None, False)
        return super().step(assistant_text)


class _Unchecked(EnvStep):
    def __post_init__(self) -> None:  # a malformed result, as a buggy subclass might make one
        pass
