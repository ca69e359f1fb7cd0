"""The mismatch observatory: per-source and per-layer attribution, the bf16-layer suggestion, its files, its
config key and the loop flag.

Every assertion compares the observatory with itself or with an exact property of the numerics (a source
that is off reproduces the reference bitwise; a layer kept in bf16 is the high-precision layer;
batch-invariant engines agree bitwise), so none depends on a measured number of this machine. Where an
inequality is asserted (a source that is on moves logprobs), the margin is any nonzero difference: an FP8
rounding of every weight, activation or key moves a 3-layer random model's logprobs by ~1e-2 (measured
mean |Δlogp| 1e-2..7e-2), far from exact agreement.
"""

import json
import logging
import math

import pytest

from fp8rl.config import ConfigError, JobConfig
from fp8rl.model import CausalLM, save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.observatory import ObservatoryConfig, ObservatoryResult, Probe, best_split, observe
from fp8rl.observatory.result import JSON, MARKDOWN, PNG

LAYERS = 3  # conftest.tiny_config's


@pytest.fixture(scope="module")
def model(policy) -> CausalLM:
    """The engine tests' seeded 3-layer model (``conftest.policy``: width 256, two FP8 blocks, GQA 2:1, the
    CharTokenizer's special ids), whose every forward takes milliseconds."""
    return policy


def _observe(model, prompts, search=False, **kw) -> ObservatoryResult:
    cfg = ObservatoryConfig(**{"n": 2, "max_tokens": 8, **kw})
    return observe(model, prompts, cfg, pad_token_id=0, eos_token_ids=[2], name="tiny", search=search)


@pytest.fixture(scope="module")
def fp8_kv(model, prompts) -> ObservatoryResult:
    """fp8_e2e with an FP8 KV cache, layers 0 and 2 kept in bf16: every source on."""
    return _observe(model, prompts, search=True, recipe="fp8_e2e", kv_cache_dtype="fp8",
                    num_first_layers_in_bf16=1, num_last_layers_in_bf16=1, target=10.0)


def test_sources_the_recipe_does_not_use_are_bitwise_the_reference(model, prompts):
    r = _observe(model, prompts, search=True, recipe="bf16", kv_cache_dtype="auto")
    for name in ("linear", "qkv", "probs", "rollout_numerics"):  # variants equal to the reference: bitwise
        row = r.source(name)
        assert row.token_mult_prob_error == 1.0 and row.max_abs_dlogp == 0.0, row
    assert not any(r.source(n).on for n in ("linear", "qkv", "probs"))
    assert all(row.local_rel_err == 0.0 and row.cumulative_rel_err == 0.0 for row in r.layers)  # no FP8 layer
    # no FP8 linear to keep in bf16: the observed setting stands, measured once
    assert [(c.first, c.last) for c in r.suggestion.candidates] == [(0, 0)]
    assert r.suggestion.token_mult_prob_error == r.source("total").token_mult_prob_error


def test_sources_the_recipe_uses_move_logprobs(fp8_kv):
    for name in ("linear", "qkv", "probs", "rollout_numerics"):
        row = fp8_kv.source(name)
        assert row.on and row.token_mult_prob_error > 1.0 and row.mean_abs_dlogp > 0.0, row


def test_probs_source_is_off_without_fp8_attention(model, prompts):
    """FP8 KV without FP8 attention keeps the probabilities (and Q) unrounded: only K/V move."""
    r = _observe(model, prompts, recipe="bf16", kv_cache_dtype="fp8", fp8_attention=False)
    assert not r.source("probs").on and r.source("probs").max_abs_dlogp == 0.0
    assert r.source("qkv").on and r.source("qkv").token_mult_prob_error > 1.0


def test_decode_source_and_total_are_bitwise_equal_under_batch_invariance(model, prompts):
    r = _observe(model, prompts, recipe="fp8_e2e", kv_cache_dtype="fp8", batch_invariant=True)
    assert not r.source("decode").on
    assert r.source("decode").max_abs_dlogp == 0.0  # decode order = full-forward order, bitwise
    assert r.source("total").max_abs_dlogp == 0.0  # the trainer recomputes the rollout's numbers
    assert r.source("qkv").token_mult_prob_error > 1.0  # ... which still differ from high precision


def test_a_layer_kept_in_bf16_adds_no_linear_error_of_its_own(fp8_kv):
    first, middle, last = fp8_kv.layers
    assert not first.in_fp8 and middle.in_fp8 and not last.in_fp8
    assert first.local_rel_err == 0.0 and last.local_rel_err == 0.0  # the high-precision layer itself
    assert first.cumulative_rel_err == 0.0  # nothing before it is FP8 either
    assert middle.local_rel_err > 0.0 and last.cumulative_rel_err > 0.0  # layer 1's error reaches layer 2
    # "if FP8" measures the bf16 layers too (what putting them back in FP8 would cost)
    assert all(row.alone_rel_err > 0.0 and row.alone_token_mult_prob_error > 1.0 for row in fp8_kv.layers)
    assert middle.alone_rel_err == middle.local_rel_err  # the same FP8 layer on the same input


