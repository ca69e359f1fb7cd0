"""The policy as its own judge (``follow_policy``, issue 52), with a generate function standing in for the rollout
side (the real paths: the loop's engine in ``tests/e2e/test_reward_models.py``, the stack's replicas in
``tests/integration/controller/test_reward_model_stack.py``): the prompts it sends, an item that does not parse
generated again with the next seed, inputs past the policy's context unscored, n samples averaged."""

from __future__ import annotations

from fp8rl.config import parse_job_config
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.rewards.items import ModelItem
from fp8rl.rewards.judge import render_judge_prompt
from fp8rl.rewards.policy_judge import PolicyJudge

TOK = CharTokenizer()


def _cfg(**model):
    return parse_job_config({"reward": {"model": {"kind": "judge", "follow_policy": True, "template": "{response}",
                                                  "max_new_tokens": 8, **model}}}).reward.model


def test_it_sends_the_rendered_prompts_and_retries_what_does_not_parse_with_the_next_seed():
    calls = []

    def generate(prompts, n, seed):  # item "a" is judged 1 at once; "b" writes nothing parsable until seed 8
        calls.append((len(prompts), n, seed))
        outs = []
        for k, p in enumerate(prompts):
            text = "\\boxed{1}" if TOK.decode(p).endswith("a") or seed >= 8 else "hmm"
            outs += [(k, TOK.encode(text, add_bos=False))] * n
        return outs

    judge = PolicyJudge(_cfg(n=2), TOK, generate, max_len=64, attempts=3, seed=7)
    got = judge.score([ModelItem("q", "a"), ModelItem("q", "b")])
    assert [g.score for g in got] == [1.0, 1.0]
    assert calls == [(2, 2, 7), (1, 2, 8)]  # b alone, again, with the next seed
    assert got[1].unparsable == 2 and got[1].tokens == 2 * 3 + 2 * 9  # both rounds' samples counted
    assert render_judge_prompt(TOK, "{response}", question="q", response="a", answer="") == TOK.encode("a")


def test_inputs_past_the_policys_context_are_unscored_and_never_sent():
    sent = []
    judge = PolicyJudge(_cfg(), TOK, lambda prompts, n, seed: sent.extend(prompts) or [], max_len=16, attempts=2)
    got = judge.score([ModelItem("q", "x" * 9)])  # BOS + 9 > 16 - 8
    assert got[0].score is None and "past the limit of 8" in got[0].error and sent == []
