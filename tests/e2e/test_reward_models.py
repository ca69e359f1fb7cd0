"""GRPO steps rewarded by reward models (issue 52), in the in-process loop: a judge (the tiny-arith preset reading
the question and the response, its verdict probability the score) behind the rule grader's gate; a transformers
sequence classifier behind the gate alone; a judge whose output never parses, whose samples are all left out and
counted, never scored 0. The rewards are checked against the step's own metrics: with the gate, a sample the rule
fails scores 0 and one it passes ``(rule_weight + model_weight * score) / (rule_weight + model_weight)``.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.config import parse_job_config
from fp8rl.loop import GRPOLoop, LoopConfig
from fp8rl.model.tokenizer import CharTokenizer

pytestmark = pytest.mark.rewards  # whole loop steps with a second model (about 40 s): make test-rewards

SAMPLES = 4 * 4  # prompts x generations of every job here

# the means below are FP64 sums of FP32-derived scores: equal up to a few ulps of O(1) values
MEAN_ATOL = 1e-9


def _job(model: dict, combine: dict) -> GRPOLoop:
    job = {"job": {"steps": 1}, "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4},
           "reward": {"model": model, "combine": combine}}
    return GRPOLoop(LoopConfig(parse_job_config(job)))


JUDGE = {"kind": "judge", "model": "tiny-arith", "template": "{question}{response}=", "parse": "verdict_prob",
         "verdicts": {"1": 1.0, "0": 0.0}}


def test_a_judge_behind_the_rule_gate_rewards_a_step():
    loop = _job(JUDGE, {"gate": True, "rule_weight": 1.0, "model_weight": 3.0})
    m = loop.step(0)
    passed = round(m["reward/gate_open_fraction"] * SAMPLES)
    assert passed == round(m["reward/rule_mean"] * SAMPLES) > 0  # the warm-started policy gets some right
    assert (m["reward/model_scored"], m["reward/model_unscored"]) == (passed, 0.0)
    want = passed * (1.0 + 3.0 * m["reward/model_mean"]) / 4.0 / SAMPLES  # the failed ones score 0
    assert m["reward_mean"] == pytest.approx(want, abs=MEAN_ATOL)
    assert 0.0 <= m["reward/model_min"] <= m["reward/model_mean"] <= m["reward/model_max"] <= 1.0
    assert loop.trainer.version == 1


def test_a_classifier_behind_the_rule_gate_rewards_a_step(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = CharTokenizer()
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   num_labels=2, pad_token_id=tok.pad_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path)
    tok.save(tmp_path)
    loop = _job({"kind": "classifier", "model": str(tmp_path), "positive_label": 1},
                {"gate": True, "rule_weight": 0.0, "model_weight": 1.0})
    m = loop.step(0)
    passed = round(m["reward/gate_open_fraction"] * SAMPLES)
    assert passed > 0 and m["reward/model_scored"] == passed and m["reward/judge_tokens"] == 0.0
    assert m["reward_mean"] == pytest.approx(passed * m["reward/model_mean"] / SAMPLES, abs=MEAN_ATOL)


def test_a_judge_whose_output_never_parses_leaves_every_sample_out_and_counts_them():
    loop = _job({**JUDGE, "parse": "boxed", "max_new_tokens": 4}, {"gate": False})
    m = loop.step(0)
    assert (m["reward/model_scored"], m["reward/model_unscored"]) == (0.0, SAMPLES)
    assert m["reward/judge_unparsable_samples"] == SAMPLES and m["reward/judge_tokens"] >= SAMPLES
    assert m["reward_mean"] == 0.0 and "reward/model_mean" not in m  # nothing scored: no score learned from
    assert loop.trainer.version == 1  # the step still made its version, on zero advantages


def test_a_pairwise_judge_scores_each_response_against_its_group():
    """Every response compared with the 3 others of its group in both orders: each one's score is its mean win, so
    a group's scores average exactly 1/2 whatever the judge prefers (the wins of a pair sum to 1)."""
    loop = _job({**JUDGE, "pairwise": True, "template": "{response}{other}="}, {"gate": False})
    m = loop.step(0)
    assert (m["reward/model_scored"], m["reward/model_unscored"]) == (SAMPLES, 0.0)
    assert m["reward/model_mean"] == pytest.approx(0.5, abs=MEAN_ATOL) and m["reward/model_std"] > 0


def test_the_policy_as_its_own_judge_follows_its_refits():
    """``follow_policy``: the judge prompts go to the loop's rollout engine — the policy at the version it holds —
    and what it writes is parsed (tiny-arith writes digits: the ``score`` rule finds no ``score: x``, so every sample
    is unscored and counted, its generation tried twice); nothing is loaded for it."""
    loop = _job({"kind": "judge", "follow_policy": True, "template": "{question}{response}=", "parse": "score",
                 "max_new_tokens": 3}, {"gate": False})
    assert not hasattr(loop.reward_model, "net")  # no engine of its own
    seen = []
    generate = loop.rollout.generate
    loop.rollout.generate = lambda prompts, params, **kw: (seen.append(loop.rollout.weight_version),
                                                           generate(prompts, params, **kw))[1]
    for step in range(2):
        m = loop.step(step)
        assert (m["reward/model_scored"], m["reward/model_unscored"]) == (0.0, SAMPLES)
        assert m["reward/judge_unparsable_samples"] == 2 * SAMPLES  # two generations each
    # per step: the policy's rollout, then its two judging rounds — at the version the step started from
    assert seen == [0, 0, 0, 1, 1, 1]