def test_suggestion_met_at_once_is_the_observed_setting_measured(fp8_kv):
    s = fp8_kv.suggestion
    assert s.met and (s.first, s.last) == (0, 0) and len(s.candidates) == 1  # target 10: any setting meets it
    assert s.token_mult_prob_error <= s.target


def test_suggestion_walks_up_until_the_re_measured_mismatch_meets_the_target(model, prompts):
    """fp8_gen_only with batch-invariant engines: the trainer runs bf16 linears, so the rollout agrees with it
    bitwise (1.0) only once every layer is bf16 on both sides; with any FP8 layer left it cannot. Target 1.0
    is therefore met at first + last = LAYERS and not before."""
    r = _observe(model, prompts, search=True, recipe="fp8_gen_only", kv_cache_dtype="auto", batch_invariant=True,
                 target=1.0, max_bf16_layers=LAYERS, layer_logprobs=False)
    s = r.suggestion
    assert s.met and s.first + s.last == LAYERS and s.token_mult_prob_error == 1.0
    assert [c.first + c.last for c in s.candidates] == list(range(LAYERS + 1))
    assert all(c.token_mult_prob_error > 1.0 for c in s.candidates[:-1])
    # re-measured with that recipe: a fresh rollout and recompute give the same number (seeded, deterministic)
    cfg = ObservatoryConfig(recipe="fp8_gen_only", kv_cache_dtype="auto", batch_invariant=True, n=2, max_tokens=8)
    probe = Probe(model, prompts, cfg, pad_token_id=0, eos_token_ids=[2])
    assert probe.total(s.first, s.last)[2].token_mult_prob_error == s.token_mult_prob_error


def test_suggestion_falls_back_to_the_best_measured_within_the_budget(model, prompts):
    """FP8 KV on the rollout only (no batch invariance): no bf16-layer setting makes the trainer agree
    exactly, so target 1.0 is never met and the lowest measured candidate is reported."""
    r = _observe(model, prompts, search=True, recipe="fp8_gen_only", kv_cache_dtype="fp8", target=1.0,
                 max_bf16_layers=1, layer_logprobs=False)
    s = r.suggestion
    assert not s.met and s.max_bf16_layers == 1 and len(s.candidates) == 2
    assert s.token_mult_prob_error == min(c.token_mult_prob_error for c in s.candidates)
    assert "no setting with at most 1 bf16 layers met the target" in r.to_markdown()


def test_best_split_keeps_the_costliest_layers_in_bf16():
    assert best_split([0.5, 0.1, 0.1, 0.4], 2) == (1, 1, pytest.approx(0.2))
    assert best_split([0.1, 0.1, 0.3, 0.4], 2) == (0, 2, pytest.approx(0.2))
    with pytest.raises(ValueError, match="k must be in 0..4"):
        best_split([0.1] * 4, 5)


