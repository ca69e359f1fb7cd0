"""The in-process GRPO loop: the same phases as the controller (DESIGN §2), no services.

One step, version v → v+1::

    rollout    the rollout engine samples G responses per prompt at version v
    reward     the grader scores them
    logprobs   the trainer recomputes logprobs at v (prev); mismatch metrics vs the engine's (gen)
    train      group-relative advantages, clipped policy loss with IS correction, AdamW → v+1
    calibrate  Q/K/V amax over this step's sequences under v+1 → FP32 scales of v+1 (FP8 KV only)
    refit      the rollout engine loads v+1's weights and v+1's scales together, in place

Run ``python -m fp8rl.loop --help``; ``--compare`` runs several recipes on the same seed and
prints their mismatch side by side. With ``--out DIR`` the run writes as it goes and checkpoints
(:mod:`fp8rl.rundir`); ``--resume DIR`` continues a stopped run (:func:`run`).

Its configuration (:class:`~fp8rl.loop_config.LoopConfig`, the flags) is :mod:`fp8rl.loop_config`; the step itself is
:mod:`fp8rl.controller.step`, the engines come from :mod:`fp8rl.engines.factory`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from fp8rl import memory
from fp8rl.agents import AgentDriver
from fp8rl.config import ConfigError, JobConfig, load_job_config, recipe_settings, walk
from fp8rl.controller.pictures import sequence_files
from fp8rl.controller.pipeline import Pipeline
from fp8rl.controller.plan import JobPlan, check_data, sampling_seed
from fp8rl.controller.step import PHASES, Trained, run_step
from fp8rl.controller.validation import ValidationResult, validate
from fp8rl.data import ArithDataset, DataFileError, get_grader
from fp8rl.engines import (
    MemoryBudgetError,
    SamplingParams,
    TorchTrainer,
    build_train_batch,
    make_calibrator,
    make_rollout_engine,
    make_trainer_backend,
    replay_route_shape,
    train_on_batch,
)
from fp8rl.envs import ChatRenderer, make_env
from fp8rl.envs.trajectory import TURN_SEED_STRIDE, run_trajectories, trajectories_markdown
from fp8rl.fp8 import RECIPES, QKVScales
from fp8rl.loop_config import LOOP_FLAGS, LoopConfig
from fp8rl.model import model_from_tensors
from fp8rl.model.tokenizer import stop_token_ids
from fp8rl.observatory import ObservatoryConfig, ObservatoryResult, observe
from fp8rl.presets import load_policy
from fp8rl.rewards.combine import mix_rewards
from fp8rl.rewards.items import item_of
from fp8rl.rewards.model import RewardModel
from fp8rl.rewards.policy_judge import PolicyJudge
from fp8rl.rl import MAX_ABS_LOGPROB_DIFF, mismatch_promise
from fp8rl.rundir import LoopState, RunDir, RunDirError

log = logging.getLogger(__name__)

__all__ = ["LOOP_FLAGS", "LoopConfig", "LoopStopped", "GRPOLoop", "build_train_batch", "main", "run"]

class GRPOLoop:
    """Holds the engines of one run; :meth:`step` runs one GRPO step and returns its metrics.

    ``share_weights`` (default: wherever it is safe, the synchronous loop on the torch trainer): the rollout engine
    computes with the trainer's tensors instead of a copy of them (:class:`~fp8rl.engines.TorchRolloutEngine`'s
    ``shared_with``), its refit is then a relabel plus the new FP8 forms; False keeps a copy per role (a refit
    then really moves the weights, which a test of the refit path may need).
    """

    def __init__(self, cfg: LoopConfig, *, share_weights: bool | None = None) -> None:
        with memory.phase("setup"):  # every role's weights and first FP8 forms: step 0's record reports its peak
            self._build(cfg, share_weights)

    def _reward_model(self, job) -> RewardModel | PolicyJudge:
        """``reward.model``: on an engine of its own, or (``follow_policy``) the policy judging on the rollout engine
        at the version it holds."""
        rm = job.reward.model
        if not rm.follow_policy:
            return RewardModel(rm, scaling=self.rollout_recipe.scaling, seed=job.job.seed)

        def generate(prompts, n, seed):
            params = SamplingParams(temperature=rm.temperature, max_tokens=rm.max_new_tokens, n=n, seed=seed)
            return [(s.prompt_index, s.token_ids) for s in self.rollout.generate(prompts, params)]

        return PolicyJudge(rm, self.tok, generate, max_len=self.model_config.max_position_embeddings, attempts=2,
                           seed=job.job.seed)

    def _build(self, cfg: LoopConfig, share_weights: bool | None) -> None:
        self.cfg, self.job = cfg, cfg.job
        job = cfg.job
        torch.manual_seed(job.job.seed)
        policy, self.tok, self.model_path = load_policy(job.policy.model,
                                                        language_model_only=job.policy.language_model_only)
        self.model_config, self.model_name = policy.config, policy.name_or_path
        self.observatory: ObservatoryResult | None = None
        if job.policy.numerics.auto_bf16_layers:
            job = self.job = self._auto_bf16_layers(job, policy)
        self.rollout_recipe = job.fp8_recipe("rollout")
        self.route_shape = replay_route_shape(job, policy.config)
        self.trainer = make_trainer_backend(job, policy, ref_model=policy if job.loss.kl_coef > 0 else None)
        # One copy of the weights for both roles where they never need two versions at once: the synchronous loop
        # generates only between a refit and the next train step (asynchronous GRPO generates beside training).
        can_share = not job.grpo.async_grpo.enabled and isinstance(self.trainer, TorchTrainer) \
            and self.trainer.parallel is None
        if share_weights and not can_share:
            raise ValueError("share_weights needs the synchronous loop on the torch trainer (asynchronous GRPO "
                             "generates while the trainer changes its weights)")
        share = can_share if share_weights is None else share_weights
        self.shares_weights = share
        # the embedded engine whatever policy.generation.backend says (the loop is in process: LoopConfig)
        self.rollout = make_rollout_engine(job.with_settings({"policy.generation.backend": "torch"}), policy, None,
                                           eos_token_ids=stop_token_ids(self.tok), pad_token_id=self.tok.pad_id,
                                           max_batch_size=256, initial_version=0,
                                           shared_with=self.trainer.model if share else None)
        del policy  # the trainer's copy (and the rollout's, when not shared) are all that stay
        # The calibrator runs the trainer's model code forward-only (DESIGN §5).
        self.calibrator = make_calibrator(job, self.trainer.model, self.tok.pad_id)
        # the controller's plan of this job: batches, seeds, group size, validation set
        self.plan = JobPlan("loop", job, cfg.data, with_eval_set=True)  # the loop validates at the start and the end
        self.data = ArithDataset(job.arith_config(), seed=job.job.seed) if job.data.task == "arith" else None
        self.eval_set = self.plan.eval_set
        self.grader = get_grader(job.reward.grader)
        # a reward model (reward.model: a judge or a classifier) on an engine of its own, beside the rule grader
        self.reward_model = self._reward_model(job) if job.reward.model.kind is not None else None
        # multi-turn trajectories (env.name): the environment's messages rendered by the policy's chat template
        self.renderer = ChatRenderer(self.tok) if self.plan.env is not None else None
        self.backends = _InProcess(self)
        first = self.plan.batch(0)
        prompts = self.plan.prompts(first)
        if isinstance(self.trainer, TorchTrainer):  # a batch that cannot fit is refused now, not in step 0's backward
            g = job.grpo
            after = job.env.max_trajectory_tokens if self.plan.env is not None else job.policy.generation.max_new_tokens
            self.trainer.check_memory(g.num_prompts_per_step * g.num_generations_per_prompt,
                                      max(map(len, prompts)) + after, where="the in-process loop")
        if self.rollout_recipe.fp8_kv:  # first calibration: the prompts only, before any refit
            scales = self.calibrator.calibrate(self.trainer.version, prompts, self.plan.image_batches(first))
            self.rollout.load_scales(scales)
            self.backends.hold_scales(scales)

    def _auto_bf16_layers(self, job: JobConfig, policy) -> JobConfig:
        """``policy.numerics.auto_bf16_layers``: the observatory on step 0's prompts (at step 0's group size, tokens
        and seed) picks the bf16 layer counts; the job with them set (both engines are built from it)."""
        g, v, num = job.policy.generation, job.policy.generation.vllm_cfg, job.policy.numerics
        plan = JobPlan("loop", job)
        cfg = ObservatoryConfig(recipe=job.recipe, kv_cache_dtype=v.kv_cache_dtype, fp8_attention=v.fp8_attention,
                                batch_invariant=job.batch_invariant, n=plan.group, max_tokens=g.max_new_tokens,
                                temperature=g.temperature, seed=sampling_seed(job.job.seed, 0, 0),
                                micro_batch_size=job.policy.training.micro_batch_size, target=num.auto_bf16_target,
                                max_bf16_layers=num.auto_bf16_max_layers)
        log.info("auto_bf16_layers: running the mismatch observatory on step 0's prompts (%s, kv=%s, target %.3f)",
                 job.recipe, v.kv_cache_dtype, num.auto_bf16_target)
        with torch.random.fork_rng(devices=[]):  # its trainers seed the global RNG: the run's draws stay the run's
            res = self.observatory = observe(policy, plan.prompts(plan.batch(0)), cfg, pad_token_id=self.tok.pad_id,
                                             eos_token_ids=stop_token_ids(self.tok), name=job.policy.model,
                                             progress=lambda msg: log.debug("observatory: %s", msg))
        s = res.suggestion
        log.info("auto_bf16_layers: num_first_layers_in_bf16=%d num_last_layers_in_bf16=%d (token_mult_prob_error "
                 "%.5f, %s; %.1f s)", s.first, s.last, s.token_mult_prob_error,
                 f"within the target {s.target}" if s.met else
                 f"the best measured with at most {s.max_bf16_layers} bf16 layers: the target {s.target} was not met",
                 res.seconds)
        # the job the engines run: the choice written in, the switch spent (it refuses explicit layer counts)
        return job.with_settings({"policy.generation.vllm_cfg.num_first_layers_in_bf16": s.first,
                                  "policy.generation.vllm_cfg.num_last_layers_in_bf16": s.last,
                                  "policy.numerics.auto_bf16_layers": False})

    def restore(self, checkpoint: str | Path, state: LoopState) -> None:
        """Continue from a checkpoint of this run (:func:`run` with ``resume``): the trainer's weights, AdamW state,
        RNG and version from ``checkpoint``, and the rollout engine refitted to that version with its QKV scales
        (``state.qkv_scales``)."""
        self.trainer.load_checkpoint(str(checkpoint))
        v = self.trainer.version
        if v != state.version:
            raise RunDirError(f"{checkpoint} holds weight version {v}, its loop state says {state.version}")
        scales = None
        if self.rollout_recipe.fp8_kv:
            if not state.qkv_scales:
                raise RunDirError(f"the loop state of {checkpoint} has no QKV scales, and this job's KV cache is FP8")
            scales = QKVScales.from_tensor(v, torch.tensor(state.qkv_scales))
        with memory.phase("refit"):
            if self.shares_weights:
                self.rollout.follow(v, scales)
            else:
                self.rollout.load_weights(v, self.trainer.state_dict(), scales)
        self.backends.restart(scales)

    def export_policy(self, out: str | Path, *, fmt: str = "hf") -> Path:
        """The trainer's current weights as an HF model directory ``out`` (:func:`fp8rl.export.save_policy_hf`:
        safetensors, config, tokenizer with its chat template, generation config; ``fmt`` ``hf-fp8``: the Hub's
        blockwise FP8 layout of the trainer's recipe); replaced when it exists."""
        from fp8rl.export import save_policy_hf  # safetensors writing only when a policy is written

        lora = self.job.lora_settings()
        if lora is None:
            tensors = {k: v for k, v in self.trainer.state_dict().items() if ".kv_quant." not in k}
        else:  # the adapters merged into the base as loaded (the trainer holds it in FP8 only)
            from fp8rl.export.peft import merged_with_base

            tensors = merged_with_base(self.job.policy.model, self.trainer.state_dict(adapters_only=True), lora,
                                       recorded_checksum=None, where="the in-process loop")
        policy = model_from_tensors(self.model_config, tensors)
        policy.name_or_path = self.model_name
        return save_policy_hf(policy, self.model_path, out, fmt=fmt, recipe=self.job.fp8_recipe("trainer"),
                              force=True).out

    def eval_due(self, step: int, steps: int) -> bool:
        """Whether a validation runs after ``step`` (every ``job.eval_every`` steps; the last is measured by
        :func:`run` itself)."""
        every = self.job.job.eval_every
        return bool(every) and (step + 1) % every == 0 and step + 1 < steps

    def evaluate(self) -> ValidationResult:
        """Validation of the version the rollout engine holds (deployed numerics) on the validation set: greedy
        accuracy, and with ``eval.k`` samples per problem pass@j and mean@k (:func:`fp8rl.controller.validation.
        validate`, the controller's)."""
        e = self.job.eval
        with memory.phase("validation"):
            return validate(self.backends, self.eval_set, self.plan.prompts(self.eval_set),
                            self.rollout.weight_version, k=e.k, temperature=e.temperature)

    def task_problems(self, limit: int = 4096) -> list:
        """The task's distinct problems: every one its generator draws in ``limit`` draws, deduplicated by prompt
        (for a small task, e.g. tiny-arith's two operands up to 9, the whole population)."""
        return list({p.prompt: p for p in self.data.eval_set(limit)}.values())

    def solve_rates(self, problems, *, n: int, temperature: float, seed: int = 0) -> list[float]:
        """Per problem, the fraction of ``n`` rollout-engine samples the grader scores right.

        The rollout engine answers at the version it holds (deployed numerics: what a refit
        delivered, not the trainer's copy); ``seed`` fixes the sampler, so an unchanged engine
        gives the same rates.
        """
        prompts = self.plan.prompts(problems)
        g = self.job.policy.generation
        params = SamplingParams(temperature=temperature, top_p=g.top_p, max_tokens=g.max_new_tokens, n=n, seed=seed)
        right = [0] * len(problems)
        for s in self.rollout.generate(prompts, params, weight_version=self.rollout.weight_version):
            right[s.prompt_index] += self.grader(self.tok.decode(s.token_ids), problems[s.prompt_index].answer)
        return [r / n for r in right]

    def step(self, step: int) -> dict[str, float]:
        """One GRPO step (:func:`fp8rl.controller.step.run_step`, the controller's code) on this loop's engines."""
        partial, times, _ = run_step(self.plan, self.backends, step, self.trainer.version)
        # what the rollout engine holds after the refit (DESIGN §3: weights and scales of one version together)
        held = {"rollout/weight_version": self.rollout.weight_version,
                "rollout/scales_version": self.rollout.scales_version if self.rollout_recipe.fp8_kv else -1}
        return self._row(partial, times, held)

    def _row(self, partial: dict, times: dict, extra: dict) -> dict[str, float]:
        times = {p: times.get(p, 0.0) for p in PHASES}
        total = sum(times.values())
        return {"step": partial["step"], "weight_version": partial["new_version"],
                "rollout/served_version": partial["served_version"], **extra,
                "reward_mean": partial["reward_mean"], "accuracy": partial["accuracy"], **partial["metrics"],
                **{f"time/{k}": v for k, v in times.items()}, "time/step": total,
                "calibrate_share": times["calibrate"] / total, **memory.step_memory()}

    def run_async(self, steps: int, on_step: Callable[[dict], None], *, first_step: int = 0) -> None:
        """Steps ``first_step .. steps-1`` of asynchronous GRPO (:class:`fp8rl.controller.pipeline.Pipeline`, the
        controller's driver): rollout and refit on their own threads, training here. ``on_step(row)`` after each
        step; ``row["val_accuracy"]`` is filled (after waiting for that version's refit) on evaluation steps."""
        pipe = Pipeline(self.plan, self.backends, first_step=first_step, total=steps, version=self.trainer.version,
                        calibrate_inline=True)  # the calibrator reads the trainer's live weights
        t_prev = [time.perf_counter()]

        def record(partial: dict, times: dict, metrics: dict) -> bool:
            now = time.perf_counter()
            row = self._row(partial, times, {"time/wall": now - t_prev[0], **metrics})
            t_prev[0] = now
            if self.eval_due(partial["step"], steps):
                pipe.wait_held(partial["new_version"])
                row.update(self.evaluate().metrics())
            on_step(row)
            return True

        pipe.run(record)


