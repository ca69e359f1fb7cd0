"""The policy as its own judge (``reward.model.follow_policy``): the judge prompts go to the rollout side — the loop's
rollout engine, the stack's rollout replicas — so the judge is the policy at the version the rollout holds and
refits with it, in the rollout's precision (FP8 linears and KV as the job's recipe says). Nothing is loaded for it.

It reads items as the served judge does (the template, rendered by the *policy's* chat template) and parses what it
writes by the same rules (:func:`~fp8rl.rewards.judge.scores_of_outputs`); ``verdict_prob`` is not offered (the
rollout returns the sampled tokens' logprobs, not the verdict words' probabilities). An item whose samples do not
parse is generated again with a new seed, up to ``attempts`` times, then left unscored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fp8rl.config.schema import RewardModelConfig
from fp8rl.model.tokenizer import Tokenizer

from .items import ModelItem, ModelScore
from .judge import render_judge_prompt, scores_of_outputs

__all__ = ["Generate", "PolicyJudge"]

Generate = Callable[[list[list[int]], int, int], list[tuple[int, Sequence[int]]]]
"""``generate(prompts, n, seed)``: ``n`` samples of each prompt at the rollout's current version (``max_new_tokens``
and ``temperature`` the judge's), as ``(prompt index, generated token ids)``."""


class PolicyJudge:
    """``reward.model`` with ``follow_policy``: scores items by the policy's own judgement (module docstring).

    Args:
        cfg: the job's ``reward.model``.
        tok: the policy's tokenizer.
        generate: the rollout side (:data:`Generate`).
        max_len: the policy's context (``max_position_embeddings``).
        attempts: generations an item may take before it is left unscored.
        seed: the first generation's seed (each attempt adds one).
    """

    def __init__(self, cfg: RewardModelConfig, tok: Tokenizer, generate: Generate, *, max_len: int,
                 attempts: int = 1, seed: int = 0) -> None:
        self.cfg, self.tok, self.generate = cfg, tok, generate
        self.limit = min(cfg.max_input_tokens, max_len - cfg.max_new_tokens)
        self.attempts, self.seed = max(1, attempts), seed

    def score(self, items: Sequence[ModelItem]) -> list[ModelScore]:
        cfg = self.cfg
        prompts = [render_judge_prompt(self.tok, cfg.template, question=it.question, response=it.response,
                                       answer=it.answer, other=it.other) for it in items]
        out = [ModelScore(None, f"input of {len(p)} tokens is past the limit of {self.limit} "
                                f"(reward.model.max_input_tokens, and the policy's context)") for p in prompts]
        todo = [i for i, p in enumerate(prompts) if len(p) <= self.limit]
        tokens, unparsable = [0] * len(items), [0] * len(items)  # over every attempt
        for attempt in range(self.attempts):
            if not todo:
                break
            outputs: list[list[tuple[str, int]]] = [[] for _ in todo]
            for k, ids in self.generate([prompts[i] for i in todo], cfg.n, self.seed + attempt):
                outputs[k].append((self.tok.decode(ids), len(ids)))
            got = scores_of_outputs(outputs, cfg.parse, verdicts=cfg.verdict_scores, max_score=cfg.max_score)
            for i, s in zip(todo, got, strict=True):
                tokens[i] += s.tokens
                unparsable[i] += s.unparsable
                out[i] = ModelScore(s.score, s.error, tokens[i], unparsable[i])
            todo = [i for i in todo if out[i].score is None]
        return out