def _table(md: str, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header line starts with ``header``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_files_are_written_and_parse(fp8_kv, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    md = fp8_kv.write(tmp_path)
    assert (tmp_path / MARKDOWN).read_text() == md
    sources = _table(md, "| source |")
    assert [row[0] for row in sources] == [r.name for r in fp8_kv.sources]
    for row, src in zip(sources, fp8_kv.sources, strict=True):
        value, se = (float(x) for x in row[3].split(" ± "))  # printed to 6 decimals, with its standard error
        assert value == pytest.approx(src.token_mult_prob_error, abs=1e-6)
        assert se == pytest.approx(src.standard_error, abs=1e-6)
        assert row[4] == f"{src.num_sequences} / {src.num_tokens}"
    layers = _table(md, "| layer |")
    assert [int(row[0]) for row in layers] == list(range(LAYERS))
    assert [row[1] for row in layers] == ["bf16", "fp8", "bf16"]
    assert len(_table(md, "| num_first_layers_in_bf16 |")) == len(fp8_kv.suggestion.candidates)
    png = imread(tmp_path / PNG)
    assert png.ndim == 3 and png.shape[0] > 100 and png.shape[1] > 300
    assert ObservatoryResult.from_dict(json.loads((tmp_path / JSON).read_text())) == fp8_kv


def test_report_appends_the_observatory_to_its_summary(fp8_kv, tmp_path):
    from fp8rl.report import write_report

    out = write_report([{"step": 0, "reward_mean": 0.5, "accuracy": 0.5, "token_mult_prob_error": 1.01}], tmp_path,
                       observatory=fp8_kv)
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GRPO run") and "## Mismatch observatory" in summary
    assert (out / MARKDOWN).read_text() in summary


# ---------------------------------------------------------------------------------------------- config and loop


def test_auto_bf16_layers_is_accepted_for_the_loop_and_refused_by_the_services():
    job = JobConfig().with_settings({"policy.numerics.auto_bf16_layers": True})
    assert job.policy.numerics.auto_bf16_target == 1.03
    with pytest.raises(ConfigError, match=r"policy\.numerics\.auto_bf16_layers=true is run by the in-process loop"):
        job.check_services()
    JobConfig().check_services()  # the default job runs anywhere


@pytest.mark.parametrize("changes,match", [
    ({"policy.training.backend": "megatron"}, "auto_bf16_layers=true needs policy.training.backend=torch"),
    ({"policy.generation.vllm_cfg.num_first_layers_in_bf16": 2}, "leave them at 0 \\(got 2 / 0\\)"),
    ({"policy.numerics.auto_bf16_target": 0.99}, "policy.numerics.auto_bf16_target"),
])
def test_auto_bf16_layers_refusals_name_the_key(changes, match):
    with pytest.raises(ConfigError, match=match):
        JobConfig().with_settings({"policy.numerics.auto_bf16_layers": True, **changes})


@pytest.mark.parametrize("path,function", [("services/controller/runner.py", "submit"),
                                           ("services/common/runtime.py", "serve")])
def test_services_run_the_services_check_where_they_read_a_job(path, function):
    """The controller's submit and every service's start call ``JobConfig.check_services`` (not run here:
    they need Redis and a port)."""
    import ast
    from pathlib import Path

    src = (Path(__file__).resolve().parents[3] / path).read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == function)
    assert "job.check_services()" in [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)]


def test_loop_flag_runs_the_observatory_and_builds_both_engines_with_its_choice(model, tmp_path, caplog):
    from fp8rl.loop import GRPOLoop, LoopConfig, _parser, run

    assert _parser().parse_args(["--auto-bf16-layers"]).auto_bf16_layers is True
    save_hf_checkpoint(model, model.config, tmp_path / "model")
    CharTokenizer().save(tmp_path / "model")
    cfg = LoopConfig.from_flags(model=str(tmp_path / "model"), recipe="fp8_gen_only", kv_cache_dtype="auto",
                                batch_invariant=True, auto_bf16_layers=True, auto_bf16_target=1.0, steps=1,
                                prompts_per_step=2, group_size=2, max_tokens=4, eval_size=2,
                                out_dir=str(tmp_path / "report"))
    with caplog.at_level(logging.INFO, logger="fp8rl.loop"):
        loop = GRPOLoop(cfg)
    s = loop.observatory.suggestion
    # as in test_suggestion_walks_up...: only all-bf16 linears agree bitwise with the bf16 trainer
    assert s.met and s.first + s.last == LAYERS
    for recipe in (loop.rollout.recipe, loop.trainer.recipe):
        assert (recipe.num_first_layers_in_bf16, recipe.num_last_layers_in_bf16) == (s.first, s.last)
    assert f"num_first_layers_in_bf16={s.first} num_last_layers_in_bf16={s.last}" in caplog.text
    assert math.isfinite(s.token_mult_prob_error)
    summary = run(cfg, progress=False, loop=loop)["summary"]
    assert (summary["auto_bf16/num_first_layers_in_bf16"], summary["auto_bf16/num_last_layers_in_bf16"]) == (
        s.first, s.last)
    assert "## Mismatch observatory" in (tmp_path / "report" / "summary.md").read_text()


def test_a_moe_models_routing_flips_are_a_source_of_their_own(model, prompts):
    """Mixture-of-experts models get a ``routing`` row (the trainer's own routing against the rollout's experts
    replayed); under batch invariance routing agrees bitwise, so the row is exactly 1.0. Dense models have none."""
    import torch

    from .conftest import tiny_config

    torch.manual_seed(0)
    moe = CausalLM(tiny_config(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=128, initializer_range=0.08)).eval()
    assert all(r.name != "routing" for r in _observe(model, prompts, recipe="bf16", kv_cache_dtype="auto").sources)
    exact = _observe(moe, prompts, recipe="fp8_e2e", kv_cache_dtype="fp8", batch_invariant=True).source("routing")
    assert exact.on and exact.token_mult_prob_error == 1.0 and exact.max_abs_dlogp == 0.0
    row = _observe(moe, prompts, recipe="fp8_e2e", kv_cache_dtype="fp8").source("routing")
    assert row.on and row.token_mult_prob_error >= 1.0
