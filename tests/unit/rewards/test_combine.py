"""How the rule's rewards and a reward model's scores make a step's rewards (issue 52): the gate, the weighted mix,
an unscored sample ungraded (None, never 0), and the step's ``reward/*`` metrics of them."""

from __future__ import annotations

import pytest

from fp8rl.data import Problem
from fp8rl.data.grading import CORRECT_REWARD
from fp8rl.rewards.combine import combined, mix_rewards, model_metrics, needs_model, pairwise_scores
from fp8rl.rewards.items import ModelItem, ModelScore, item_of


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
    assert "reward/model_agreement" not in m  # not compared: not measured


def test_agreement_of_the_fp8_model_with_itself_in_bf16():
    scores = [ModelScore(1.0, compared=True, reference=1.0), ModelScore(0.0, compared=True, reference=1.0),
              ModelScore(None, "x", compared=True, reference=None), ModelScore(0.5, compared=True, reference=None),
              None]
    m = model_metrics([1.0] * 5, scores, 1.0)
    assert m["reward/model_agreement"] == 2 / 4  # the same score, or both unscored
    assert m["reward/model_abs_diff_mean"] == 0.5  # over the two items both scored: |1-1| and |0-1|


def test_an_items_question_is_the_prompt_or_a_chats_last_user_turn():
    assert item_of(Problem("2+2=", "4"), "4").question == "2+2="
    chat = Problem([("system", "be brief"), ("user", "first"), ("assistant", "ok"), ("user", "2+2?")], "4")
    assert item_of(chat, "4") == item_of(chat, "4") and item_of(chat, "4").question == "2+2?"
    assert item_of(chat, "four").answer == "4"


def _items(*responses):
    return [ModelItem("q", r) for r in responses]


def test_pairwise_scores_are_mean_wins_over_both_orders():
    def longer(batch):  # a judge that prefers the longer response, and says nothing of equal lengths
        return [ModelScore(float(len(i.response) > len(i.other)), tokens=1) if len(i.response) != len(i.other)
                else ModelScore(None, "a tie") for i in batch]

    items = _items("a", "bbb", "cc", "dd", "e")
    got = pairwise_scores([[0, 1, 2], [3]], 5, longer, items)
    assert [g.score if g else None for g in got[:3]] == [0.0, 1.0, 0.5]  # ranked by length, both orders counted
    assert got[3].score is None and "no other response" in got[3].error and got[4] is None
    assert got[0].tokens == 2  # the comparisons it led

    def first(batch):  # a judge that always prefers whatever it reads first: the bias cancels
        return [ModelScore(1.0) for _ in batch]

    assert [g.score for g in pairwise_scores([[0, 1, 2, 3]], 4, first, items)] == [0.5] * 4
    ties = pairwise_scores([[2, 3]], 5, longer, items)  # every comparison unscored: unscored, with the reason
    assert ties[2].score is None and ties[2].error == "a tie"


def test_mix_rewards_asks_only_what_the_gate_lets_through_and_pairs_within_groups():
    seen = []

    def judge(batch):
        seen.extend(batch)
        return [ModelScore(0.25) for _ in batch]

    items = _items("w", "x", "y", "z")
    rules = [1.0, 0.0, 1.0, 1.0]
    rewards, m = mix_rewards(items, rules, judge, gate=True, rule_weight=0.0, model_weight=1.0)
    assert rewards == [0.25, 0.0, 0.25, 0.25] and [i.response for i in seen] == ["w", "y", "z"]
    seen.clear()
    rewards, m = mix_rewards(items, rules, judge, gate=True, rule_weight=0.0, model_weight=1.0, pairwise=True, group=2)
    # groups (w, x) and (y, z): x is gated out, so w has no one to compare with; y and z compare both ways
    assert sorted((i.response, i.other) for i in seen) == [("y", "z"), ("z", "y")]
    assert rewards[0] is None and rewards[1] == 0.0 and rewards[2] == rewards[3] == pytest.approx(0.5)
    assert m["reward/model_unscored"] == 1.0
