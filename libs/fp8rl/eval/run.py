"""One policy scored on one validation set by the embedded rollout engine (see the package doc)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from fp8rl.agents import AgentDriver
from fp8rl.config import JobConfig
from fp8rl.controller.plan import encode_prompt, load_split, sampling_seed
from fp8rl.controller.validation import ValidationResult, validate
from fp8rl.data import DataRoot, get_grader
from fp8rl.engines import SamplingParams, TorchRolloutEngine, make_calibrator
from fp8rl.model import CausalLM
from fp8rl.model.tokenizer import Tokenizer, stop_token_ids

log = logging.getLogger(__name__)

__all__ = ["EvalReport", "evaluate_policy"]

CHUNK_PROBLEMS = 32  # problems per generate call: the progress bar's unit of work


@dataclass(frozen=True)
class EvalReport:
    """What :func:`evaluate_policy` measured.

    Attributes:
        result: the validation (greedy accuracy, pass@j, mean@k, per-problem counts).
        dropped: validation rows left out by ``data.max_prompt_tokens``.
        seconds: wall time of the generation and grading.
        max_new_tokens: each answer's token budget (``policy.generation.max_new_tokens``).
    """

    result: ValidationResult
    dropped: int
    seconds: float
    max_new_tokens: int

    def as_dict(self) -> dict:
        r = self.result
        return {"problems": r.problems, "dropped_prompts": self.dropped, "k": r.k, "temperature": r.temperature,
                "max_new_tokens": self.max_new_tokens, **r.metrics(), "seconds": self.seconds}


class _Engine:
    """The :class:`~fp8rl.controller.step.StepBackends` subset a validation calls: the embedded rollout engine and
    the job's grader."""

    def __init__(self, job: JobConfig, rollout: TorchRolloutEngine, tok: Tokenizer) -> None:
        self.job, self.rollout, self.tok = job, rollout, tok
        self.grader = get_grader(job.reward.grader)
        # an agent job: its agent drives the policy through the endpoint, as in training (fp8rl.agents)
        self.agent = None if job.agent.entrypoint is None else AgentDriver(
            job, rollout, tok, vocab_size=rollout.model.config.vocab_size, model_name=job.policy.model,
            grade=self.grader)
        self.wants_problems = self.agent is not None

    def generate(self, prompts, version, *, step, n, temperature, problems=None):
        if self.agent is not None:
            trajs = self.agent.run(problems, prompts, version, n=n, temperature=temperature, tag=f"eval{step}")
            return [(t.prompt_index, t) for t in trajs]
        g = self.job.policy.generation
        params = SamplingParams(temperature=temperature, top_p=g.top_p, max_tokens=g.max_new_tokens, n=n,
                                seed=sampling_seed(self.job.job.seed, step, 0))
        return [(s.prompt_index, s) for s in self.rollout.generate(prompts, params, weight_version=version)]

    def score(self, pairs):
        if self.agent is not None:  # the agent's reward (None: it failed, never counted right)
            return [s.reward for _, s in pairs]
        return [float(self.grader(self.tok.decode(s.token_ids), p.answer)) for p, s in pairs]


def evaluate_policy(policy: CausalLM, tok: Tokenizer, job: JobConfig, data: DataRoot, *,
                    progress: bool = True) -> EvalReport:
    """Validate ``policy`` on ``job``'s validation split (``data.validation_path``, else ``data.path``, under
    ``data``'s root) with ``job``'s rollout recipe, sampling settings, grader and ``eval`` section.

    With an FP8 KV cache the Q/K/V scales are calibrated first on the validation prompts (the policy's own
    version 0, as a job's first calibration). Problems go to the engine :data:`CHUNK_PROBLEMS` at a time (a
    progress bar on stderr), each chunk with its own seed (``validate``'s ``part``): the numbers are a function of
    the policy, the file and the job.
    """
    t0 = time.perf_counter()
    split = load_split(job, "validation", data, tok)
    prompts = [encode_prompt(tok, p, job.data) for p in split.problems]
    recipe = job.fp8_recipe("rollout")
    rollout = TorchRolloutEngine(policy, recipe, eos_token_ids=stop_token_ids(tok), pad_token_id=tok.pad_id,
                                 seed=job.job.seed, max_batch_size=256)
    if recipe.fp8_kv:
        scales = make_calibrator(job, policy, tok.pad_id).calibrate(rollout.weight_version, prompts)
        rollout.load_scales(scales)
    engine, e = _Engine(job, rollout, tok), job.eval
    parts = []
    try:
        with torch.inference_mode(), tqdm(total=len(prompts), desc="eval", unit="problem",
                                          disable=not progress) as bar:
            for lo in range(0, len(prompts), CHUNK_PROBLEMS):
                hi = min(lo + CHUNK_PROBLEMS, len(prompts))
                parts.append(validate(engine, split.problems[lo:hi], prompts[lo:hi], rollout.weight_version, k=e.k,
                                      temperature=e.temperature, part=lo // CHUNK_PROBLEMS))
                bar.update(hi - lo)
    finally:
        if engine.agent is not None:  # the agent's endpoint: its port and thread
            engine.agent.close()
    return EvalReport(ValidationResult.combine(parts), split.dropped, time.perf_counter() - t0,
                      job.policy.generation.max_new_tokens)
