"""A job's plan: where prompts come from, how they are split, advantages, step summaries, and which job
settings are baked into the deployed services (what :mod:`fp8rl.controller.step` needs of a job).

Everything here is a pure function of the job config (and of the step index), so a controller
restarted mid-job draws exactly the batches it would have drawn (DESIGN §3). The gRPC side lives in
``services/controller``; it calls these and never computes anything itself.
"""

from __future__ import annotations

import logging
import re
import statistics
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8rl.config import ConfigError, DataConfig, JobConfig
from fp8rl.config.fields import short
from fp8rl.config.schema import GENERATED_TASKS
from fp8rl.data import ArithDataset, DataRoot, EpochBatches, Problem, check_data_path, read_problems
from fp8rl.data.grading import CORRECT_REWARD  # re-exported: the validation and the reports read it here
from fp8rl.data.shapes import ShapesDataset
from fp8rl.model.tokenizer import Tokenizer, chat_template_of, load_tokenizer, render_chat_prompt
from fp8rl.presets import PRESETS, prepare_preset
from fp8rl.rl import grpo_advantages
from fp8rl.rl.shaping import overlong_penalty

__all__ = [
    "CORRECT_REWARD", "DEPLOYMENT_KEYS", "DeploymentMismatchError", "JobPlan", "Split", "check_data",
    "check_deployment", "deployment_mismatch", "encode_prompt", "env_tasks", "eval_problems", "graded_advantages",
    "group_advantages", "load_split", "load_job_tokenizer", "model_config_of", "model_max_positions", "new_job_id",
    "problem_source", "reward_summary", "sampling_seed", "split_evenly",
]

log = logging.getLogger(__name__)


# Settings each service reads from its own --config at startup (the model, the numerics, the loss and
# optimizer, the calibration): a submitted job must agree with the deployment on all of them, or the
# trainer would silently train with other settings than the job asks for. Everything else (steps,
# batch shape, sampling length, data, grader, checkpoint cadence) is the controller's, per job.
DEPLOYMENT_KEYS = (
    "policy.model", "policy.generation.backend", "policy.generation.temperature", "policy.generation.vllm_cfg",
    "policy.training", "policy.numerics", "policy.router_replay", "loss", "calibration",
    "reward.model",  # the reward services load it at start: bound only for a job they serve it to (_served_model)
)


# ... except these: the controller passes calibration.site per call (TrainStepRequest.calibrate_scales), and
# loss.loss_agg_norm_tokens is compared by its effective value (unset, it is policy.generation.max_new_tokens)
PER_JOB_KEYS = ("calibration.site", "loss.loss_agg_norm_tokens")


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
    rm = job.reward.model
    served = rm.kind is not None and not rm.follow_policy  # the job scores with the reward services' model
    for key in sorted(theirs, key=lambda k: (k != "policy.model", k)):
        if key.startswith("reward.model.") and not served:
            continue  # rule grading alone, or the policy as judge: the services' reward model is not used
        if _bound(key) and mine.get(key) != theirs[key]:
            return (f"{key}: the job sets {short(mine.get(key))} but the deployed services run {short(theirs[key])}; "
                    f"this setting is fixed when the services start — submit the job with the deployed value, "
                    f"or redeploy the services with this job file")
    if job.loss_agg_norm_tokens != deployed.loss_agg_norm_tokens:  # unset, it follows max_new_tokens (per job)
        return (f"loss.loss_agg_norm_tokens: the job's seq-mean-token-sum-norm constant is "
                f"{job.loss_agg_norm_tokens} but the deployed trainer divides by {deployed.loss_agg_norm_tokens} "
                f"(unset, it is policy.generation.max_new_tokens); set loss.loss_agg_norm_tokens: "
                f"{deployed.loss_agg_norm_tokens}")
    return None


class DeploymentMismatchError(ValueError):
    """A job asks for a model / precision recipe / setting other than the deployed services run."""


def check_deployment(job: JobConfig, deployed: JobConfig) -> None:
    """Raise :class:`DeploymentMismatchError` (naming the key) unless ``job`` can run on ``deployed``."""
    why = deployment_mismatch(job, deployed)
    if why:
        raise DeploymentMismatchError(why)


