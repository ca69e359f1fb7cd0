"""Sampling-parameter bounds, and engines that stop when their caller is gone (``should_stop``)."""

import math

import pytest
import torch

from fp8rl.engines import Cancelled, SamplingParams, TorchRolloutEngine, TorchTrainer, TrainerConfig, build_train_batch
from fp8rl.fp8 import Fp8Recipe, recipe_for_role
from fp8rl.limits import GREEDY_TEMPERATURE, MAX_TEMPERATURE


class StopAfter:
    """A ``should_stop`` that says stop on its ``n``-th poll (and counts the polls)."""

    def __init__(self, n: int) -> None:
        self.n, self.polls = n, 0

    def __call__(self) -> bool:
        self.polls += 1
        return self.polls >= self.n


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -0.5, MAX_TEMPERATURE * 1.01])
def test_temperature_must_be_finite_and_in_range(bad):
    with pytest.raises(ValueError, match=r"temperature must be finite and in \[0, 100\]"):
        SamplingParams(temperature=bad)


@pytest.mark.parametrize("bad", [math.nan, 0.0, -0.1, 1.5])
def test_top_p_must_be_in_unit_interval(bad):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=bad)


def test_tiny_temperatures_are_greedy(policy, prompts):
    assert SamplingParams(temperature=1e-300).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_TEMPERATURE).temperature == GREEDY_TEMPERATURE
    eng = TorchRolloutEngine(policy, Fp8Recipe(linear="bf16"), eos_token_ids=[2], pad_token_id=0)
    tiny = eng.generate(prompts, SamplingParams(temperature=1e-300, max_tokens=6, seed=1))
    greedy = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, seed=2))
    assert [s.token_ids for s in tiny] == [s.token_ids for s in greedy]
    assert all(math.isfinite(lp) for s in tiny for lp in s.logprobs)


def test_generate_stops_between_decode_steps_and_frees_the_engine(policy, prompts):
    eng = TorchRolloutEngine(policy, Fp8Recipe(linear="bf16"), eos_token_ids=[], pad_token_id=0)
    stop = StopAfter(3)
    with pytest.raises(Cancelled, match="generation stopped"):
        eng.generate(prompts, SamplingParams(max_tokens=100, n=8), should_stop=stop)
    assert stop.polls == 3  # polled once per decode step, stopped on the third
    assert len(eng.generate(prompts[:1], SamplingParams(max_tokens=2), should_stop=lambda: False)) == 1


def test_train_step_stopped_between_micro_batches_changes_nothing(policy, prompts):
    eng = TorchRolloutEngine(policy, recipe_for_role("bf16", "rollout"), eos_token_ids=[2], pad_token_id=0)
    samples = eng.generate(prompts, SamplingParams(max_tokens=6, n=4, seed=0))
    batch = build_train_batch(samples, torch.rand(len(samples), dtype=torch.float64), 4, pad_id=0)
    tr = TorchTrainer(policy, recipe_for_role("bf16", "trainer"), TrainerConfig(lr=1e-2, micro_batch_size=4))
    before = {k: v.clone() for k, v in tr.state_dict().items()}
    assert math.ceil(batch.input_ids.shape[0] / 4) > 2
    # the update's prev logprobs come from its own forwards (one update per step): no logprob pass before it
    assert tr.fuses_logprob_pass(batch)
    stop = StopAfter(2)  # inside the update's micro-batches, one forward and backward done
    with pytest.raises(Cancelled, match="training step stopped"):
        tr.train_step(batch, should_stop=stop)
    assert tr.version == 0 and all(torch.equal(v, before[k]) for k, v in tr.state_dict().items())
    assert batch.prev_logprobs is None  # a stopped step leaves no half-filled logprobs behind
    with pytest.raises(Cancelled):
        tr.compute_logprobs(batch, should_stop=lambda: True)
    tr.train_step(batch, should_stop=lambda: False)
    assert tr.version == 1
