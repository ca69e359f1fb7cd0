"""LLM-as-judge prompts and parse rules (issue 52): the template filled in and rendered by the judge's chat template
(as ``apply_chat_template`` renders one user turn); each parse rule's score of a judge's text — the *last* match,
divided by the scale's top, None for anything that does not parse (never 0); verdict probabilities as the value-
weighted share of the verdict words' first tokens."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.model.tokenizer import CharTokenizer, load_tokenizer
from fp8rl.presets.chatml import build_chatml_tokenizer
from fp8rl.rewards.judge import parse_judge_output, render_judge_prompt, verdict_first_tokens, verdict_prob_scores

YES_NO = {"yes": 1.0, "no": 0.0}


@pytest.mark.parametrize("text,parse,max_score,want", [
    ("so \\boxed{0} ... wait, \\boxed{1}", "boxed", 1.0, 1.0),  # the last box
    ("\\boxed{7}", "boxed", 10.0, 0.7),
    ("\\boxed{0.25}", "boxed", 1.0, 0.25),
    ("\\boxed{11}", "boxed", 10.0, None),  # past the scale's top
    ("\\boxed{-1}", "boxed", 1.0, None),
    ("\\boxed{yes}", "boxed", 1.0, None),  # not a number
    ("no box here: 1", "boxed", 1.0, None),
    ("Score: 3 ... final score = 8", "score", 10.0, 0.8),
    ("SCORE:10", "score", 10.0, 1.0),
    ("I would score it highly", "score", 10.0, None),
    ("Yes, at first. On reflection: no.", "verdict", 1.0, 0.0),  # the last verdict word
    ("The answer is INCORRECT", "verdict", 1.0, 0.0),  # whole words: "correct" is not found inside it
    ("The answer is correct.", "verdict", 1.0, 1.0),
    ("maybe", "verdict", 1.0, None),
])
def test_each_rule_reads_the_last_verdict_or_gives_none(text, parse, max_score, want):
    verdicts = {"correct": 1.0, "incorrect": 0.0} if "orrect" in text.lower() else YES_NO
    got = parse_judge_output(text, parse, verdicts=verdicts, max_score=max_score)
    assert got == (pytest.approx(want) if want is not None else None)


def test_verdict_prob_reads_no_text():
    with pytest.raises(ValueError, match="reads no judge text"):
        parse_judge_output("yes", "verdict_prob", verdicts=YES_NO)


def test_the_template_is_rendered_as_one_user_turn_by_the_chat_template(tmp_path):
    tok = load_tokenizer(build_chatml_tokenizer(tmp_path))
    template = "Q: {question}\nA: {response}\nRef: {answer}\nVerdict?"
    ids = render_judge_prompt(tok, template, question="1+1", response="2", answer="2")
    want = tok.hf_tokenizer.apply_chat_template([{"role": "user", "content": "Q: 1+1\nA: 2\nRef: 2\nVerdict?"}],
                                                add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids, skip_special=False) == want
    plain = CharTokenizer()  # no chat template: BOS + the text
    assert render_judge_prompt(plain, "{question}={response}", question="1+1", response="2", answer="") == \
        plain.encode("1+1=2")


def test_verdict_probabilities_are_the_value_weighted_share_of_the_verdict_tokens():
    tok = CharTokenizer()
    tokens = verdict_first_tokens(tok, {"1": 1.0, "0": 0.0, "5": 0.5})
    one, zero, half = tok.encode("1", add_bos=False)[0], tok.encode("0", add_bos=False)[0], \
        tok.encode("5", add_bos=False)[0]
    logits = torch.full((2, tok.vocab_size), -5.0)
    logits[0, [one, zero, half]] = torch.tensor([2.0, 0.0, 1.0])
    logits[1, one] = 50.0
    got = verdict_prob_scores(logits, tokens)
    e = [math.exp(2.0), math.exp(0.0), math.exp(1.0)]
    assert got[0] == pytest.approx((e[0] * 1.0 + e[2] * 0.5) / sum(e), rel=1e-12)
    assert got[1] == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="same token"):
        verdict_first_tokens(tok, {"yes": 1.0, "yeah": 0.5})
