"""Trajectories across a weight update (issue 50, ``env.partial: interrupt``): a refit between two turns, the
trajectory continuing on the new weights. Every model token keeps the version and the behaviour logprob it was
sampled with; the old version's K/V are recomputed under the new weights (the refit drops the sessions), so under
batch invariance a trainer holding a token's version reproduces that token's rollout logprob bitwise — the tokens
of version 0 under version 0's weights, those of version 1 under version 1's.

The policy and job are :mod:`tests.e2e.test_trajectories`' (a random 2-layer Llama, ChatML characters,
``guess_number``: a random policy runs every trajectory to ``max_turns``).
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.config import ConfigError, parse_job_config
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.envs.trajectory import trajectory_metrics
from fp8rl.loop import GRPOLoop, LoopConfig
from fp8rl.model.hf_io import load_hf_checkpoint

from .test_trajectories import TURNS, _chat_model, _job, _trajectories


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return _chat_model(tmp_path_factory.mktemp("chat-model-interrupt"))


def _version_one(path) -> dict[str, torch.Tensor]:
    """Version 1: version 0's weights moved by seeded noise (what a training step would do, deterministically)."""
    model, _ = load_hf_checkpoint(path)
    g = torch.Generator().manual_seed(11)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def test_a_refit_between_turns_keeps_every_tokens_version_and_logprob_bitwise(chat_model):
    job = parse_job_config(_job(chat_model, env={"partial": "interrupt"},
                                grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2,
                                      "async_grpo": {"enabled": True, "max_weight_lag": 1}},
                                policy__generation={"vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "auto"}}))
    loop = GRPOLoop(LoopConfig(job))
    assert not loop.shares_weights  # asynchronous: the rollout holds its own copy, refit by load_weights
    state1 = _version_one(chat_model)
    real = loop.rollout.generate
    turns = [0]

    def generate(prompts, params, **kw):
        # interrupt: each turn's generate runs under the lock a refit takes, so a refit lands between turns
        assert loop.backends._trajectories.locked()
        if turns[0] == 1:  # the refit, between turn 0 and turn 1
            loop.rollout.load_weights(1, state1)
        turns[0] += 1
        return real(prompts, params, **kw)

    loop.rollout.generate = generate
    trajs = _trajectories(loop)
    versions = [{v for v, m in zip(t.versions, t.token_mask, strict=True) if m} for t in trajs]
    assert all(v == {0, 1} for v in versions) and all(t.turns == TURNS for t in trajs)
    m = trajectory_metrics(trajs)
    assert m["env/interrupted"] == len(trajs) and m["env/versions_per_trajectory"] == 2.0
    model_tokens = [[v for v, k in zip(t.versions, t.token_mask, strict=True) if k] for t in trajs]
    old_tokens = sum(vs.count(0) for vs in model_tokens)  # turn 0's, sampled before the refit
    assert 0 < old_tokens < sum(map(len, model_tokens))
    assert m["env/stale_token_share"] == old_tokens / sum(map(len, model_tokens))
    assert m["env/tokens_per_version"] == sum(map(len, model_tokens)) / (2 * len(trajs))

    batch = build_train_batch(trajs, torch.zeros(len(trajs)), 2, loop.tok.pad_id)
    assert batch.versions.tolist() == [0] * len(trajs)  # a row's version for the lag bound: its oldest token's
    tok_versions = torch.full_like(batch.input_ids, -1)
    for r, t in enumerate(trajs):  # rows are prompt + trajectory tokens, right-padded
        tok_versions[r, len(t.prompt_ids):len(t.prompt_ids) + len(t.versions)] = torch.tensor(t.versions)
    recipe = job.fp8_recipe("trainer")
    model0, _ = load_hf_checkpoint(chat_model)
    model1, _ = load_hf_checkpoint(chat_model)
    model1.load_state_dict(state1)
    lp0 = TorchTrainer(model0, recipe, TrainerConfig(micro_batch_size=8)).compute_logprobs(batch)
    lp1 = TorchTrainer(model1, recipe, TrainerConfig(micro_batch_size=8)).compute_logprobs(batch)
    trained = batch.loss_mask.bool()
    old, new = trained & (tok_versions == 0), trained & (tok_versions == 1)
    assert int(old.sum()) > 10 and int(new.sum()) > 10
    assert torch.equal(lp0[old], batch.gen_logprobs[old]), "version-0 tokens differ from version 0's recompute"
    assert torch.equal(lp1[new], batch.gen_logprobs[new]), "version-1 tokens differ from version 1's recompute"
    assert not torch.equal(lp1[old], batch.gen_logprobs[old])  # the versions really differ (negative control)


def test_interrupt_runs_in_the_asynchronous_loop(chat_model):
    """Three asynchronous steps at max_weight_lag 1 with env.partial interrupt: every row within the lag bound, and
    whatever the refits' timing, no trajectory spans more than the two versions the bound allows."""
    cfg = LoopConfig(parse_job_config(_job(chat_model, job={"steps": 3, "seed": 0, "checkpoint_every": 0},
                                           env={"partial": "interrupt"},
                                           grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2,
                                                 "async_grpo": {"enabled": True, "max_weight_lag": 1}})))
    rows = []
    GRPOLoop(cfg).run_async(3, rows.append)
    assert len(rows) == 3 and all(r["weight_lag_max"] <= 1 for r in rows)
    assert all(1.0 <= r["env/versions_per_trajectory"] <= 2.0 for r in rows)


def test_the_service_stack_admits_interrupt(chat_model):
    # the stack runs it too (tests/integration/controller/test_env_stack.py, the agents tier); admission here
    job = parse_job_config(_job(chat_model, env={"partial": "interrupt"}))
    assert job.env.partial == "interrupt"
    _admit(job)
    with pytest.raises(ConfigError, match="env.partial"):
        parse_job_config(_job(chat_model, env={"partial": "abandon"}))


def _admit(job):
    """The controller's env admission (JobRunner._check_env) without a running stack."""
    from services.controller.runner import JobRunner

    class Refit:
        @staticmethod
        def envs():
            return None

    runner = JobRunner.__new__(JobRunner)
    runner.refit = Refit()
    runner._check_env(job)