def check_data(job: JobConfig, data: DataRoot) -> None:
    """Refuse (:class:`fp8rl.data.DataFileError`) a ``jsonl`` or ``dataset`` job whose ``data.path`` or
    ``data.validation_path`` is outside ``data``'s root, of no known format, not a regular file (an Arrow dataset:
    a directory of them) or over its byte limit — without reading rows (they are read when the job runs)."""
    d = job.data
    if d.task in GENERATED_TASKS:  # generated tasks: no file
        return
    fmt = "jsonl" if d.task == "jsonl" else None  # jsonl: JSON lines whatever the name
    check_data_path(data, d.path, "data.path", fmt)
    if d.validation_path is not None:
        check_data_path(data, d.validation_path, "data.validation_path", fmt)


def encode_prompt(tok: Tokenizer, problem: Problem, data: DataConfig) -> list[int]:
    """Prompt token ids (without EOS) of one problem, the one tokenization rule: a chat-message prompt, or any
    prompt with ``data.chat_template``, is rendered by the tokenizer's chat template (system prompt
    ``data.system_prompt``, generation prompt added) and encoded without an extra BOS (the template writes its own
    specials); a text prompt otherwise is BOS + the text."""
    if problem.is_chat or data.chat_template:
        return tok.encode(render_chat_prompt(tok, problem.prompt, data.system_prompt), add_bos=False)
    return tok.encode(problem.prompt)


@dataclass(frozen=True)
class Split:
    """A data file's problems after ``data.max_prompt_tokens``, how many of the rows read it dropped, and the rows as
    read (before the cap; a validation split taken from the training file reuses the training split's)."""

    problems: list[Problem]
    dropped: int
    read: list[Problem] = field(default_factory=list, repr=False)


