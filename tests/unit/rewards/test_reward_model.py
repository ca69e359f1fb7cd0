"""The served reward model (issue 52) with the tiny-arith preset as judge: its verdict probabilities are those of
the model read independently (each prompt alone through the plain model); items of concurrent callers share a
forward batch; an item it cannot score — an input past the limit, judge text that does not parse, a caller's wait
past its bound — comes back unscored with the reason and the others in its batch are scored; FP8 linears and an FP8
KV cache calibrated on the first batch serve too."""

from __future__ import annotations

import threading

import pytest
import torch

from fp8rl.config import parse_job_config
from fp8rl.presets import load_policy
from fp8rl.rewards.items import ModelItem
from fp8rl.rewards.judge import render_judge_prompt, verdict_first_tokens, verdict_prob_scores
from fp8rl.rewards.model import RewardModel

# FP32 logits of one prompt alone vs in a left-padded batch: op order only, a few ulps; the probabilities are O(1)
PROB_ATOL = 1e-5
TEMPLATE = "{question}{response}="
VERDICTS = {"1": 1.0, "0": 0.0}


def _judge(**model) -> RewardModel:
    cfg = {"kind": "judge", "model": "tiny-arith", "template": TEMPLATE, "parse": "verdict_prob", "verdicts": VERDICTS,
           "precision": "bf16", **model}
    return RewardModel(parse_job_config({"reward": {"model": cfg}}).reward.model)


ITEMS = [ModelItem(f"{a}+{b}=", str(a + b + d)) for a, b, d in ((1, 2, 0), (12, 30, 1), (7, 7, 0), (40, 2, 5))]


def test_verdict_probabilities_are_the_plain_models_of_each_prompt_alone():
    rm = _judge()
    try:
        got = rm.score(ITEMS)
        model, tok, _ = load_policy("tiny-arith")
        tokens = verdict_first_tokens(tok, VERDICTS)
        for item, s in zip(ITEMS, got, strict=True):
            ids = render_judge_prompt(tok, TEMPLATE, question=item.question, response=item.response, answer="")
            with torch.no_grad():
                want = verdict_prob_scores(model(torch.tensor([ids]))[:, -1], tokens)[0]
            assert s.score == pytest.approx(want, abs=PROB_ATOL) and s.error == "" and s.tokens == 0
    finally:
        rm.close()


def test_items_of_concurrent_callers_share_a_batch():
    rm = _judge()
    held, go = threading.Event(), threading.Event()
    compute = rm.compute

    def first_batch_waits(items):
        if not held.is_set():
            held.set()
            go.wait(30)
        return compute(items)

    rm.compute = first_batch_waits
    out: dict[str, list] = {}
    try:
        a = threading.Thread(target=lambda: out.__setitem__("a", rm.score(ITEMS[:1])))
        a.start()
        assert held.wait(30)  # the worker is on caller a's batch; b and c queue meanwhile
        callers = [threading.Thread(target=lambda k=k, its=its: out.__setitem__(k, rm.score(its)))
                   for k, its in (("b", ITEMS[1:3]), ("c", ITEMS[3:]))]
        for t in callers:
            t.start()
        while rm._queue.qsize() < 3:  # both callers' items are queued
            threading.Event().wait(0.01)
        go.set()
        for t in (a, *callers):
            t.join(60)
        assert rm.batch_sizes == [1, 3]  # b's and c's items in one forward
        assert all(s.score is not None for k in "abc" for s in out[k])
    finally:
        go.set()
        rm.close()


def test_what_it_cannot_score_is_unscored_with_the_reason_and_the_rest_is_scored():
    rm = _judge(max_input_tokens=12)
    try:
        long = ModelItem("1+2+3+4+5+6+7=", "28")
        got = rm.score([ITEMS[0], long])
        assert got[0].score is not None
        assert got[1].score is None and "past the limit of 12" in got[1].error
    finally:
        rm.close()
    rm = _judge(parse="boxed", max_new_tokens=4)  # an arithmetic model writes digits, never a \boxed{}
    try:
        got = rm.score(ITEMS[:2])
        assert all(s.score is None and "did not parse (boxed)" in s.error for s in got)
        assert all(s.unparsable == 1 and 1 <= s.tokens <= 4 for s in got)
    finally:
        rm.close()


def test_a_wait_past_its_bound_comes_back_unscored_and_closing_refuses_more():
    rm = _judge()
    go = threading.Event()
    compute = rm.compute
    rm.compute = lambda items: (go.wait(30), compute(items))[1]
    try:
        got = rm.score(ITEMS[:2], timeout_s=0.3)
        assert all(s.score is None and s.error == "timeout: not scored within 0.3 s" for s in got)
        stopped = rm.score(ITEMS[:1], timeout_s=30, should_stop=lambda: True)
        assert stopped[0].score is None and stopped[0].error == "the caller stopped waiting"
    finally:
        go.set()
        rm.close()
    with pytest.raises(RuntimeError, match="closed"):
        rm.score(ITEMS[:1])


def test_agreement_scores_each_batch_with_the_same_model_in_bf16_too():
    rm = _judge(precision="fp8", agreement=True)
    plain = _judge(precision="bf16")
    try:
        got, want = rm.compute(ITEMS), plain.compute(ITEMS)  # one batch, and the same through a bf16 judge
        assert [s.reference for s in got] == [w.score for w in want]  # the same code on the same batch: bitwise
        assert all(s.compared and s.score is not None for s in got)
        assert [s.score for s in got] != [s.reference for s in got]  # FP8 linears round differently
    finally:
        rm.close()
        plain.close()


def test_fp8_linears_and_an_fp8_kv_cache_calibrated_on_the_first_batch_serve():
    rm = _judge(precision="fp8", kv_cache_dtype="fp8")
    try:
        assert rm._master is not None and rm.engine.scales_version is None
        got = rm.score(ITEMS)
        assert all(s.score is not None and 0.0 <= s.score <= 1.0 for s in got)
        assert rm._master is None and rm.engine.scales_version == 0  # calibrated once, the copy dropped
    finally:
        rm.close()