class _InProcess:
    """The loop's :class:`~fp8rl.controller.step.StepBackends`: the engines, called directly."""

    def __init__(self, loop: GRPOLoop) -> None:
        self.loop = loop
        self._scales: dict[int, object] = {}  # version -> its QKV scales, until its refit
        self._trainer_scales: dict[int, object] = {}  # version -> its scales, until the trainer trains on it
        self._calibrated: dict[int, object] = {}  # the last two versions' scales (a checkpoint takes its version's)
        self._weights: dict[int, dict] = {}  # async: version -> a copy of its weights, until its refit
        # env.partial finish: a refit waits for the trajectories in flight (each is sampled by one version);
        # interrupt: for the turn in flight
        self._trajectories = threading.Lock()
        # generate() is handed the problems (the tasks): multi-turn jobs (an environment, or the user's agent)
        self.graded = loop.plan.env is not None or loop.job.agent.entrypoint is not None  # trajectories carry rewards
        self.wants_problems = self.graded or loop.plan.images is not None  # (a vision-language job's: their images)
        self.last_trajectories: list = []  # a few of the latest step's trajectories (multi-turn jobs)
        self.last_pictures: list = []  # a few (problem, sample) of the latest generation with pictures
        self._agent: AgentDriver | None = None  # agent jobs: the endpoint and the user's function (first step on)
        self.reward_metrics: dict[str, float] = {}  # a reward model's reward/* of the latest score() call

    def restart(self, scales) -> None:
        """Forget every version's scales but ``scales``' (a resumed run's: its checkpoint's version)."""
        self._scales.clear()
        self._trainer_scales.clear()
        self._calibrated.clear()
        if scales is not None:
            self.hold_scales(scales)

    def scales_of(self, version: int):
        """The QKV scales calibrated for ``version`` (one of the last two calibrated), for a checkpoint."""
        return self._calibrated[version]

    def hold_scales(self, scales) -> None:
        """Keep ``scales`` for the trainer's pass at that version (trainer-side FP8 KV only)."""
        self._calibrated[scales.version] = scales
        for old in sorted(self._calibrated)[:-2]:
            del self._calibrated[old]
        if getattr(self.loop.trainer, "needs_qkv_scales", False):
            self._trainer_scales[scales.version] = scales

    def generate(self, prompts, version, *, step, n, temperature, problems=None):
        job = self.loop.job
        if self.loop.plan.env is not None:
            return self._trajectories_of(problems, version, step=step, n=n, temperature=temperature)
        if job.agent.entrypoint is not None:
            return self._agent_trajectories(problems, prompts, version, step=step, n=n, temperature=temperature)
        params = SamplingParams(temperature=temperature, top_p=job.policy.generation.top_p,
                                max_tokens=job.policy.generation.max_new_tokens, n=n,
                                seed=sampling_seed(job.job.seed, step, 0))
        images = self.loop.plan.image_batches(problems) if problems is not None else None
        with memory.phase("rollout"):  # (a vLLM engine takes no images argument)
            out = [(s.prompt_index, s) for s in self.loop.rollout.generate(
                prompts, params, weight_version=version, **({"images": images} if images is not None else {}))]
        if images is not None:  # what the report shows: a few pictures, each with its prompt's first sample
            self.last_pictures = [(problems[i], s) for i, s in out[::n] if problems[i].images][:4]
        return out

    def _trajectories_of(self, problems, version, *, step, n, temperature):
        """``n`` multi-turn trajectories of every problem (:func:`fp8rl.envs.trajectory.run_trajectories`), each
        turn one batched generate at ``version``; the environment's reward rides on each."""
        loop, job = self.loop, self.loop.job
        spec, g = loop.plan.env, job.policy.generation
        base = sampling_seed(job.job.seed, step, 0)

        interrupt = job.env.partial == "interrupt"

        def generate_turn(prompts, max_tokens, turn, keys):
            params = SamplingParams(temperature=temperature, top_p=g.top_p, max_tokens=max_tokens, n=1,
                                    seed=base + TURN_SEED_STRIDE * turn)
            # each trajectory's K/V is kept between its turns: only the new tokens are prefilled (bitwise the same
            # under batch invariance; fp8rl.engines.kv_sessions). interrupt: a refit may come between turns, and a
            # turn runs at whatever version is served then (a session of an older version is not reused: its
            # K/V are recomputed under the new weights)
            if interrupt:
                with self._trajectories:
                    return loop.rollout.generate(prompts, params, sessions=keys)
            return loop.rollout.generate(prompts, params, weight_version=version, sessions=keys)

        tasks = [{"question": p.prompt, "answer": p.answer} for p in problems]
        # finish: a refit waits for every trajectory in flight; interrupt: only for the turn in flight
        with contextlib.nullcontext() if interrupt else self._trajectories, memory.phase("rollout"):
            trajs = run_trajectories(tasks, n, spec, lambda: make_env(spec.name, **spec.kwargs), loop.renderer,
                                     generate_turn, max_context=loop.rollout.max_len,
                                     decode=lambda ids: loop.tok.decode(ids, skip_special=False),
                                     stop_ids=stop_token_ids(loop.tok), release=loop.rollout.drop_session)
        self.last_trajectories = trajs[:4]  # what the report shows
        return [(t.prompt_index, t) for t in trajs]

    def _agent_trajectories(self, problems, prompts, version, *, step, n, temperature):
        """``n`` trajectories of every problem, each the session of one call of the user's agent
        (:class:`fp8rl.agents.AgentDriver`) on the loop's endpoint, its calls pinned to ``version`` and sampled at
        the step's ``temperature`` (the agent may not choose another: the trained logprobs are of it)."""
        loop = self.loop
        if self._agent is None:
            self._agent = AgentDriver(loop.job, loop.rollout, loop.tok, vocab_size=loop.model_config.vocab_size,
                                      model_name=loop.model_name, grade=loop.grader)
        with self._trajectories, memory.phase("rollout"):  # a refit waits for the agents in flight
            trajs = self._agent.run(problems, prompts, version, n=n, temperature=temperature, tag=f"s{step}")
        self.last_trajectories = trajs[:4]  # what the report shows
        return [(t.prompt_index, t) for t in trajs]

    def score(self, pairs):
        if self.graded:  # the environment / agent graded each trajectory (None: it failed, ungraded)
            return [s.reward for _, s in pairs]
        loop = self.loop
        with memory.phase("reward"):
            texts = [loop.tok.decode(s.token_ids) for _, s in pairs]
            rules = [float(loop.grader(t, p.answer)) for t, (p, _) in zip(texts, pairs, strict=True)]
            if loop.reward_model is None:
                return rules
            c = loop.job.reward.combine
            out, self.reward_metrics = mix_rewards(
                [item_of(p, t) for (p, _), t in zip(pairs, texts, strict=True)], rules, loop.reward_model.score,
                gate=c.gate, rule_weight=c.rule_weight, model_weight=c.model_weight,
                pairwise=loop.job.reward.model.pairwise, group=loop.plan.group)
            return out

    def train(self, version, step, rows, *, max_weight_lag=0):
        loop = self.loop
        if loop.trainer.version != version:
            raise RuntimeError(f"step {step} expects the trainer at version {version}, it holds {loop.trainer.version}")
        batch = build_train_batch([s for _, s, _ in rows], None, loop.plan.group, loop.tok.pad_id,
                                  advantages=torch.tensor([a for _, _, a in rows], dtype=torch.float64),
                                  route_shape=loop.route_shape)
        if getattr(loop.trainer, "needs_qkv_scales", False):  # the rollout's scales of the version it recomputes
            loop.trainer.load_qkv_scales(self._trainer_scales.pop(version))
        from_logprobs = loop.rollout_recipe.fp8_kv and loop.job.calibration_site[0] == "logprobs"
        out = train_on_batch(loop.trainer, batch, max_weight_lag=max_weight_lag,
                             record_qkv=loop.calibrator if from_logprobs else None)
        if out.qkv_scales is not None:  # the new version's scales, from the logprob pass: calibrate() keeps them
            self._scales[out.qkv_scales.version] = out.qkv_scales
            self.hold_scales(out.qkv_scales)
        t = time.perf_counter()
        if loop.plan.async_grpo:  # "publish": the refit thread loads this copy while the trainer moves on
            with memory.phase("publish"):
                self._weights[loop.trainer.version] = {k: v.detach().clone()
                                                       for k, v in loop.trainer.state_dict().items()}
        return Trained(loop.trainer.version, out.metrics, {"logprobs": out.logprobs_s, "train": out.train_s,
                                                           "publish": time.perf_counter() - t})

    def calibrate(self, version, sequences, *, pictures=None):
        if version in self._scales:  # recorded in the step's logprob pass (calibration.site logprobs)
            return
        images = None
        if pictures is not None:  # a vision-language step: each sequence with its prompt's images
            images = [self.loop.plan.images.batch(files) for files in sequence_files(pictures, len(sequences))]
        with memory.phase("calibrate"):
            self._scales[version] = self.loop.calibrator.calibrate(version, sequences, images)
        self.hold_scales(self._scales[version])

    def await_refit(self, version):
        loop = self.loop
        scales = self._scales.pop(version, None) if loop.rollout_recipe.fp8_kv else None
        with self._trajectories, memory.phase("refit"):
            if loop.shares_weights:  # the rollout computes with the trainer's tensors: the new version's FP8 forms
                loop.rollout.follow(version, scales)
            else:
                loop.rollout.load_weights(version, self._weights.pop(version, None) or loop.trainer.state_dict(),
                                          scales)
        return {}


