"""The job YAML: one file describes a GRPO run; keys compatible in spirit with NeMo RL's.

Validated on load: every unknown key, wrong type or out-of-range value raises
:class:`ConfigError` naming the dotted key (``policy.generation.vllm_cfg.precision``), and messages
quote at most a short prefix of a bad value. Bounded before and while parsing (:mod:`fp8rl.limits`):
at most ``MAX_JOB_YAML_BYTES`` of YAML, nested at most ``MAX_YAML_DEPTH`` deep; anchors and aliases
(``&a`` / ``*a``, hence ``<<`` merges) are refused, so an alias bomb is a one-line error, not a
gigabyte; every integer within ``MAX_CONFIG_INT`` (``job.steps`` within ``MAX_JOB_STEPS`` ...), every
float finite, and one step's batch within the services' default per-request bounds. A sampling
temperature below ``GREEDY_TEMPERATURE`` is greedy (stored as 0.0). The
precision recipe is *derived* from two keys, as in NeMo RL::

    policy.generation.vllm_cfg.precision   policy.training.megatron_cfg.fp8_cfg.enabled   recipe
    bf16                                   false                                          bf16
    fp8                                    false                                          fp8_gen_only
    fp8                                    true                                           fp8_e2e

A minimal job (everything else defaulted)::

    job: {name: demo, steps: 30}
    policy:
      model: tiny-arith
      generation: {vllm_cfg: {precision: fp8, kv_cache_dtype: fp8}}
      training: {megatron_cfg: {fp8_cfg: {enabled: true, fp8_recipe: blockwise}}}
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fp8rl import limits

__all__ = ["ConfigError", "JobConfig", "DEFAULTS", "load_job_config", "parse_job_config"]


class ConfigError(ValueError):
    """A job file is invalid; the message names the dotted key."""


# The full schema: every key a job may set, with its default. Types are taken from the defaults
# (an int default accepts ints, a float default accepts ints and floats, None means "str or null").
DEFAULTS: dict[str, Any] = {
    "job": {"name": "grpo", "steps": 30, "seed": 0, "checkpoint_every": 10, "eval_every": 0, "eval_size": 128},
    "policy": {
        "model": "tiny-arith",
        "generation": {
            "backend": "torch",
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": 8,
            "vllm_cfg": {
                "precision": "fp8",
                "kv_cache_dtype": "fp8",
                "fp8_attention": True,
                "num_first_layers_in_bf16": 0,
                "num_last_layers_in_bf16": 0,
                "pow2_weight_scaling_factors": False,
                "pow2_activation_scaling_factors": False,
                "gpu_memory_utilization": 0.6,
            },
        },
        "training": {
            "backend": "torch",
            "lr": 2e-4,
            "weight_decay": 0.0,
            "grad_clip": 1.0,
            "micro_batch_size": 64,
            "num_minibatches": 1,
            "megatron_cfg": {
                "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1,
                "fp8_cfg": {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise"},
            },
        },
    },
    "loss": {
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.2,
        "dual_clip_c": None,
        "kl_coef": 0.0,
        "importance_sampling": {
            "mode": "token", "tis_cap": 2.0, "tis_min": 0.0, "icepop_lo": 0.5, "icepop_hi": 5.0,
            "seq_mask_lo": 0.999, "seq_mask_hi": 1.002,
        },
    },
    "grpo": {"num_prompts_per_step": 16, "num_generations_per_prompt": 8, "leave_one_out": True},
    "data": {
        "task": "arith",
        "path": None,
        "arith": {"max_operand": 20, "num_terms": 2, "ops": ["+", "-"], "word_problems": False},
    },
    "reward": {"grader": "exact_match", "timeout_s": 5.0},
    "calibration": {"margin": 1.05, "percentile": 99.9, "max_sequences": 16},
}

_CHOICES: dict[str, tuple] = {
    "policy.generation.backend": ("torch", "vllm"),
    "policy.generation.vllm_cfg.precision": ("bf16", "fp8"),
    "policy.generation.vllm_cfg.kv_cache_dtype": ("auto", "fp8"),
    "policy.training.backend": ("torch", "megatron"),
    "policy.training.megatron_cfg.fp8_cfg.fp8": ("e4m3",),
    "policy.training.megatron_cfg.fp8_cfg.fp8_recipe": ("blockwise",),
    "loss.importance_sampling.mode": ("none", "token", "tis", "icepop", "seq_mask_tis"),
    "data.task": ("arith", "jsonl"),
}
_POSITIVE = {"job.steps", "job.eval_size", "policy.generation.max_new_tokens", "policy.training.lr",
             "policy.training.micro_batch_size", "policy.training.num_minibatches",
             "grpo.num_prompts_per_step", "calibration.margin",
             "calibration.max_sequences", "reward.timeout_s"}
_NON_NEGATIVE = {"job.seed", "job.checkpoint_every", "job.eval_every", "policy.generation.temperature",
                 "policy.generation.vllm_cfg.num_first_layers_in_bf16",
                 "policy.generation.vllm_cfg.num_last_layers_in_bf16", "loss.kl_coef",
                 "policy.training.weight_decay", "policy.training.grad_clip"}


# Upper bounds tighter than MAX_CONFIG_INT (inclusive); see fp8rl.limits for why each one.
_MAXIMUM: dict[str, int | float] = {
    "job.steps": limits.MAX_JOB_STEPS, "job.checkpoint_every": limits.MAX_JOB_STEPS,
    "job.eval_every": limits.MAX_JOB_STEPS, "job.seed": limits.MAX_JOB_SEED,
    "job.eval_size": limits.MAX_GENERATE_PROMPTS, "policy.generation.max_new_tokens": limits.MAX_NEW_TOKENS,
    "policy.generation.temperature": limits.MAX_TEMPERATURE,
    "grpo.num_prompts_per_step": limits.MAX_GENERATE_PROMPTS,
    "grpo.num_generations_per_prompt": limits.MAX_SAMPLES_PER_PROMPT,
    "calibration.max_sequences": limits.MAX_BATCH_ROWS,
}
_SHOWN_CHARS = 80  # how much of a bad value or key an error message quotes


def _short(val: Any) -> str:
    """``repr(val)``, cut to :data:`_SHOWN_CHARS` (a 1 MiB bad value must not make a 1 MiB message)."""
    text = repr(val)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def _clip(text: str, limit: int = 400) -> str:
    """``text`` cut to ``limit`` characters (messages from parsers and validators can quote whole inputs)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: parsing is the costly part
