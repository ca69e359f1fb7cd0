"""A grader that takes its time, for the hostile tier's cancelled-Score case (imported by the reward service through
``$FP8RL_GRADER_MODULES``; ``$PYTHONPATH`` names this folder).

``hostile_slow``: sleeps as many seconds as the item's answer says, then scores 0; the response is ignored.
"""

from __future__ import annotations

import time

from fp8rl.data import register_grader


def _slow(response: str, answer: str) -> float:
    time.sleep(float(answer))
    return 0.0


register_grader("hostile_slow", _slow)