def load_split(job: JobConfig, split: str, data: DataRoot | None = None, tok: Tokenizer | None = None, *,
               rows: list[Problem] | None = None) -> Split:
    """The ``train`` or ``validation`` problems of a ``jsonl`` / ``dataset`` job, in file order.

    ``train`` is every row of ``data.path``; ``validation`` the first ``job.eval_size`` rows of
    ``data.validation_path`` (unset: of ``data.path``). Paths are under ``data``'s root (default: the working
    directory), within its byte and row limits. With ``data.max_prompt_tokens`` prompts longer than that (as
    :func:`encode_prompt` encodes them with ``tok``, default the job's tokenizer) are dropped and counted.
    ``rows``: the file's rows already read (a training split's ``read``), so the file is not read again.

    Raises:
        ConfigError: chat-message prompts, but ``tok`` (when given or needed) has no chat template.
        ValueError: a bad file or row (:func:`fp8rl.data.load_problems`), or no problem left.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"load_split: split must be 'train' or 'validation', got {split!r}")
    d = data or DataRoot()
    cfg = job.data
    key = "data.validation_path" if split == "validation" and cfg.validation_path is not None else "data.path"
    path = cfg.validation_path if key == "data.validation_path" else cfg.path
    limit = job.job.eval_size if split == "validation" else None
    cap = cfg.max_prompt_tokens
    if rows is None:
        rows = read_problems(d, path, key=key, fmt="jsonl" if cfg.task == "jsonl" else None,
                             prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, limit=None if cap else limit)
    problems = rows if cap or limit is None else rows[:limit]
    if cap is not None:
        tok = tok or load_job_tokenizer(job)
    if tok is not None and chat_template_of(tok) is None:
        first = next((i for i, p in enumerate(problems) if p.is_chat), None)
        if first is not None:
            raise ConfigError(f"{key}: the prompts of {path!r} are chat messages (problem {first} is), but the "
                              f"tokenizer of policy.model {job.policy.model!r} has no chat template: name a text "
                              f"field with data.prompt_key, or use a model with a chat template")
    dropped = 0
    if cap is not None:
        kept = []
        for p in problems:
            if limit is not None and len(kept) >= limit:
                break
            if len(encode_prompt(tok, p, cfg)) <= cap:
                kept.append(p)
            else:
                dropped += 1
        problems = kept
    if not problems:
        why = f" ({dropped} longer than data.max_prompt_tokens={cap} tokens were dropped)" if dropped else ""
        raise ValueError(f"{key}: {path!r} holds no problems{why}")
    return Split(problems, dropped, rows)


def _epoch_batches(job: JobConfig, problems: list[Problem]) -> EpochBatches:
    return EpochBatches(problems, job.grpo.num_prompts_per_step, job.job.seed, job.data.shuffled)


def problem_source(job: JobConfig, data: DataRoot | None = None,
                   tok: Tokenizer | None = None) -> Callable[[int], list[Problem]]:
    """``batch(step)`` → the step's ``grpo.num_prompts_per_step`` problems; deterministic in (job, step).

    ``data.task: arith`` draws from :class:`ArithDataset` (seeded by ``job.seed``); ``jsonl`` and ``dataset``
    visit :func:`load_split`'s ``train`` problems epoch by epoch (:class:`fp8rl.data.EpochBatches`): each epoch
    a fresh permutation seeded by (``job.seed``, epoch) when ``data.shuffle`` (unset: ``dataset`` only), else
    file order.
    """
    n = job.grpo.num_prompts_per_step
    if job.data.task == "arith":
        arith = ArithDataset(job.arith_config(), seed=job.job.seed)
        return lambda step: arith.batch(step, n)
    if job.data.task == "env":
        return lambda step: env_tasks(job, n, job.job.seed * _ENV_SEED_STRIDE + step)
    if job.data.task == "shapes":
        shapes = ShapesDataset(job.job.seed)
        return lambda step: shapes.batch(step, n)
    return _epoch_batches(job, load_split(job, "train", data, tok).problems)


_ENV_SEED_STRIDE = 1 << 24  # per-step task seeds of one job seed: more than limits.MAX_JOB_STEPS apart
_ENV_EVAL_SEED = 1 << 60  # the validation tasks' seed stream, apart from every step's


def env_tasks(job: JobConfig, n: int, seed: int) -> list[Problem]:
    """``n`` tasks that ``env.name``'s environment generates from ``seed`` (``data.task: env``), as problems
    (question, answer): what :func:`fp8rl.envs.trajectory.run_trajectories` hands ``env.reset``."""
    from fp8rl.envs import resolve

    return [Problem(str(t["question"]), str(t["answer"])) for t in resolve(job.env.name).generate_tasks(n, seed)]


def eval_problems(job: JobConfig, data: DataRoot | None = None, tok: Tokenizer | None = None) -> list[Problem]:
    """``job.eval_size`` validation problems (arith: the eval seed stream; jsonl, dataset: :func:`load_split`'s
    ``validation``, the first rows of ``data.validation_path`` or else of ``data.path``)."""
    size = job.job.eval_size
    if job.data.task == "arith":
        return ArithDataset(job.arith_config(), seed=job.job.seed).eval_set(size)
    if job.data.task == "env":
        return env_tasks(job, size, _ENV_EVAL_SEED + job.job.seed)
    if job.data.task == "shapes":
        return ShapesDataset(job.job.seed).eval_set(size)
    return load_split(job, "validation", data, tok).problems


def _prompt_images(job: JobConfig):
    """The :class:`~fp8rl.model.image_inputs.PromptImages` of a vision-language policy, None for a text model (and
    for a directory that holds only a tokenizer, which the plan alone can run on)."""
    try:
        cfg = model_config_of(job)
    except FileNotFoundError:
        return None
    if not cfg.family.vision:
        return None
    from fp8rl.model.image_inputs import PromptImages, VisionProcessor

    model = job.policy.model
    path = prepare_preset(model, progress=False) if model in PRESETS else Path(model)
    return PromptImages(VisionProcessor.from_model_dir(path, cfg.vision_config), cfg)


def model_config_of(job: JobConfig):
    """The policy's :class:`~fp8rl.model.config.ModelConfig` (its checkpoint's config.json; a vision-language
    checkpoint's text tower with ``policy.language_model_only``), read without the weights."""
    from fp8rl.model.hf_io import read_model_config

    model = job.policy.model
    path = prepare_preset(model, progress=False) if model in PRESETS else Path(model)
    return read_model_config(path, language_model_only=job.policy.language_model_only)


def model_max_positions(job: JobConfig) -> int:
    """The policy's context (``max_position_embeddings``): what bounds a multi-turn trajectory where the
    controller drives the turns."""
    return model_config_of(job).max_position_embeddings


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


def group_advantages(rewards: Sequence[float], group_size: int, leave_one_out: bool = True,
                     normalize_std: bool = True) -> list[float]:
    """GRPO advantages of prompt-major rewards (``group_size`` samples per prompt), as floats; ``normalize_std``
    divides by the group's reward std (``grpo.normalize_rewards``)."""
    adv = grpo_advantages(torch.tensor(list(rewards), dtype=torch.float64), group_size, leave_one_out=leave_one_out,
                          normalize_std=normalize_std)
    return [float(a) for a in adv]