_OPEN_EVENTS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE_EVENTS = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def _check_events(text: str) -> None:
    """Refuse anchors / aliases and nesting deeper than ``MAX_YAML_DEPTH`` from the parse events alone.

    Runs before anything is built, so an alias bomb (a few hundred bytes that expand to gigabytes) fails at
    its first anchor, with a one-line message.
    """
    loader, depth = _Loader(text), 0
    try:
        while loader.check_event():
            event = loader.get_event()
            where = f"line {event.start_mark.line + 1}"
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise ConfigError(f"{where}: YAML anchors and aliases (&name, *name, << merges) are not allowed in "
                                  f"job files; write the values out")
            if isinstance(event, _OPEN_EVENTS):
                depth += 1
                if depth > limits.MAX_YAML_DEPTH:
                    raise ConfigError(f"{where}: the job file nests deeper than {limits.MAX_YAML_DEPTH} levels")
            elif isinstance(event, _CLOSE_EVENTS):
                depth -= 1
    finally:
        loader.dispose()


def _check_yaml_size(size: int) -> None:
    if size > limits.MAX_JOB_YAML_BYTES:
        raise ConfigError(f"job file is {size} bytes; the limit is {limits.MAX_JOB_YAML_BYTES} bytes")


def _load_yaml(text: str) -> Any:
    _check_yaml_size(len(text.encode("utf-8", "surrogatepass")))
    try:
        _check_events(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader (CSafeLoader / SafeLoader)
    except ConfigError:
        raise
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: e.g. an int of > 4300 digits
        raise ConfigError(f"job file is not valid YAML: {_clip(str(e))}") from None


def _merge(defaults: dict, given: Any, path: str) -> dict:
    if not isinstance(given, dict):
        raise ConfigError(f"{path or 'job file'}: expected a mapping, got {type(given).__name__}")
    out = copy.deepcopy(defaults)
    for key, val in given.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in defaults:
            known = ", ".join(sorted(defaults))
            raise ConfigError(f"unknown key {_short(dotted)} (known keys here: {known})")
        d = defaults[key]
        if isinstance(d, dict):
            out[key] = _merge(d, val if val is not None else {}, dotted)
        else:
            out[key] = _check_type(dotted, d, val)
    return out


def _check_type(key: str, default: Any, val: Any) -> Any:
    if isinstance(default, bool):
        ok = isinstance(val, bool)
    elif isinstance(default, int):
        ok = isinstance(val, int) and not isinstance(val, bool)
    elif isinstance(default, float):
        ok = isinstance(val, int | float) and not isinstance(val, bool)
        val = float(val) if ok else val
    elif isinstance(default, str):
        ok = isinstance(val, str)
    elif isinstance(default, list):
        ok = isinstance(val, list)
    else:  # None default: an optional string or number
        ok = val is None or isinstance(val, str | int | float) and not isinstance(val, bool)
    if not ok:
        raise ConfigError(f"{key}: expected {type(default).__name__ if default is not None else 'a value'}, "
                          f"got {_short(val)}")
    if isinstance(val, float) and not math.isfinite(val):
        raise ConfigError(f"{key}: must be a finite number, got {val}")
    magnitude = max(limits.MAX_CONFIG_INT, _MAXIMUM.get(key, 0))
    if isinstance(val, int) and not isinstance(val, bool) and abs(val) > magnitude:
        raise ConfigError(f"{key}: {_short(val)} is out of range (at most {magnitude} in magnitude)")
    if key in _MAXIMUM and val > _MAXIMUM[key]:
        raise ConfigError(f"{key}: must be <= {_MAXIMUM[key]}, got {val}")
    if key in _CHOICES and val not in _CHOICES[key]:
        raise ConfigError(f"{key}: {_short(val)} is not one of {', '.join(map(str, _CHOICES[key]))}")
    if key in _POSITIVE and not val > 0:
        raise ConfigError(f"{key}: must be > 0, got {val}")
    if key in _NON_NEGATIVE and val < 0:
        raise ConfigError(f"{key}: must be >= 0, got {val}")
    return val


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d[part]
    return d


@dataclass(frozen=True)
class JobConfig:
    """A validated job: ``raw`` is the full merged mapping; properties give the derived views."""

    raw: dict

    def get(self, dotted: str) -> Any:
        """Value of a dotted key (``"grpo.num_generations_per_prompt"``)."""
        try:
            return _get(self.raw, dotted)
        except (KeyError, TypeError):
            raise ConfigError(f"no key {dotted!r} in the job config") from None

    @property
    def recipe(self) -> str:
        gen_fp8 = self.get("policy.generation.vllm_cfg.precision") == "fp8"
        train_fp8 = bool(self.get("policy.training.megatron_cfg.fp8_cfg.enabled"))
        if train_fp8 and not gen_fp8:
            raise ConfigError("policy.training.megatron_cfg.fp8_cfg.enabled=true needs "
                              "policy.generation.vllm_cfg.precision=fp8 (FP8 training with BF16 rollout "
                              "is not a recipe)")
        return "fp8_e2e" if train_fp8 else ("fp8_gen_only" if gen_fp8 else "bf16")

    @property
    def kv_cache_dtype(self) -> str:
        return self.get("policy.generation.vllm_cfg.kv_cache_dtype")

    def fp8_recipe(self, role: str):
        """The :class:`fp8rl.fp8.Fp8Recipe` of ``role`` (``rollout`` / ``trainer`` / ``calibrator``)."""
        from fp8rl.fp8 import recipe_for_role

        v = self.raw["policy"]["generation"]["vllm_cfg"]
        return recipe_for_role(
            self.recipe, role, kv_cache_dtype=v["kv_cache_dtype"], fp8_attention=v["fp8_attention"],
            num_first_layers_in_bf16=v["num_first_layers_in_bf16"],
            num_last_layers_in_bf16=v["num_last_layers_in_bf16"],
            pow2_weight_scaling_factors=v["pow2_weight_scaling_factors"],
            pow2_activation_scaling_factors=v["pow2_activation_scaling_factors"],
        )

    def loss_config(self):
        """The :class:`fp8rl.rl.LossConfig` of this job."""
        from fp8rl.rl import LossConfig

        loss, isc = self.raw["loss"], self.raw["loss"]["importance_sampling"]
        return LossConfig(
            clip_eps_low=loss["clip_eps_low"], clip_eps_high=loss["clip_eps_high"], dual_clip_c=loss["dual_clip_c"],
            kl_coef=loss["kl_coef"], is_mode=isc["mode"], tis_cap=isc["tis_cap"], tis_min=isc["tis_min"],
            icepop_lo=isc["icepop_lo"], icepop_hi=isc["icepop_hi"], seq_mask_lo=isc["seq_mask_lo"],
            seq_mask_hi=isc["seq_mask_hi"],
        )

    def trainer_config(self):
        """The :class:`fp8rl.engines.TrainerConfig` of this job."""
        from fp8rl.engines import TrainerConfig

        t = self.raw["policy"]["training"]
        return TrainerConfig(
            lr=t["lr"], weight_decay=t["weight_decay"], grad_clip=t["grad_clip"],
            micro_batch_size=t["micro_batch_size"], num_minibatches=t["num_minibatches"],
            temperature=self.raw["policy"]["generation"]["temperature"], loss=self.loss_config(),
        )

    def arith_config(self):
        """The :class:`fp8rl.data.ArithConfig` of the arithmetic task."""
        from fp8rl.data import ArithConfig

        return ArithConfig(**self.raw["data"]["arith"])

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.raw, sort_keys=False)


_MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


def _check_batch_shape(merged: dict) -> None:
    """One step's batch must fit one call of each service at its default bounds (see :mod:`fp8rl.limits`)."""
    prompts, group = merged["grpo"]["num_prompts_per_step"], merged["grpo"]["num_generations_per_prompt"]
    rows, max_new = prompts * group, merged["policy"]["generation"]["max_new_tokens"]
    if rows > limits.MAX_BATCH_ROWS:
        raise ConfigError(f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt: {prompts} x {group} = "
                          f"{rows} rows per step; the limit is {limits.MAX_BATCH_ROWS} (rows of one TrainStep)")
    if rows * max_new > limits.MAX_GENERATED_TOKENS:
        raise ConfigError(f"policy.generation.max_new_tokens: {rows} rows x {max_new} tokens = {rows * max_new} "
                          f"generated tokens per step; the limit is {limits.MAX_GENERATED_TOKENS} (one Generate call)")


def parse_job_config(data: dict | str | None) -> JobConfig:
    """Validate a mapping (or YAML text) against the schema; raise :class:`ConfigError` on any problem."""
    if isinstance(data, str):
        data = _load_yaml(data)
    merged = _merge(DEFAULTS, data or {}, "")
    if merged["grpo"]["num_generations_per_prompt"] < 2:
        raise ConfigError("grpo.num_generations_per_prompt: must be >= 2 (GRPO compares samples of one prompt)")
    _check_batch_shape(merged)
    gen = merged["policy"]["generation"]
    if 0 < gen["temperature"] < limits.GREEDY_TEMPERATURE:
        gen["temperature"] = 0.0  # greedy, as the rollout engines treat it (logits / T would overflow)
    path = merged["data"]["path"]
    if path is not None and not (isinstance(path, str) and 0 < len(path) <= _MAX_PATH_CHARS and "\0" not in path):
        raise ConfigError(f"data.path: expected a file path of 1-{_MAX_PATH_CHARS} characters, got {_short(path)}")
    if merged["data"]["task"] == "jsonl" and not path:
        raise ConfigError("data.path: required when data.task is 'jsonl'")
    if not 0 < merged["policy"]["generation"]["top_p"] <= 1:
        raise ConfigError(f"policy.generation.top_p: must be in (0, 1], got {merged['policy']['generation']['top_p']}")
    mc = merged["policy"]["training"]["megatron_cfg"]
    for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if mc[k] < 1:
            raise ConfigError(f"policy.training.megatron_cfg.{k}: must be >= 1, got {mc[k]}")
    cfg = JobConfig(merged)
    cfg.recipe  # noqa: B018 - validates the precision combination
    for section, build in (("data.arith", cfg.arith_config), ("loss", cfg.loss_config)):
        try:
            build()
        except ValueError as e:
            raise ConfigError(f"{section}: {_clip(str(e))}") from None
    return cfg


def load_job_config(path: str | Path) -> JobConfig:
    """Read and validate a job YAML file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"job file {str(p)!r} does not exist")
    try:
        _check_yaml_size(p.stat().st_size)  # before reading it: the limit is on work, not only on parsing
        return parse_job_config(p.read_text())
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