class LoopStopped(Exception):
    """A signal (SIGINT, SIGTERM) stopped the run; :func:`run` wrote what it had before passing this on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run(cfg: LoopConfig, *, progress: bool = True, loop: GRPOLoop | None = None, resume: bool = False) -> dict:
    """Run ``cfg.steps`` steps; return ``{"config", "steps": [...], "summary": {...}}``.

    With ``cfg.out_dir`` the run directory (:mod:`fp8rl.rundir`) exists from the start, each step's row is appended
    to its ``metrics.jsonl`` as the step ends, the trainer checkpoints every ``job.checkpoint_every`` steps and at
    the end, and the report and ``summary.json`` are rewritten at each checkpoint, at the end, and when a signal
    stops the run (:class:`LoopStopped` then propagates). ``resume``: continue the run in ``cfg.out_dir`` from its
    newest checkpoint — the synchronous loop then runs, sample for sample, what the run that was never stopped
    ran (the data order and every sampler seed are functions of the step; weights, AdamW and the RNG come from
    the checkpoint); an asynchronous run restarts its pipeline at the checkpoint's version (which rollouts overlap
    which step depends on timing, so no two asynchronous runs with a lag are the same run). A run that stopped
    before its first checkpoint kept nothing but its job: it starts over from step 0 (logged as a warning).

    ``loop`` is an already built :class:`GRPOLoop` of ``cfg`` to run (e.g. to measure its engines
    before and after); by default one is built.
    """
    rd = RunDir(cfg.out_dir) if cfg.out_dir else None
    if resume and rd is None:
        raise ValueError("resume needs the run's directory (cfg.out_dir)")
    state = rd.resume() if resume else None
    if resume and state is None:
        log.warning("%s holds no checkpoint (the run stopped before its first, due every job.checkpoint_every=%d "
                    "steps), so nothing but its job was kept: starting the run over from step 0", cfg.out_dir,
                    cfg.job.job.checkpoint_every)
    if rd is not None and state is None:
        rd.start(cfg.job.to_yaml(), data_root=cfg.data_root)
    if loop is None:
        loop = GRPOLoop(cfg)
    elif loop.cfg != cfg:
        raise ValueError("run(cfg, loop=...) needs the loop built from the same cfg")
    if rd is not None and loop.job != cfg.job and state is None:  # auto_bf16_layers chose: a resume runs the choice
        rd.start(loop.job.to_yaml(), data_root=cfg.data_root)
    history: list[dict] = []
    restarted: dict = {}
    if state is not None:
        loop.restore(rd.checkpoints / state.checkpoint, state)
        history, val, first = state.history, state.validation, state.next_step
        # what the stopped run had begun past its checkpoint, run again (the plan is a function of the step: no
        # problem is skipped and none is trained twice; the rollouts are regenerated, not restored)
        redone = min(rd.steps_redone, cfg.steps - first)
        restarted = {"resume/steps_redone": redone,
                     "resume/rollouts_restarted": redone * loop.plan.group * cfg.job.grpo.num_prompts_per_step}
        log.info("resuming %s at step %d of %d (weight version %d): %d step(s) begun after the checkpoint run "
                 "again, %d rollouts (samples or trajectories) restarted", cfg.out_dir, first, cfg.steps,
                 state.version, redone, restarted["resume/rollouts_restarted"])
    else:
        first = 0
        val = {0: loop.evaluate().metrics()}  # steps done -> the validation's metrics
    t_run = time.perf_counter()
    every = cfg.job.job.checkpoint_every

    def write(*, stopped: bool = False) -> dict:
        summary = _summary(cfg, loop, history, val, time.perf_counter() - t_run, ran=len(history) - first,
                           stopped=stopped)
        summary.update(restarted)
        if rd is not None and history:
            _write_report(cfg, loop, rd, history, val, summary)
        return summary

    def done(m: dict) -> None:
        if not history:  # the report plots the validation before training at step 0
            m["validation_start"] = val[0]
        if "val_accuracy" in m:
            val[m["step"] + 1] = {k: v for k, v in m.items() if k in ("val_accuracy", "val_weight_version")
                                  or k.startswith("val/")}
        history.append(m)
        bar.set_postfix(reward=f"{m['reward_mean']:.2f}", err=f"{m['token_mult_prob_error']:.4f}",
                        max_dlogp=f"{m[MAX_ABS_LOGPROB_DIFF]:.1e}")  # 0.0e+00: bitwise the rollout's
        bar.update()
        if rd is None:
            return
        with _whole():  # a signal now stops the run after the row (and the checkpoint) are written
            rd.append(m)
            n = m["step"] + 1
            if every and n % every == 0 and n < cfg.steps:
                _checkpoint(loop, rd, n, history, val, finished=False)
                write()

    bar = tqdm(total=cfg.steps, initial=first, desc=f"grpo {cfg.recipe_label} kv={cfg.kv_cache_dtype}"
               + (f" async k={loop.plan.max_weight_lag}" if loop.plan.async_grpo else ""),
               disable=not progress, unit="step", file=sys.stderr)
    try:
        if loop.plan.async_grpo:
            loop.run_async(cfg.steps, done, first_step=first)
        else:
            for step in range(first, cfg.steps):
                m = loop.step(step)
                if loop.eval_due(step, cfg.steps):
                    m.update(loop.evaluate().metrics())
                done(m)
        bar.close()
        val[cfg.steps] = loop.evaluate().metrics()
        history[-1].update(val[cfg.steps])  # the last step's row carries the final validation
    except (LoopStopped, MemoryBudgetError):  # a signal, or a step's batch refused before its work
        bar.close()
        write(stopped=True)
        if rd is not None:
            rd.close()
        raise
    summary = _summary(cfg, loop, history, val, time.perf_counter() - t_run, ran=len(history) - first)
    summary.update(restarted)
    result = {"config": cfg.as_dict(), "steps": history, "validation": val, "summary": summary}
    if rd is not None:
        rd.scalars(history[-1]["step"], val[cfg.steps])
        rd.close()
        if every:
            _checkpoint(loop, rd, cfg.steps, history, val, finished=True)
        _write_report(cfg, loop, rd, history, val, summary)  # metrics.jsonl rewritten whole: the final validation too
        policy = loop.export_policy(rd.path / "policy")  # the trained policy, as transformers and vLLM load it
        log.info("the trained policy (version %d) is an HF model directory: %s", loop.trainer.version, policy)
    return result


def _checkpoint(loop: GRPOLoop, rd: RunDir, next_step: int, history: list[dict], val: dict, *,
                finished: bool) -> None:
    """The trainer's checkpoint and the loop's state after ``next_step`` steps (:meth:`RunDir.save`)."""
    t = time.perf_counter()
    v = loop.trainer.version
    scales = loop.backends.scales_of(v) if loop.rollout_recipe.fp8_kv else None
    state = LoopState(next_step=next_step, version=v, checkpoint=f"trainer-v{v}.pt", history=history,
                      validation=val, finished=finished,
                      qkv_scales=None if scales is None else scales.to_tensor().tolist())
    with memory.phase("checkpoint"):
        path = rd.save(loop.trainer, state)
    log.info("checkpoint after step %d: %s (%.1f s)", next_step, path, time.perf_counter() - t)


def _write_report(cfg: LoopConfig, loop: GRPOLoop, rd: RunDir, history: list[dict], val: dict, summary: dict) -> None:
    from fp8rl.report import job_facts, write_pictures, write_report  # matplotlib only when a report is asked for

    write_report(history, rd.path, title=f"in-process GRPO, {cfg.recipe_label}, kv={cfg.kv_cache_dtype}",
                 observatory=loop.observatory, facts=job_facts(cfg.job, in_process=True), tensorboard=False)
    if loop.backends.last_trajectories:  # multi-turn: a few trajectories, model and environment tokens told apart
        RunDir._write(rd.path / "trajectories.md", trajectories_markdown(
            loop.backends.last_trajectories, lambda ids: loop.tok.decode(ids, skip_special=False),
            title=f"Trajectories of the last step ({cfg.job.env.name or cfg.job.agent.entrypoint})"))
    if loop.backends.last_pictures:  # a vision-language job: a few pictures with the answers sampled for them
        answers = [(p, loop.tok.decode(s.token_ids)) for p, s in loop.backends.last_pictures]
        write_pictures(rd.path, [(p.images, p.prompt, p.answer, a, bool(loop.grader(a, p.answer)))
                                 for p, a in answers])
    RunDir._write(rd.path / "summary.json", json.dumps({"config": cfg.as_dict(), "summary": summary,
                                                        "validation": val}, indent=2))


def _summary(cfg: LoopConfig, loop: GRPOLoop, history: list[dict], val: dict, wall: float, *, ran: int,
             stopped: bool = False) -> dict:
    """The run's summary over the finished steps (``stopped``: a signal ended it after ``len(history)`` steps);
    ``wall`` is this process's time for the ``ran`` steps it ran (a resumed run's first steps ran before)."""
    done = len(history)
    summary: dict = {"recipe": cfg.recipe, "fp8_recipe": cfg.job.fp8_scaling, "kv_cache_dtype": cfg.kv_cache_dtype,
                     "steps": cfg.steps}
    if stopped:
        summary.update({"stopped": True, "steps_done": history[-1]["step"] + 1 if history else 0})
    if not history:
        return summary
    k = max(1, min(5, done // 3))
    end = val[max(val)]
    summary.update({
        "reward_first": statistics.fmean(h["reward_mean"] for h in history[:k]),
        "reward_last": statistics.fmean(h["reward_mean"] for h in history[-k:]),
        "val_accuracy_start": val[0]["val_accuracy"], "val_accuracy_end": end["val_accuracy"],
        **{f"{k}_start": v for k, v in val[0].items() if k.startswith("val/")},
        **{f"{k}_end": v for k, v in end.items() if k.startswith("val/")},
        "token_mult_prob_error_mean": statistics.fmean(h["token_mult_prob_error"] for h in history),
        # the mean is dominated by single-token spikes (FP8-KV saturation on off-distribution
        # samples); the reference gates recipes on the median over steps
        "token_mult_prob_error_median": statistics.median(h["token_mult_prob_error"] for h in history),
        "gen_kl_k3_mean": statistics.fmean(h["gen_kl_k3"] for h in history),
        # exact (trainer bitwise the rollout) iff 0.0; a NaN step (a broken engine) ranks highest (d != d)
        "max_abs_logprob_diff_max": max((h[MAX_ABS_LOGPROB_DIFF] for h in history), key=lambda d: (d != d, d)),
        "calibrate_share_mean": statistics.fmean(h["calibrate_share"] for h in history),
        "step_seconds_mean": statistics.fmean(h["time/step"] for h in history),
        "wall_seconds": wall,
        "samples_per_s": ran * loop.plan.group * cfg.job.grpo.num_prompts_per_step / wall if wall > 0 else 0.0,
        "weight_lag_mean": statistics.fmean(h["weight_lag_mean"] for h in history),
        "weight_lag_max": max(h["weight_lag_max"] for h in history),
        **{f"phase_seconds/{p}": statistics.fmean(h[f"time/{p}"] for h in history) for p in PHASES},
    })
    if loop.observatory is not None:
        s = loop.observatory.suggestion
        summary.update({"auto_bf16/num_first_layers_in_bf16": s.first, "auto_bf16/num_last_layers_in_bf16": s.last,
                        "auto_bf16/token_mult_prob_error": s.token_mult_prob_error, "auto_bf16/met_target": s.met})
    promise = summary["token_mult_prob_error_promise"] = mismatch_promise(cfg.recipe, cfg.kv_cache_dtype)
    if not stopped and summary["token_mult_prob_error_median"] > promise:
        log.warning("median token_mult_prob_error %.4f is above what %s with kv_cache_dtype=%s promises (%.2f): "
                    "the rollout and the trainer disagree more than this recipe should (DESIGN §4)",
                    summary["token_mult_prob_error_median"], cfg.recipe, cfg.kv_cache_dtype, promise)
    return summary


def format_table(summaries: list[dict]) -> str:
    cols = [("recipe", "{}"), ("kv_cache_dtype", "{}"), ("reward_first", "{:.3f}"), ("reward_last", "{:.3f}"),
            ("val_accuracy_start", "{:.3f}"), ("val_accuracy_end", "{:.3f}"),
            ("token_mult_prob_error_median", "{:.6f}"),
            ("token_mult_prob_error_mean", "{:.6f}"), ("max_abs_logprob_diff_max", "{:.1e}"),
            ("gen_kl_k3_mean", "{:.2e}"), ("calibrate_share_mean", "{:.2%}"), ("step_seconds_mean", "{:.2f}")]
    head = " | ".join(c for c, _ in cols)
    lines = [head, "-" * len(head)]
    for s in summaries:
        lines.append(" | ".join(f.format(s[c]) for c, f in cols))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fp8rl.loop", description="In-process GRPO with FP8 numerics. Runs a job file (--config, "
        "the same YAML the services read) or the defaults; each flag below sets the job key it names.")
    ap.add_argument("--config", metavar="JOB.yaml", help="job file to run (flags override its keys)")
    ap.add_argument("--data-root", metavar="DIR", default=None,
                    help="directory a jsonl / dataset job's data.path and data.validation_path must lie in; relative "
                         "paths are relative to it (default: the directory of --config, else the working directory; "
                         "with --resume: the run's, recorded in DIR/run.json)")
    ap.add_argument("--recipe", choices=RECIPES, help="precision recipe (sets policy.generation.vllm_cfg.precision "
                    "and policy.training.megatron_cfg.fp8_cfg.enabled; default: the job's, fp8_e2e)")
    docs = dict(walk(JobConfig))
    for flag, key in LOOP_FLAGS.items():
        f = docs[key]
        kind, choices = f.metadata["kind"], f.metadata["choices"]
        if kind is bool:  # a switch: --x sets the key true, --no-x false, neither leaves the job's
            ap.add_argument(f"--{flag.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=None,
                            help=f"{f.metadata['doc']} (job key {key}; default {f.default})")
            continue
        ap.add_argument(f"--{flag.replace('_', '-')}", type=None if kind is str else kind, choices=choices,
                        default=None, help=f"{f.metadata['doc']} (job key {key}; default {f.default})")
    ap.add_argument("--out", default=None, help="run directory: job.yaml at start, metrics.jsonl and TensorBoard "
                    "as each step ends, checkpoints every job.checkpoint_every steps, the report, summary.json and "
                    "the trained policy/ (see fp8rl.rundir)")
    ap.add_argument("--resume", metavar="DIR", default=None,
                    help="continue the stopped run in DIR (its --out) from its newest checkpoint, with its job.yaml "
                         "(no checkpoint yet: start it over from step 0); takes no other flag but --data-root")
    ap.add_argument("--compare", nargs="*", metavar="RECIPE",
                    help="run these recipes (default: all three) with the same seed and print a comparison table")
    return ap


_signals = {"pending": None, "held": 0}  # a signal that came while the run wrote a step's record, and who holds it


def _raise_stopped(signum, _frame) -> None:
    if _signals["held"]:  # writing a row, a checkpoint: stop once it is whole
        _signals["pending"] = signum
        return
    raise LoopStopped(signum)


@contextlib.contextmanager
def _whole():
    """What runs inside is not cut by SIGINT/SIGTERM (:func:`main`'s handlers): a signal then stops the run after it."""
    _signals["held"] += 1
    try:
        yield
    finally:
        _signals["held"] -= 1
        signum, _signals["pending"] = _signals["pending"], None
        if signum is not None and not _signals["held"]:
            raise LoopStopped(signum)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    memory.tune_allocator()  # freed heap memory goes back to the kernel at phase boundaries
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    flags = {k: getattr(args, k) for k in LOOP_FLAGS if getattr(args, k) is not None}
    try:
        if args.resume:
            given = sorted(k for k in (*flags, "config", "recipe", "out", "compare")
                           if k in flags or getattr(args, k, None) is not None)
            if given:
                ap.error(f"--resume runs the job saved in its directory: drop {', '.join('--' + g for g in given)}")
            rd = RunDir(args.resume)
            job = load_job_config(rd.job_file())
            base = LoopConfig(job, args.resume, args.data_root or rd.data_root())
        else:
            job = load_job_config(args.config) if args.config else JobConfig()
            # the data root defaults to the job file's directory, as the controller's does (services.controller)
            root = args.data_root or (str(Path(args.config).resolve().parent) if args.config else None)
            base = LoopConfig.from_flags(job=job, recipe=args.recipe, out_dir=args.out, data_root=root, **flags)
        recipes = [base.recipe] if args.compare is None else (args.compare or list(RECIPES))
        for r in recipes:
            recipe_settings(r)
        check_data(base.job, base.data)  # a data file outside the root, or missing, before any engine is built
    except DataFileError as e:
        ap.error(f"{e} (the loop's flag: --data-root)")
    except (ConfigError, RunDirError) as e:
        ap.error(str(e))
    handlers = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    summaries = []
    try:
        for r in recipes:
            out = f"{base.out_dir}/{r}" if (base.out_dir and len(recipes) > 1) else base.out_dir
            cfg = base if args.resume else replace(base, job=base.job.with_settings(recipe_settings(r)), out_dir=out)
            summaries.append(run(cfg, resume=bool(args.resume))["summary"])
    except MemoryBudgetError as e:  # refused before the work: say what fits instead of a traceback
        print(f"python -m fp8rl.loop: {e} (the loop's flag: --micro-batch-size)", file=sys.stderr)
        return 2
    except RunDirError as e:
        print(f"python -m fp8rl.loop: {e}", file=sys.stderr)
        return 2
    except LoopStopped as e:
        where = f"; its report is in {base.out_dir}" if base.out_dir else ""
        again = f", `python -m fp8rl.loop --resume {base.out_dir}` continues from its last checkpoint" \
            if base.out_dir and base.job.job.checkpoint_every else ""
        print(f"python -m fp8rl.loop: stopped by {e}{where}{again}", file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    print(format_table(summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
