"""Pipeline (asynchronous GRPO) over an in-memory double of the backends: the lag bound as a property of every
run, the synchronous call order at k = 0, and failures of any thread reaching the caller."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import pytest

from fp8rl.controller.pipeline import Pipeline
from fp8rl.controller.step import Trained, run_step
from fp8rl.data import Problem


@dataclass(frozen=True)
class _Sample:
    token_ids: tuple
    logprobs: tuple
    weight_version: int
    finish_reason: str = "stop"


class _Plan:
    group, fp8_kv, leave_one_out, temperature = 2, True, True, 1.0
    normalize_rewards, max_gen_rounds, overlong_filtering = True, 1, False
    dropped_prompts = {"train": 0, "validation": 0}

    def __init__(self, k: int) -> None:
        self.max_weight_lag = k

    def batch(self, step):
        return [Problem(f"p{step}-{i}", "1") for i in range(2)]

    def prompts(self, problems):
        return [[1, 2] for _ in problems]

    def shaped_rewards(self, rewards, samples):
        return list(rewards)

    def refill_index(self, step, round_):
        raise AssertionError("no dynamic sampling here")


class _Backends:
    """Records every call; the trainer refuses rows outside the lag bound, as the real one does. Random small
    sleeps shuffle the threads' interleaving from run to run."""

    def __init__(self, version: int, seed: int) -> None:
        self.trainer, self.rollout = version, version
        self.log: list[tuple] = []
        self.lock, self.rng = threading.Lock(), random.Random(seed)

    def _nap(self):
        time.sleep(self.rng.random() * 0.004)

    def generate(self, prompts, version, *, step, n, temperature):
        assert version == self.rollout, "a generate pinned to a version the rollout side does not hold"
        self._nap()
        with self.lock:
            self.log.append(("generate", step, version))
        return [(i, _Sample((3,), (-1.0,), version)) for i in range(len(prompts)) for _ in range(n)]

    def score(self, pairs):
        return [float(i % 2) for i in range(len(pairs))]

    def train(self, version, step, rows, *, max_weight_lag=0):
        assert version == self.trainer
        oldest = min(s.weight_version for _, s, _ in rows)
        assert oldest >= version - max_weight_lag, f"step {step}: a row of v{oldest} trained at v{version}"
        self._nap()
        with self.lock:
            self.log.append(("train", step, version))
            self.trainer += 1
        return Trained(self.trainer, {"weight_lag_max": float(version - oldest)}, {"train": 0.001})

    def calibrate(self, version, sequences):
        with self.lock:
            self.log.append(("calibrate", version))

    def await_refit(self, version):
        self._nap()
        with self.lock:
            self.log.append(("refit", version))
            self.rollout = version
        return {}


def _pipelined(k: int, steps: int, seed: int, inline: bool = True):
    b, got = _Backends(10, seed), []
    Pipeline(_Plan(k), b, first_step=0, total=steps, version=10, calibrate_inline=inline).run(
        lambda partial, times, metrics: got.append(partial) or True)
    return b, got


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", range(5))
def test_the_lag_bound_holds_in_every_interleaving(k, seed):
    steps = 8
    b, got = _pipelined(k, steps, seed, inline=bool(seed % 2))
    assert [p["step"] for p in got] == list(range(steps))  # every step once, in order
    assert [p["weight_version"] for p in got] == list(range(10, 10 + steps))
    lags = [p["metrics"]["weight_lag_max"] for p in got]
    assert max(lags) <= k
    if k:  # generation ran ahead of training: some step trained on an older version's samples
        assert max(lags) >= 1
    assert [e[1] for e in b.log if e[0] == "generate"] == list(range(steps))  # each generated once: none was
    # too stale and had to be generated again
    assert b.rollout == 10 + steps  # run() returns once the rollout side holds the last version
    assert [e[1] for e in b.log if e[0] == "refit"] == list(range(11, 11 + steps))  # refits in version order


def test_k0_makes_the_synchronous_calls_in_the_synchronous_order():
    sync = _Backends(10, 0)
    for step in range(5):
        run_step(_Plan(0), sync, step, sync.trainer)
    b, _ = _pipelined(0, 5, seed=1)
    assert b.log == sync.log


def test_a_failure_on_the_rollout_thread_reaches_the_caller():
    b = _Backends(10, 0)

    def broken(prompts, version, *, step, n, temperature):
        if step == 2:
            raise RuntimeError("replica on fire")
        return _Backends.generate(b, prompts, version, step=step, n=n, temperature=temperature)

    b.generate = broken
    with pytest.raises(RuntimeError, match="replica on fire"):
        Pipeline(_Plan(1), b, first_step=0, total=5, version=10, calibrate_inline=True).run(lambda *a: True)
    assert b.trainer <= 12  # nothing trained past the failed rollout


def test_a_step_is_graded_while_the_next_one_generates():
    """The reward thread (issue 52): with k = 1, step 0's grading waits until step 1's generation has begun — which
    only a pipeline that grades beside generating can get past — and a failure there reaches the caller."""
    b = _Backends(10, 0)
    began = {s: threading.Event() for s in range(3)}
    generate = b.generate

    def marked(prompts, version, *, step, n, temperature):
        began[step].set()
        return generate(prompts, version, step=step, n=n, temperature=temperature)

    def score(pairs):
        step = int(pairs[0][0].prompt[1:].split("-")[0])
        if step == 0:
            assert began[1].wait(10), "step 0 was graded only after generation stopped"
        return _Backends.score(b, pairs)

    b.generate, b.score = marked, score
    got = []
    Pipeline(_Plan(1), b, first_step=0, total=3, version=10, calibrate_inline=True).run(
        lambda partial, times, metrics: got.append(partial) or True)
    assert [p["step"] for p in got] == [0, 1, 2]

    def broken(pairs):
        raise RuntimeError("judge on fire")

    b2 = _Backends(10, 0)
    b2.score = broken
    with pytest.raises(RuntimeError, match="judge on fire"):
        Pipeline(_Plan(1), b2, first_step=0, total=3, version=10, calibrate_inline=True).run(lambda *a: True)
    assert b2.trainer == 10  # nothing trained on ungraded samples
