"""How the rule's rewards and a reward model's scores make a step's rewards (issue 52): the gate, the weighted mix,
an unscored sample ungraded (None, never 0), and the step's ``reward/*`` metrics of them."""

from __future__ import annotations

import pytest

from fp8rl.data import Problem
from fp8rl.data.grading import CORRECT_REWARD
from fp8rl.rewards.combine import combined, model_metrics, needs_model
from fp8rl.rewards.items import ModelScore, item_of


def test_the_gate_the_mix_and_an_unscored_sample():
    mix = dict(rule_weight=1.0, model_weight=3.0)
    assert not needs_model(0.0, gate=True) and not needs_model(CORRECT_REWARD, gate=True)
    assert needs_model(1.0, gate=True) and needs_model(0.0, gate=False)
    assert combined(0.0, None, gate=True, **mix) == 0.0  # the gate closed: 0, the model never asked
    assert combined(1.0, ModelScore(0.6), gate=True, **mix) == pytest.approx((1.0 + 3 * 0.6) / 4)
    assert combined(0.0, ModelScore(0.6), gate=False, **mix) == pytest.approx(3 * 0.6 / 4)
    assert combined(1.0, ModelScore(None, "did not parse"), gate=True, **mix) is None  # ungraded, not 0
    assert combined(0.0, ModelScore(0.2), gate=False, rule_weight=0.0, model_weight=1.0) == 0.2


def test_the_steps_metrics():
    rules = [1.0, 0.0, 1.0, 1.0]
    scores = [ModelScore(0.5, "", 10, 0), None, ModelScore(1.0, "", 6, 1), ModelScore(None, "x", 4, 2)]
    m = model_metrics(rules, scores, 2.0)
    assert m["reward/rule_mean"] == 0.75 and m["reward/gate_open_fraction"] == 0.75
    assert (m["reward/model_scored"], m["reward/model_unscored"]) == (2.0, 1.0)
    assert (m["reward/judge_tokens"], m["reward/judge_unparsable_samples"]) == (20.0, 3.0)
    assert m["reward/model_mean"] == 0.75 and m["reward/model_std"] == 0.25
    assert (m["reward/model_min"], m["reward/model_max"]) == (0.5, 1.0) and m["reward/model_items_per_s"] == 1.5
    assert "reward/model_mean" not in model_metrics([0.0], [ModelScore(None, "x")], 1.0)


def test_an_items_question_is_the_prompt_or_a_chats_last_user_turn():
    assert item_of(Problem("2+2=", "4"), "4").question == "2+2="
    chat = Problem([("system", "be brief"), ("user", "first"), ("assistant", "ok"), ("user", "2+2?")], "4")
    assert item_of(chat, "4") == item_of(chat, "4") and item_of(chat, "4").question == "2+2?"
    assert item_of(chat, "four").answer == "4"