def graded_advantages(rewards: Sequence[float | None], group_size: int, leave_one_out: bool = True,
                      normalize_std: bool = True) -> list[float | None]:
    """:func:`group_advantages` where some rewards are None (ungraded: an environment failed): each group's
    advantages are computed over its graded members only (a lone graded member gets 0), and an ungraded one's
    advantage is None — it is left out of the loss, and its missing reward moves no other's baseline."""
    if all(r is not None for r in rewards):
        return group_advantages(rewards, group_size, leave_one_out, normalize_std)  # type: ignore[arg-type]
    out: list[float | None] = [None] * len(rewards)
    for start in range(0, len(rewards), group_size):
        idx = [k for k in range(start, start + group_size) if rewards[k] is not None]
        advs = group_advantages([rewards[k] for k in idx], len(idx), leave_one_out, normalize_std) \
            if len(idx) > 1 else [0.0] * len(idx)
        for k, a in zip(idx, advs, strict=True):
            out[k] = a
    return out


def reward_summary(rewards: Sequence[float | None]) -> dict[str, float]:
    """``reward_mean`` and ``accuracy`` (share of rewards above :data:`CORRECT_REWARD`) of one step, over the graded
    rewards (None: ungraded, left out)."""
    rewards = [r for r in rewards if r is not None]
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
        dropped_prompts: ``{"train": n, "validation": m}``, the problems ``data.max_prompt_tokens`` dropped from
            the training data and from the rows the validation set was taken from (0 when none, for arith, or
            when no validation set is loaded).

    ``data`` confines and bounds a ``jsonl`` / ``dataset`` job's data files (see :class:`fp8rl.data.DataRoot`).
    ``with_eval_set``: load the validation set even when ``job.eval_every`` is 0 (the in-process loop validates
    at the start and the end anyway); None: only when it is not.
    """

    def __init__(self, job_id: str, job: JobConfig, data: DataRoot | None = None, *,
                 with_eval_set: bool | None = None) -> None:
        self.job_id, self.job = job_id, job
        self.total = job.job.steps
        self.group = job.grpo.num_generations_per_prompt
        self.leave_one_out = job.grpo.leave_one_out
        self.normalize_rewards = job.grpo.normalize_rewards
        # DAPO: generation rounds per step (1: no dynamic sampling), overlong filtering and reward shaping
        self.max_gen_rounds = job.grpo.dynamic_sampling_max_gen_batches if job.grpo.use_dynamic_sampling else 1
        self.overlong_filtering = job.grpo.overlong_filtering
        self.max_new_tokens = job.policy.generation.max_new_tokens
        self.reward_shaping = job.grpo.reward_shaping
        self.temperature = job.policy.generation.temperature
        a = job.grpo.async_grpo
        self.async_grpo = a.enabled
        self.max_weight_lag = a.max_weight_lag if a.enabled else 0
        self.fp8_kv = job.fp8_recipe("rollout").fp8_kv
        self.tok = load_job_tokenizer(job)
        if job.data.chat_template and chat_template_of(self.tok) is None:
            raise ConfigError(f"data.chat_template: true, but the tokenizer of policy.model {job.policy.model!r} "
                              f"has no chat template (set data.chat_template: false)")
        self.eval_every = job.job.eval_every
        self.dropped_prompts = {"train": 0, "validation": 0}
        validating = bool(self.eval_every) if with_eval_set is None else with_eval_set
        self.env = job.env.spec()  # multi-turn trajectories (None: single-turn samples)
        self.images = _prompt_images(job)  # a vision-language policy's image prompts (None: a text model)
        if job.data.task == "shapes" and self.images is None:
            raise ConfigError(f"data.task: shapes is a picture task; policy.model {job.policy.model!r} is not a "
                              f"vision-language model (tiny-vl is one)")
        if job.data.task in GENERATED_TASKS:
            self.batch = problem_source(job, data)
            self.eval_set = eval_problems(job, data) if validating else []
        else:
            train = load_split(job, "train", data, self.tok)
            self.batch = _epoch_batches(job, train.problems)
            same_file = job.data.validation_path is None  # then its rows are the training file's, read once
            val = load_split(job, "validation", data, self.tok, rows=train.read if same_file else None) \
                if validating else Split([], 0)
            self.eval_set = val.problems
            seen: set[tuple[bytes, ...]] = set()  # validation rows taken from the training file: checked once
            self._check_images(train.problems, job.data.path, seen)
            self._check_images(val.problems, job.data.validation_path or job.data.path, seen)
            self.dropped_prompts = {"train": train.dropped, "validation": val.dropped}
            log.info("job %s: %d training problems from %s (%s; one epoch = %.1f steps), %d validation problems; "
                     "dropped over data.max_prompt_tokens=%s: %d training, %d validation", job_id,
                     len(train.problems), job.data.path, "shuffled per epoch" if job.data.shuffled else "file order",
                     len(train.problems) / job.grpo.num_prompts_per_step, len(val.problems),
                     job.data.max_prompt_tokens, train.dropped, val.dropped)

    def shaped_rewards(self, rewards: Sequence[float], samples: Sequence) -> list[float]:
        """The rewards advantages are computed from: the graded ``rewards`` of ``samples`` (``(prompt index,
        sample)``), plus DAPO's overlong penalty when ``grpo.reward_shaping.enabled``."""
        rs = self.reward_shaping
        if not rs.enabled:
            return list(rewards)
        return [None if r is None else r + overlong_penalty(len(s.token_ids), self.max_new_tokens,
                                                            rs.overlong_buffer_length, rs.overlong_buffer_penalty)
                for r, (_, s) in zip(rewards, samples, strict=True)]

    def refill(self, step: int, round_: int) -> list[Problem]:
        """The problems dynamic sampling draws in round ``round_`` (>= 1) of step ``step``: a data file's seeded draw
        outside the step's own batch (:meth:`fp8rl.data.EpochBatches.refill`); the arithmetic task's batch at
        :meth:`refill_index` (every index draws fresh problems)."""
        if isinstance(self.batch, EpochBatches):
            return self.batch.refill(step, round_)
        return self.batch(self.refill_index(step, round_))

    def refill_index(self, step: int, round_: int) -> int:
        """The index of round ``round_`` (>= 1) of step ``step``'s dynamic sampling: its sampling seed's step (and the
        arithmetic task's batch): past every step's own (``job.steps``), one block of rounds per step — a pure
        function of (job, step, round), so a step run again draws the same prompts and samples."""
        return self.total + step * (self.max_gen_rounds - 1) + round_ - 1

    def prompts(self, problems: Sequence[Problem]) -> list[list[int]]:
        """Prompt token ids (without EOS) of ``problems``: the one place prompts are tokenized (by
        :func:`encode_prompt`: chat-message prompts, and every prompt with ``data.chat_template``, through the
        tokenizer's chat template; other text prompts as BOS + the text). A multi-turn job's prompts are its
        trajectories' openings: the environment's first messages (reset on the problem) rendered with its tools."""
        if self.env is not None:
            from fp8rl.envs import ChatRenderer, make_env

            renderer, out = ChatRenderer(self.tok), []
            for p in problems:
                env = make_env(self.env.name, **self.env.kwargs)
                out.append(renderer.opening(env.reset({"question": p.prompt, "answer": p.answer}), env.tools()))
            return out
        return [self._encode(p) for p in problems]

    def _encode(self, problem: Problem) -> list[int]:
        if not problem.images:
            return encode_prompt(self.tok, problem, self.job.data)
        if self.images is None:
            raise ConfigError(f"a problem has {len(problem.images)} image(s), but policy.model "
                              f"{self.job.policy.model!r} is not a vision-language model")
        if problem.is_chat or self.job.data.chat_template:  # rendered by the chat template, each picture's
            # placeholder (an image part's) then replaced by its tokens; the template writes its own specials
            text = render_chat_prompt(self.tok, problem.prompt, self.job.data.system_prompt)
            return self.images.prompt(text, problem.images, lambda piece, first: self.tok.encode(piece, add_bos=False))
        return self.images.prompt(problem.prompt, problem.images,
                                  lambda piece, first: self.tok.encode(piece, add_bos=first))

    def _check_images(self, problems: Sequence[Problem], path: str, seen: set) -> None:
        """Every problem's images decoded now, under the limits (processed when a step uses them): a bad one is
        refused before the job runs, naming its problem (:class:`ConfigError`)."""
        from fp8rl.model.image_inputs import ImageError

        for i, p in enumerate(problems):
            if not p.images or p.images in seen:
                continue
            if self.images is None:
                raise ConfigError(f"data.path: {path}: problem {i} has images, but policy.model "
                                  f"{self.job.policy.model!r} is not a vision-language model")
            try:
                self.images.processor.decode(p.images, where=f"{path}: problem {i}")
            except ImageError as e:
                raise ConfigError(f"data: {e}") from None
            seen.add(p.images)

    def image_batches(self, problems: Sequence[Problem]) -> list | None:
        """Per problem its processed images (:class:`~fp8rl.model.vision.ImageBatch`, or None for none); None when
        no problem has any (the rollout then takes none)."""
        if self.images is None or not any(p.images for p in problems):
            return None
        return [self.images.batch(p.images) for p in problems]
