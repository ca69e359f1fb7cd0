"""fp8rl.config bounds: YAML size, anchors/aliases, nesting, integer ranges, finite floats, batch shape, greedy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from fp8rl import limits
from fp8rl.config import ConfigError, load_job_config, parse_job_config

# Each level multiplies by 9: 9**3 leaves here; nine levels would be 387 M strings (and a 50 MB error message).
ALIAS_BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
job: {name: *c}
"""


def refused(text_or_mapping, match: str) -> str:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=match) as err:
        parse_job_config(text_or_mapping)
    assert time.perf_counter() - t0 < 2.0
    assert len(str(err.value)) < 600  # a message for people, never the offending value echoed whole
    return str(err.value)


def test_alias_bomb_and_anchors_are_refused_at_once():
    refused(ALIAS_BOMB, r"line 1: YAML anchors and aliases .* are not allowed")
    refused("job: &j {steps: 3}\npolicy: {model: x}\n", "anchors and aliases")
    refused("base: &b {steps: 3}\njob:\n  <<: *b\n", "anchors and aliases")


def test_yaml_bytes_are_limited_before_parsing():
    big = "job: {name: x}\n" + "# pad\n" * (limits.MAX_JOB_YAML_BYTES // 6 + 1)
    msg = refused(big, f"the limit is {limits.MAX_JOB_YAML_BYTES} bytes")
    assert str(len(big)) in msg


def test_load_job_config_checks_the_size_before_reading(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("x" * (limits.MAX_JOB_YAML_BYTES + 1))
    with pytest.raises(ConfigError, match=rf"big.yaml: job file is {limits.MAX_JOB_YAML_BYTES + 1} bytes"):
        load_job_config(p)


def test_deep_nesting_and_huge_ints_are_config_errors():
    refused("[" * 100, f"nests deeper than {limits.MAX_YAML_DEPTH} levels")
    refused("[" * limits.MAX_JOB_YAML_BYTES, "not valid YAML")  # libyaml's own depth limit, as a ConfigError
    refused({"data": {"arith": {"ops": [1] * 50_000}}}, r"data.arith: .*characters\)")  # a validator's long message
    refused("job: {steps: 1" + "0" * 5000 + "}", "not valid YAML")  # Python refuses to convert > 4300 digits


@pytest.mark.parametrize(("yaml_text", "match"), [
    ("job: {steps: 9223372036854775808}", r"job.steps: 9223372036854775808 is out of range \(at most 2147483647"),
    (f"job: {{steps: {limits.MAX_JOB_STEPS + 1}}}", rf"job.steps: must be <= {limits.MAX_JOB_STEPS}, got 1000001"),
    ("job: {steps: 0}", r"job.steps: must be > 0, got 0"),
    ("job: {seed: -1}", r"job.seed: must be >= 0"),
    ("job: {seed: 4294967296}", r"job.seed: 4294967296 is out of range \(at most 4294967295"),
    ("grpo: {num_prompts_per_step: 0}", r"grpo.num_prompts_per_step: must be > 0"),
    ("policy: {training: {micro_batch_size: 0}}", r"micro_batch_size: must be > 0"),
    ("policy: {generation: {temperature: .inf}}", r"temperature: must be a finite number, got inf"),
    ("policy: {generation: {temperature: .nan}}", r"temperature: must be a finite number, got nan"),
    ("policy: {generation: {temperature: 101.0}}", r"temperature: must be <= 100.0, got 101.0"),
    ("policy: {generation: {top_p: .nan}}", r"top_p: must be a finite number"),
    ("policy: {training: {lr: .inf}}", r"policy.training.lr: must be a finite number"),
    ("grpo: {num_prompts_per_step: 4096, num_generations_per_prompt: 8}", r"32768 rows per step; the limit is 8192"),
    ("policy: {generation: {max_new_tokens: 32768}}\ngrpo: {num_prompts_per_step: 1024, num_generations_per_prompt: 8}",
     r"generated tokens per step; the limit is 16777216"),
    ("data: {task: jsonl, path: 5}", r"data.path: expected a file path"),
])
def test_out_of_range_values_name_the_key_limit_and_value(yaml_text, match):
    refused(yaml_text, match)


def test_bad_values_are_quoted_short():
    msg = refused({"job": {"steps": "y" * 100_000}}, r"job.steps: expected int")
    assert "100002 characters" in msg
    refused({"x" * 100_000: 1}, r"unknown key 'xxxx.*characters")


def test_tiny_temperatures_are_greedy_and_valid_jobs_still_load():
    cfg = parse_job_config({"policy": {"generation": {"temperature": 1e-300}}})
    assert cfg.policy.generation.temperature == 0.0
    warm = parse_job_config({"policy": {"generation": {"temperature": 0.7}}})
    assert warm.policy.generation.temperature == 0.7
    cfg = parse_job_config(yaml.safe_dump({"job": {"steps": limits.MAX_JOB_STEPS},
                                           "grpo": {"num_prompts_per_step": 32}}))
    assert cfg.job.steps == limits.MAX_JOB_STEPS


# -- the typed schema ---------------------------------------------------------------------------------
def test_sections_are_frozen_and_validate_when_built_in_python():
    from dataclasses import FrozenInstanceError

    from fp8rl.config import GenerationConfig, GrpoConfig, JobConfig, MegatronCfg

    with pytest.raises(ConfigError, match=r"^policy.generation.temperature: must be >= 0.0, got -1.0"):
        GenerationConfig(temperature=-1)
    with pytest.raises(ConfigError, match=r"^grpo.num_generations_per_prompt: must be >= 2"):
        GrpoConfig(num_generations_per_prompt=1)
    with pytest.raises(ConfigError, match=r"^policy.training.megatron_cfg.tensor_model_parallel_size: must be >= 1"):
        MegatronCfg(tensor_model_parallel_size=0)
    with pytest.raises(ConfigError, match=r"^policy.generation: expected a mapping"):
        JobConfig().policy.__class__(generation={"temperature": 1.0})
    g = GenerationConfig(temperature=1)
    assert g.temperature == 1.0 and isinstance(g.temperature, float)  # ints are coerced for float keys
    with pytest.raises(FrozenInstanceError):
        g.temperature = 2.0


def test_unknown_keys_and_bad_types_name_the_dotted_key():
    refused({"policy": {"generation": {"vllm_cfg": {"precison": "fp8"}}}},
            r"unknown key 'policy.generation.vllm_cfg.precison' \(known keys here: .*precision")
    refused({"grpo": {"leave_one_out": "yes"}}, r"grpo.leave_one_out: expected bool, got 'yes'")
    refused({"policy": {"generation": {"vllm_cfg": {"precision": "fp4"}}}},
            r"policy.generation.vllm_cfg.precision: 'fp4' is not one of bf16, fp8")
    refused({"policy": {"generation": {"vllm_cfg": {"precision": "bf16"}}}}, r"FP8 training with BF16 rollout")
    refused({"data": {"task": "jsonl"}}, r"data.path: required when data.task is 'jsonl'")
    refused({"policy": [1, 2]}, r"policy: expected a mapping, got list")


def test_with_settings_validates_again_and_round_trips():
    from fp8rl.config import JobConfig, recipe_settings

    job = JobConfig().with_settings({"grpo.num_prompts_per_step": 4, **recipe_settings("fp8_gen_only")})
    assert job.grpo.num_prompts_per_step == 4 and job.recipe == "fp8_gen_only"
    assert parse_job_config(job.to_yaml()) == job  # YAML out and back in: the same job
    assert job.settings()["grpo.num_prompts_per_step"] == 4
    with pytest.raises(ConfigError, match="unknown key 'grpo.prompts'"):
        job.with_settings({"grpo.prompts": 4})
    with pytest.raises(ConfigError, match="grpo.num_prompts_per_step: must be > 0"):
        job.with_settings({"grpo.num_prompts_per_step": 0})


def test_every_key_is_documented_and_docs_config_md_is_current():
    from fp8rl.config import JobConfig, reference, walk

    keys = list(walk(JobConfig))
    assert len(keys) > 40 and all(len(f.metadata["doc"]) > 10 for _, f in keys)
    doc = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"
    assert doc.read_text() == reference(), "docs/CONFIG.md is stale: python -m fp8rl.config > docs/CONFIG.md"


def test_batch_invariance_needs_the_embedded_engines_and_reaches_both_roles():
    from fp8rl.config import JobConfig

    job = JobConfig().with_settings({"policy.numerics.batch_invariant": True})
    rollout, trainer = job.fp8_recipe("rollout"), job.fp8_recipe("trainer")
    assert rollout.batch_invariant and trainer.batch_invariant
    assert trainer.fp8_kv == rollout.fp8_kv  # the trainer recomputes the rollout's FP8 attention
    off = JobConfig().with_settings({"policy.numerics.batch_invariant": False})
    assert not off.fp8_recipe("trainer").fp8_kv  # without it the trainer's attention stays high precision
    assert off.batch_invariance == (False, "off: policy.numerics.batch_invariant=false")
    for key in ("policy.generation.backend", "policy.training.backend"):
        other = "vllm" if "generation" in key else "megatron"
        with pytest.raises(ConfigError, match=f"batch_invariant=true needs {key}=torch"):
            JobConfig().with_settings({"policy.numerics.batch_invariant": True, key: other})


def test_latent_attention_is_absorbed_on_every_side_unless_megatron_trains():
    """The MLA form reaches every role the same (the rollout's logprobs are the trainer's only in one form):
    absorbed with the torch trainer, expanded with Megatron's, whose MLA computes that one."""
    from fp8rl.config import JobConfig

    roles = ("rollout", "trainer", "calibrator")
    assert all(JobConfig().fp8_recipe(r).mla_absorbed for r in roles)
    mg = JobConfig().with_settings({"policy.training.backend": "megatron"})
    assert not any(mg.fp8_recipe(r).mla_absorbed for r in roles)


def test_fp8_recipe_sets_both_engines_and_refuses_what_cannot_run():
    from fp8rl.config import JobConfig

    key = "policy.training.megatron_cfg.fp8_cfg.fp8_recipe"
    for scaling in ("mxfp8", "tensorwise"):
        job = JobConfig().with_settings({key: scaling})
        assert {job.fp8_recipe(r).scaling for r in ("rollout", "trainer", "calibrator")} == {scaling}
        gen_only = JobConfig().with_settings({key: scaling, "policy.training.megatron_cfg.fp8_cfg.enabled": False})
        assert gen_only.recipe == "fp8_gen_only" and gen_only.fp8_recipe("rollout").fp8_linears
        assert not gen_only.fp8_recipe("trainer").fp8_linears  # fp8_gen_only still means the rollout only
        with pytest.raises(ConfigError, match=f"{key}={scaling} needs policy.generation.backend=torch"):
            JobConfig().with_settings({key: scaling, "policy.generation.backend": "vllm",
                                       "policy.numerics.batch_invariant": False})
    with pytest.raises(ConfigError, match=f"^{key}: .delayed. is not one of blockwise, mxfp8, tensorwise"):
        JobConfig().with_settings({key: "delayed"})
    with pytest.raises(ConfigError, match="tensorwise with policy.training.megatron_cfg.tensor_model_parallel_size=2"):
        JobConfig().with_settings({key: "tensorwise", "policy.training.backend": "megatron",
                                   "policy.numerics.batch_invariant": False,
                                   "policy.training.megatron_cfg.tensor_model_parallel_size": 2})
    JobConfig().with_settings({key: "mxfp8", "policy.training.backend": "megatron",  # whole 1x32 blocks per slice
                               "policy.numerics.batch_invariant": False,
                               "policy.training.megatron_cfg.tensor_model_parallel_size": 2})
    bf16 = {"policy.generation.vllm_cfg.precision": "bf16", "policy.training.megatron_cfg.fp8_cfg.enabled": False}
    JobConfig().with_settings({key: "mxfp8", "policy.generation.backend": "vllm", **bf16})  # no FP8 linear: fine


def test_batch_invariance_is_the_default_with_the_embedded_engines_and_off_with_a_reason_otherwise():
    from fp8rl.config import JobConfig

    job = JobConfig()
    assert job.policy.numerics.batch_invariant is None  # unset: resolved per engines
    assert job.batch_invariance == (True, "on by default: both engines are the embedded torch ones")
    assert job.fp8_recipe("rollout").batch_invariant and job.fp8_recipe("trainer").batch_invariant
    for key, other in (("policy.generation.backend", "vllm"), ("policy.training.backend", "megatron")):
        on, why = JobConfig().with_settings({key: other}).batch_invariance
        assert not on and why.startswith(f"off by default with {key}={other}") and "\n" not in why
        assert not JobConfig().with_settings({key: other}).fp8_recipe("rollout").batch_invariant


def test_loop_flag_batch_invariant_is_a_switch_both_ways():
    from fp8rl.loop import LoopConfig, _parser

    args = _parser().parse_args(["--batch-invariant"])
    assert args.batch_invariant is True and _parser().parse_args([]).batch_invariant is None
    assert _parser().parse_args(["--no-batch-invariant"]).batch_invariant is False
    assert LoopConfig.from_flags(batch_invariant=True).job.policy.numerics.batch_invariant
    assert LoopConfig.from_flags(batch_invariant=False).job.batch_invariance[0] is False


def test_calibration_site_resolves_to_the_logprob_pass_on_a_one_process_torch_trainer():
    from fp8rl.config import JobConfig

    assert JobConfig().calibration_site[0] == "logprobs"
    assert JobConfig().with_settings({"grpo.async_grpo.enabled": True}).calibration_site[0] == "logprobs"
    for settings in ({"policy.training.dp_size": 2}, {"policy.training.backend": "megatron"}):
        site, why = JobConfig().with_settings(settings).calibration_site
        assert site == "calibrator" and "calibration.site auto" in why, settings
    for site in ("calibrator", "trainer"):
        assert JobConfig().with_settings({"calibration.site": site}).calibration_site[0] == site
    for site in ("trainer", "logprobs"):
        with pytest.raises(ConfigError, match=f"calibration.site={site} needs a one-process torch trainer"):
            JobConfig().with_settings({"calibration.site": site, "policy.training.dp_size": 2})


def test_model_parallel_keys_are_checked_against_the_backend():
    from fp8rl.config import JobConfig

    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size / pipeline_model_parallel_size \(2 / 1\) apply "
                                          r"to policy.training.backend=megatron only"):
        JobConfig().with_settings({"policy.training.megatron_cfg.tensor_model_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"dp_size x megatron_cfg.tensor_model_parallel_size x "
                                          r"pipeline_model_parallel_size = \d+ trainer ranks; the limit is"):
        JobConfig().with_settings({"policy.training.backend": "megatron", "policy.training.dp_size": 64,
                                   "policy.training.megatron_cfg.tensor_model_parallel_size": 32})
    job = JobConfig().with_settings({"policy.training.backend": "megatron",
                                     "policy.training.megatron_cfg.tensor_model_parallel_size": 2})
    assert (job.trainer_model_parallel, job.trainer_ranks) == (2, 2)
    job = JobConfig().with_settings({"policy.training.backend": "megatron", "policy.training.dp_size": 2,
                                     "policy.training.megatron_cfg.tensor_model_parallel_size": 2,
                                     "policy.training.megatron_cfg.pipeline_model_parallel_size": 2})
    assert (job.trainer_model_parallel, job.trainer_ranks) == (4, 8)


def test_expert_parallel_keys_are_checked_and_add_no_ranks():
    from fp8rl.config import JobConfig

    ep = "policy.training.megatron_cfg.expert_model_parallel_size"
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size=2 applies to policy.training.backend=megatron"):
        JobConfig().with_settings({ep: 2, "policy.training.dp_size": 2})
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size=2 must divide policy.training.dp_size \(3\)"):
        JobConfig().with_settings({"policy.training.backend": "megatron", "policy.training.dp_size": 3, ep: 2})
    with pytest.raises(ConfigError, match="moe_token_dispatcher_type"):
        JobConfig().with_settings({"policy.training.megatron_cfg.moe_token_dispatcher_type": "flex"})
    job = JobConfig().with_settings({"policy.training.backend": "megatron", "policy.training.dp_size": 2, ep: 2,
                                     "policy.training.megatron_cfg.moe_token_dispatcher_type": "alltoall"})
    assert (job.trainer_model_parallel, job.trainer_ranks) == (1, 2)  # inside the data-parallel ranks


def test_every_job_file_in_deploy_parses():
    """The example jobs users copy (deploy/*-job.yaml) are valid job files, whatever key they show."""
    files = sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*-job.yaml"))
    assert len(files) >= 6 and any(f.name == "user-job.yaml" for f in files)
    for f in files:
        load_job_config(f)


def test_a_stack_validation_must_fit_one_generate_and_one_score():
    """eval.k x job.eval_size is bounded where the stack validates (eval_every > 0), not when it never does."""
    parse_job_config({"job": {"eval_size": 4096, "eval_every": 0}})
    with pytest.raises(ConfigError, match=r"eval.k: job.eval_size x eval.k = 4096 x 4 = 16384"):
        parse_job_config({"job": {"eval_size": 4096, "eval_every": 1}})
    parse_job_config({"job": {"eval_size": 4096, "eval_every": 1}, "eval": {"k": 2}})


def test_lora_settings_and_the_engines_that_refuse_them():
    """policy.lora (issue 33): its settings reach the trainer; vLLM and Megatron are refused naming the key and why."""
    from fp8rl.config import JobConfig

    job = JobConfig().with_settings({"policy.lora.enabled": True, "policy.lora.rank": 8,
                                     "policy.lora.target_modules": ["v_proj", "q_proj"]})
    lora = job.trainer_config().lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 32.0, ("q_proj", "v_proj"))
    assert JobConfig().trainer_config().lora is None and JobConfig().lora_settings() is None
    with pytest.raises(ConfigError, match=r"policy.lora.enabled=true needs policy.generation.backend=torch: .*vLLM"):
        job.with_settings({"policy.generation.backend": "vllm"})
    with pytest.raises(ConfigError, match=r"policy.lora.enabled=true needs policy.training.backend=torch .*NeMo"):
        job.with_settings({"policy.training.backend": "megatron"})
    with pytest.raises(ConfigError, match=r"^policy.lora.rank: must be > 0"):
        job.with_settings({"policy.lora.rank": 0})


@pytest.mark.parametrize("model,match", [
    ({"kind": "judge"}, "reward.model.model: reward.model.kind 'judge' needs a model"),
    ({"kind": "judge", "model": "m", "template": "{question}"}, "reward.model.template: fields"),
    ({"kind": "judge", "model": "m", "template": "{response} {oops}"}, "reward.model.template: fields"),
    ({"kind": "judge", "model": "m", "template": "{response"}, "not a format string"),
    ({"kind": "judge", "model": "m", "pairwise": True}, r"\{other\} \(pairwise\)"),
    ({"kind": "judge", "model": "m", "template": "{response} vs {other}"}, "reward.model.template: fields"),
    ({"kind": "classifier", "model": "m", "pairwise": True}, "pairwise needs a judge"),
    ({"kind": "classifier", "model": "m", "kv_cache_dtype": "fp8"}, "a classifier keeps no KV cache"),
    ({"kind": "judge", "model": "m", "parse": "verdict", "verdicts": {"yes": 2}}, "reward.model.verdicts"),
    ({"kind": "judge", "model": "m", "parse": "verdict_prob", "n": 2}, "reward.model.n"),
    ({"kind": "judge", "model": "m", "precision": "bf16", "agreement": True}, "needs reward.model.precision: fp8"),
    ({"kind": "critic", "model": "m"}, "reward.model.kind"),
    ({"kind": "judge", "follow_policy": True, "parse": "verdict_prob"}, "reward.model.follow_policy"),
    ({"kind": "classifier", "follow_policy": True}, "reward.model.follow_policy"),
    ({"kind": "judge", "model": "m", "backend": "vllm", "parse": "verdict_prob"}, "reward.model.backend"),
    ({"kind": "classifier", "model": "m", "backend": "vllm"}, "reward.model.backend"),
])
def test_reward_model_settings_are_checked_naming_the_key(model, match):
    with pytest.raises(ConfigError, match=match):
        parse_job_config({"reward": {"model": model}})
    with pytest.raises(ConfigError, match="rule_weight"):
        parse_job_config({"reward": {"combine": {"rule_weight": 0.0, "model_weight": 0.0}}})
    ok = parse_job_config({"reward": {"model": {"kind": "judge", "model": "m", "pairwise": True,
                                                 "template": "{question}: {response} or {other}?"}}})
    assert ok.reward.model.pairwise and ok.reward.model.verdict_scores == {"yes": 1.0, "no": 0.0}
