"""A job's plan: where prompts come from, how they are split, advantages, step summaries, and which job
settings are baked into the deployed services (what :mod:`fp8rl.controller.step` needs of a job).

Everything here is a pure function of the job config (and of the step index), so a controller
restarted mid-job draws exactly the batches it would have drawn (DESIGN §3). The gRPC side lives in
``services/controller``; it calls these and never computes anything itself.
"""

from __future__ import annotations

import re
import statistics
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fp8rl.config import ConfigError, JobConfig
from fp8rl.config.fields import short
from fp8rl.data import ArithDataset, DataRoot, Problem, load_jsonl
from fp8rl.model.tokenizer import Tokenizer, chat_template_of, load_tokenizer, render_chat_prompt
from fp8rl.presets import PRESETS, prepare_preset
from fp8rl.rl import grpo_advantages

__all__ = [
    "CORRECT_REWARD", "DEPLOYMENT_KEYS", "DeploymentMismatchError", "JobPlan", "check_data", "check_deployment",
    "deployment_mismatch", "eval_problems", "group_advantages", "load_job_tokenizer", "new_job_id", "problem_source",
    "reward_summary", "sampling_seed", "split_evenly",
]

# A sample counts as correct when its reward exceeds this (graders return 0/1; partial credit is < 1).
CORRECT_REWARD = 0.5

# Settings each service reads from its own --config at startup (the model, the numerics, the loss and
# optimizer, the calibration): a submitted job must agree with the deployment on all of them, or the
# trainer would silently train with other settings than the job asks for. Everything else (steps,
# batch shape, sampling length, data, grader, checkpoint cadence) is the controller's, per job.
DEPLOYMENT_KEYS = (
    "policy.model", "policy.generation.backend", "policy.generation.temperature", "policy.generation.vllm_cfg",
    "policy.training", "policy.numerics", "policy.router_replay", "loss", "calibration",
)


# ... except these, which the controller passes per call (calibration.site: TrainStepRequest.calibrate_scales)
PER_JOB_KEYS = ("calibration.site",)


def _bound(key: str) -> bool:
    return key not in PER_JOB_KEYS and any(key == p or key.startswith(f"{p}.") for p in DEPLOYMENT_KEYS)


def deployment_mismatch(job: JobConfig, deployed: JobConfig) -> str | None:
    """Why ``job`` cannot run on services deployed with ``deployed``, or None when it can.

    The message names the first differing key (the precision recipe first, then the model, then
    the other keys of :data:`DEPLOYMENT_KEYS` in sorted order) with both values.
    """
    if job.recipe != deployed.recipe or job.kv_cache_dtype != deployed.kv_cache_dtype:
        return (f"the job's precision recipe is {job.recipe} with kv_cache_dtype={job.kv_cache_dtype}, but the "
                f"deployed services run {deployed.recipe} with kv_cache_dtype={deployed.kv_cache_dtype} (keys "
                f"policy.generation.vllm_cfg.precision, policy.generation.vllm_cfg.kv_cache_dtype, "
                f"policy.training.megatron_cfg.fp8_cfg.enabled)")
    mine, theirs = job.settings(), deployed.settings()
    for key in sorted(theirs, key=lambda k: (k != "policy.model", k)):
        if _bound(key) and mine.get(key) != theirs[key]:
            return (f"{key}: the job sets {short(mine.get(key))} but the deployed services run {short(theirs[key])}; "
                    f"this setting is fixed when the services start — submit the job with the deployed value, "
                    f"or redeploy the services with this job file")
    return None


class DeploymentMismatchError(ValueError):
    """A job asks for a model / precision recipe / setting other than the deployed services run."""


def check_deployment(job: JobConfig, deployed: JobConfig) -> None:
    """Raise :class:`DeploymentMismatchError` (naming the key) unless ``job`` can run on ``deployed``."""
    why = deployment_mismatch(job, deployed)
    if why:
        raise DeploymentMismatchError(why)


def check_data(job: JobConfig, data: DataRoot) -> None:
    """Refuse (:class:`fp8rl.data.DataFileError`) a ``jsonl`` job whose ``data.path`` is outside ``data``'s
    root, not a regular file or over its byte limit — without reading it (rows are counted when the job runs)."""
    if job.data.task == "jsonl":
        data.check(job.data.path)


def problem_source(job: JobConfig, data: DataRoot | None = None) -> Callable[[int], list[Problem]]:
    """``batch(step)`` → the step's ``grpo.num_prompts_per_step`` problems; deterministic in (job, step).

    ``data.task: arith`` draws from :class:`ArithDataset` (seeded by ``job.seed``); ``jsonl`` cycles
    through the file in order — ``data.path`` under ``data``'s root (default: the working directory),
    within its byte and row limits.
    """
    n = job.grpo.num_prompts_per_step
    if job.data.task == "arith":
        arith = ArithDataset(job.arith_config(), seed=job.job.seed)
        return lambda step: arith.batch(step, n)
    data = data or DataRoot()
    problems = load_jsonl(data.resolve(job.data.path), max_rows=data.max_rows, max_bytes=data.max_bytes)
    if not problems:
        raise ValueError(f"data.path: {job.get('data.path')} holds no problems")
    return lambda step: [problems[(step * n + i) % len(problems)] for i in range(n)]


