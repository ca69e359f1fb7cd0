"""The in-process loop's configuration: a job and where its report goes (:class:`LoopConfig`), and the loop's
command-line flags as short names of job keys (:data:`LOOP_FLAGS`). :mod:`fp8rl.loop` runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8rl.config import JobConfig, recipe_settings
from fp8rl.data import DataRoot
from fp8rl.fp8 import DEFAULT_SCALING

__all__ = ["LOOP_FLAGS", "LoopConfig"]

# Each loop flag sets one job key: the CLI, LoopConfig.from_flags and the flags' help all read this table,
# so the loop and the YAML cannot drift (a flag is only a short name for a key of fp8rl.config).
LOOP_FLAGS: dict[str, str] = {
    "model": "policy.model",
    "kv_cache_dtype": "policy.generation.vllm_cfg.kv_cache_dtype",
    "fp8_recipe": "policy.training.megatron_cfg.fp8_cfg.fp8_recipe",
    "steps": "job.steps",
    "prompts_per_step": "grpo.num_prompts_per_step",
    "group_size": "grpo.num_generations_per_prompt",
    "max_tokens": "policy.generation.max_new_tokens",
    "temperature": "policy.generation.temperature",
    "top_p": "policy.generation.top_p",
    "lr": "policy.training.lr",
    "micro_batch_size": "policy.training.micro_batch_size",
    "activation_checkpointing": "policy.training.activation_checkpointing",
    "num_minibatches": "policy.training.num_minibatches",
    "is_mode": "loss.importance_sampling.mode",
    "kl_coef": "loss.kl_coef",
    "num_first_layers_in_bf16": "policy.generation.vllm_cfg.num_first_layers_in_bf16",
    "num_last_layers_in_bf16": "policy.generation.vllm_cfg.num_last_layers_in_bf16",
    "calibration_max_sequences": "calibration.max_sequences",
    "eval_every": "job.eval_every",
    "checkpoint_every": "job.checkpoint_every",
    "eval_size": "job.eval_size",
    "eval_k": "eval.k",
    "eval_temperature": "eval.temperature",
    "loss_agg_mode": "loss.loss_agg_mode",
    "normalize_rewards": "grpo.normalize_rewards",
    "dynamic_sampling": "grpo.use_dynamic_sampling",
    "overlong_filtering": "grpo.overlong_filtering",
    "seed": "job.seed",
    "max_weight_lag": "grpo.async_grpo.max_weight_lag",  # giving it also sets grpo.async_grpo.enabled
    "batch_invariant": "policy.numerics.batch_invariant",
    "auto_bf16_layers": "policy.numerics.auto_bf16_layers",
    "auto_bf16_target": "policy.numerics.auto_bf16_target",
    "router_replay": "policy.router_replay.enabled",
    "router_aux_loss_coef": "loss.router_aux_loss_coef",
    "lora": "policy.lora.enabled",
    "lora_rank": "policy.lora.rank",
    "lora_alpha": "policy.lora.alpha",
}


@dataclass(frozen=True)
class LoopConfig:
    """One in-process GRPO run: a job (:class:`fp8rl.config.JobConfig`, the same file the services read)
    and where its report goes.

    Attributes:
        job: every setting of the run; the loop reads the keys that shape a step exactly as the
            controller and the services do (``policy.generation.backend`` is always the embedded engine).
        out_dir: if set, a report (metrics.jsonl, summary.md, plots, TensorBoard), summary.json and the trained
            policy as an HF model directory (``policy/``) go there.
        data_root: the directory a ``jsonl`` / ``dataset`` job's ``data.path`` and ``data.validation_path`` must lie
            in, relative paths relative to it (the controller's ``--data-root``); None: the working directory.
            ``python -m fp8rl.loop`` gives the job file's directory, as the controller does (:func:`main`).
    """

    job: JobConfig = field(default_factory=JobConfig)
    out_dir: str | None = None
    data_root: str | None = None

    @classmethod
    def from_flags(cls, *, job: JobConfig | None = None, recipe: str | None = None, arith: dict | None = None,
                   out_dir: str | None = None, data_root: str | None = None, **flags) -> LoopConfig:
        """``job`` (default: all defaults) with loop flags applied: ``recipe`` (the two keys of
        :data:`fp8rl.config.RECIPE_SETTINGS`), ``arith`` (keys of ``data.arith``) and any of
        :data:`LOOP_FLAGS`; a bad value is a :class:`~fp8rl.config.ConfigError` naming the job key."""
        unknown = sorted(set(flags) - set(LOOP_FLAGS))
        if unknown:
            raise TypeError(f"unknown loop flag(s) {', '.join(unknown)} (known: {', '.join(LOOP_FLAGS)})")
        changes = recipe_settings(recipe) if recipe is not None else {}
        changes.update({LOOP_FLAGS[k]: v for k, v in flags.items()})
        if "max_weight_lag" in flags:  # asking for a lag bound asks for asynchronous GRPO
            changes["grpo.async_grpo.enabled"] = True
        changes.update({f"data.arith.{k}": v for k, v in (arith or {}).items()})
        return cls((job or JobConfig()).with_settings(changes), out_dir, data_root)

    @property
    def recipe(self) -> str:
        return self.job.recipe

    @property
    def recipe_label(self) -> str:
        """The recipe, with its FP8 scaling where that is not the default (``fp8_e2e/mxfp8``)."""
        scaling = self.job.fp8_scaling
        return self.recipe if scaling == DEFAULT_SCALING or self.recipe == "bf16" else f"{self.recipe}/{scaling}"

    @property
    def kv_cache_dtype(self) -> str:
        return self.job.kv_cache_dtype

    @property
    def steps(self) -> int:
        return self.job.job.steps

    @property
    def data(self) -> DataRoot:
        """The :class:`~fp8rl.data.DataRoot` the job's data files are read under (default limits)."""
        return DataRoot(Path(self.data_root or "."))

    def as_dict(self) -> dict:
        return {"job": self.job.to_dict(), "out_dir": self.out_dir, "data_root": self.data_root}