def eval_problems(job: JobConfig, data: DataRoot | None = None) -> list[Problem]:
    """``job.eval_size`` validation problems (arith: the eval seed stream; jsonl: the file's first rows)."""
    size = job.job.eval_size
    if job.data.task == "arith":
        return ArithDataset(job.arith_config(), seed=job.job.seed).eval_set(size)
    data = data or DataRoot()
    return load_jsonl(data.resolve(job.data.path), limit=size, max_bytes=data.max_bytes)


def load_job_tokenizer(job: JobConfig) -> Tokenizer:
    """The policy's tokenizer (a preset is prepared first if it is not cached yet)."""
    model = job.policy.model
    return load_tokenizer(prepare_preset(model, progress=False) if model in PRESETS else Path(model))


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges cutting ``range(n)`` into ``min(parts, n)`` contiguous, near-equal chunks."""
    if n < 0 or parts < 1:
        raise ValueError(f"split_evenly needs n >= 0 and parts >= 1, got n={n}, parts={parts}")
    parts = min(parts, n) or 1
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def sampling_seed(job_seed: int, step: int, first_prompt: int) -> int:
    """Seed of the Generate call covering prompts from ``first_prompt`` of ``step``.

    With one replica (``first_prompt == 0``) it equals :mod:`fp8rl.loop`'s per-step seed, so the
    in-process loop and the services draw the same samples.
    """
    return job_seed * 1_000_003 + step + 7919 * first_prompt


def group_advantages(rewards: Sequence[float], group_size: int, leave_one_out: bool = True) -> list[float]:
    """GRPO advantages of prompt-major rewards (``group_size`` samples per prompt), as floats."""
    adv = grpo_advantages(torch.tensor(list(rewards), dtype=torch.float64), group_size, leave_one_out=leave_one_out)
    return [float(a) for a in adv]


def reward_summary(rewards: Sequence[float]) -> dict[str, float]:
    """``reward_mean`` and ``accuracy`` (share of rewards above :data:`CORRECT_REWARD`) of one step."""
    if not rewards:
        return {"reward_mean": 0.0, "accuracy": 0.0}
    return {"reward_mean": statistics.fmean(rewards),
            "accuracy": sum(r > CORRECT_REWARD for r in rewards) / len(rewards)}


def new_job_id(name: str) -> str:
    """A fresh job id: the job name made id-safe (letters, digits, ``_.-``), plus 8 random hex digits."""
    stem = re.sub(r"[^A-Za-z0-9_.\-]", "-", name).strip("-_.")[:48] or "job"
    if not stem[0].isalnum():
        stem = f"j{stem}"
    return f"{stem}-{uuid.uuid4().hex[:8]}"


class JobPlan:
    """What a job needs at every step, derived once from its config.

    Attributes:
        job_id, job: the job and its validated config.
        total: ``job.steps``.
        group: ``grpo.num_generations_per_prompt`` (G).
        leave_one_out, temperature: ``grpo.leave_one_out`` and ``policy.generation.temperature``.
        async_grpo, max_weight_lag: whether steps run pipelined (:mod:`fp8rl.controller.pipeline`) and
            ``grpo.async_grpo.max_weight_lag`` (0 when synchronous).
        fp8_kv: whether the rollout runs an FP8 KV cache (then every version needs calibrated scales).
        tok: the policy's tokenizer.
        batch: ``batch(step)`` → the step's problems (see :func:`problem_source`).
        eval_every, eval_set: validation cadence and problems (empty when ``job.eval_every`` is 0).

    ``data`` confines and bounds a ``jsonl`` job's data file (see :class:`fp8rl.data.DataRoot`).
    """

    def __init__(self, job_id: str, job: JobConfig, data: DataRoot | None = None) -> None:
        self.job_id, self.job = job_id, job
        self.total = job.job.steps
        self.group = job.grpo.num_generations_per_prompt
        self.leave_one_out = job.grpo.leave_one_out
        self.temperature = job.policy.generation.temperature
        a = job.grpo.async_grpo
        self.async_grpo = a.enabled
        self.max_weight_lag = a.max_weight_lag if a.enabled else 0
        self.fp8_kv = job.fp8_recipe("rollout").fp8_kv
        self.tok = load_job_tokenizer(job)
        if job.data.chat_template and chat_template_of(self.tok) is None:
            raise ConfigError(f"data.chat_template: true, but the tokenizer of policy.model {job.policy.model!r} "
                              f"has no chat template (set data.chat_template: false)")
        self.batch = problem_source(job, data)
        self.eval_every = job.job.eval_every
        self.eval_set = eval_problems(job, data) if self.eval_every else []

    def prompts(self, problems: Sequence[Problem]) -> list[list[int]]:
        """Prompt token ids (without EOS) of ``problems``: the one place prompts are tokenized.

        With ``data.chat_template`` each prompt is first rendered by the tokenizer's chat template
        (:func:`fp8rl.model.tokenizer.render_chat_prompt`, system prompt ``data.system_prompt``) and encoded
        without an extra BOS (the template writes its own specials); otherwise BOS + the prompt text.
        """
        d = self.job.data
        if d.chat_template:
            return [self.tok.encode(render_chat_prompt(self.tok, p.prompt, d.system_prompt), add_bos=False)
                    for p in problems]
        return [self.tok.encode(p.prompt) for p in problems]
