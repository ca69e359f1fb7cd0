"""The in-process GRPO loop really learns, FP8 end to end with an FP8 KV cache, on the tiny-arith preset.

How learning is judged (the tiny-arith weights differ per machine, and so does every trajectory:
CPU kernels round differently, so nothing here depends on exact numbers):

* **Statistic** — the policy's expected reward on the whole task: over every distinct problem of
  the task (:meth:`GRPOLoop.task_problems`; 126 for two operands up to 9, so the set is the population and
  no problem-sampling noise enters), the mean fraction of ``EVAL_SAMPLES`` samples at temperature 1
  that the *rollout engine* answers right, measured before step 0 and after the last step.
  ``gain = after - before``. The rollout engine is measured, not the trainer, so a refit that never
  reaches the rollout shows as no gain.
* **Noise** — each measurement averages ``N * EVAL_SAMPLES`` Bernoulli draws, so
  ``SE(gain) = sqrt(sum_i p_i(1-p_i)/n over both measurements) / N``
  (:func:`fp8rl.rl.metrics.expected_reward_gain`, from the
  measured ``p_i``, as for independent draws; the shared sampler seed can only couple the two, and a
  policy whose weights did not change scores ``gain`` ~ 0, moved only by its recalibrated KV scales).
  At most sqrt(2 * N * 0.25 / n) / N = 0.0074 for N = 126, n = 72 (every p_i = 1/2); 0.0062 measured.
* **Margin** — ``REQUIRED_GAIN = 0.03`` and the judge first requires ``SE <= REQUIRED_GAIN / 4``, so a
  run that did not learn passes with probability below Phi(-4) ~ 3e-5. Measured gains after 32
  steps (lr 1e-4): 0.056–0.095 over seeds 0 and 1, native AVX-512 and AVX2-restricted kernels.
* **Negative controls** (same judge, must fail): lr = 0 (the optimizer moves nothing), a refit that
  never reaches the rollout engine, and negated rewards (wrong advantages). They sit in the
  ``controls`` tier (``make test-controls``, run by ``.ci/run``) to keep ``make test`` short.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fp8rl.config import ConfigError
from fp8rl.loop import GRPOLoop, LoopConfig, main, run
from fp8rl.presets import prepare_tiny_arith
from fp8rl.rl.metrics import expected_reward_gain, mismatch_promise

TASK = {"max_operand": 9, "num_terms": 2, "ops": ("+", "-"), "word_problems": False}
STEPS = 32  # the learning run (about 45 s on 2 cores)
CONTROL_STEPS = 12  # the negative controls: enough to move the policy when learning is broken
EVAL_SAMPLES = 72  # samples per problem per measurement: SE <= 0.0075 even if every p_i were 1/2
EVAL_SEED = 12345
REQUIRED_GAIN = 0.03  # absolute expected-reward gain the learning run must show
SE_FRACTION = 0.25  # the measurement's SE may be at most this fraction of REQUIRED_GAIN


@pytest.fixture(scope="module")
def preset():
    return prepare_tiny_arith(progress=False)


def _config(steps: int, **kw) -> LoopConfig:
    base = dict(recipe="fp8_e2e", kv_cache_dtype="fp8", steps=steps, prompts_per_step=16, group_size=8, lr=1e-4,
                num_minibatches=4, eval_size=64, seed=0, arith=TASK)
    return LoopConfig.from_flags(**{**base, **kw})


_BEFORE: dict[tuple, list[float]] = {}  # the step-0 measurement, by everything in the config but its length


def _start_key(cfg: LoopConfig) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in cfg.job.settings().items() if k != "job.steps"))


def learning_run(cfg: LoopConfig, patch=None, *, share_weights: bool | None = None) -> tuple[float, float, dict]:
    """Build the loop, measure, run ``cfg``, measure again: ``(gain, se, run result)``.

    ``patch(loop)`` breaks something after the first measurement (the negative controls) and may
    return an ``undo()`` that runs before the second, so both measure the same way. The first
    measurement is of the loop as built — a function of the config without its step count, computed
    deterministically in this process — so runs that start alike share it (the controls reuse the
    learning run's); ``test_the_start_measurement_is_a_function_of_the_config`` checks that it is.
    ``share_weights`` is the loop's (a control that intercepts the refit's copy needs one to intercept).
    """
    loop = GRPOLoop(cfg, share_weights=share_weights)
    problems = loop.task_problems()
    key = _start_key(cfg)
    if key not in _BEFORE:
        _BEFORE[key] = loop.solve_rates(problems, n=EVAL_SAMPLES, temperature=1.0, seed=EVAL_SEED)
    before = _BEFORE[key]
    undo = patch(loop) if patch is not None else None
    res = run(cfg, progress=False, loop=loop)
    if undo is not None:
        undo()
    after = loop.solve_rates(problems, n=EVAL_SAMPLES, temperature=1.0, seed=EVAL_SEED)
    gain, se = expected_reward_gain(before, after, EVAL_SAMPLES)
    print(f"{len(problems)} problems: expected reward {sum(before) / len(before):.4f} -> "
          f"{sum(after) / len(after):.4f}, gain {gain:+.4f} (SE {se:.4f}, required {REQUIRED_GAIN})")
    return gain, se, res


def learned(gain: float, se: float) -> bool:
    """The judge: a gain of at least REQUIRED_GAIN, measured with SE <= SE_FRACTION * REQUIRED_GAIN."""
    assert se <= SE_FRACTION * REQUIRED_GAIN, f"measurement too noisy to judge: SE {se:.4f}"
    return gain >= REQUIRED_GAIN


@pytest.mark.learning  # about 2 minutes on 2 cores: make test-controls (with its controls)
def test_fp8_e2e_kv_fp8_loop_learns_and_reports(preset, tmp_path):
    cfg = _config(STEPS, out_dir=str(tmp_path))
    gain, se, res = learning_run(cfg)
    assert learned(gain, se), f"no learning: gain {gain:+.4f} < {REQUIRED_GAIN} (SE {se:.4f})"

    steps = res["steps"]
    # the rollout engine served step s at version s, then held v = s+1 — weights and scales of v together
    assert [h["rollout/served_version"] for h in steps] == list(range(STEPS))
    assert [h["rollout/weight_version"] for h in steps] == list(range(1, STEPS + 1))
    assert [h["rollout/scales_version"] for h in steps] == list(range(1, STEPS + 1))
    assert [h["weight_version"] for h in steps] == list(range(1, STEPS + 1))

    s = res["summary"]
    promise = mismatch_promise("fp8_e2e", "fp8")
    print(f"token_mult_prob_error median {s['token_mult_prob_error_median']:.5f} "
          f"(mean {s['token_mult_prob_error_mean']:.5f}), promise {promise}")
    assert 1.0 <= s["token_mult_prob_error_median"] <= promise
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS and "token_mult_prob_error" in json.loads(lines[0])


def _lr_zero(loop: GRPOLoop):
    for g in loop.trainer.optimizer.param_groups:
        g["lr"] = 0.0
    start = {k: v.clone() for k, v in loop.trainer.state_dict().items()}

    def undo() -> None:  # the optimizer really moved nothing
        assert all(torch.equal(v, start[k]) for k, v in loop.trainer.state_dict().items())
    return undo


def _refit_never_reaches_the_rollout(loop: GRPOLoop):
    frozen = {k: v.clone() for k, v in loop.trainer.state_dict().items()}
    load = loop.rollout.load_weights
    loop.rollout.load_weights = lambda version, _tensors, qkv_scales=None: load(version, frozen, qkv_scales)


def _negated_rewards(loop: GRPOLoop):
    right = loop.grader
    loop.grader = lambda text, answer: 1.0 - right(text, answer)  # every advantage gets the wrong sign

    def undo() -> None:
        loop.grader = right
    return undo


CONTROLS = {"lr_zero": _lr_zero, "refit_never_reaches_the_rollout": _refit_never_reaches_the_rollout,
            "negated_rewards": _negated_rewards}


@pytest.mark.controls  # about 50 s each on 2 cores: make test-controls (.ci/run runs it)
@pytest.mark.parametrize("control", list(CONTROLS))
def test_the_judge_rejects_broken_learning(preset, control):
    """Negative controls: each breaks one thing learning needs; the same judge must say 'did not learn'."""
    # the refit control intercepts the weights a refit copies: its loop keeps a copy per role
    gain, se, _ = learning_run(_config(CONTROL_STEPS), CONTROLS[control],
                               share_weights=False if control == "refit_never_reaches_the_rollout" else None)
    assert not learned(gain, se), f"{control}: gain {gain:+.4f} passed the judge"


def test_the_start_measurement_is_a_function_of_the_config(preset):
    """What lets the runs share their step-0 measurement: a loop built again from the same config (another
    length) measures the same rates, sample for sample, on a subset of the problems."""
    a, b = GRPOLoop(_config(CONTROL_STEPS)), GRPOLoop(_config(STEPS))
    problems = a.task_problems()[:16]
    assert a.solve_rates(problems, n=8, temperature=1.0, seed=EVAL_SEED) == \
        b.solve_rates(problems, n=8, temperature=1.0, seed=EVAL_SEED)


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--recipe", "fp4"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="grpo.num_generations_per_prompt: must be >= 2"):
        LoopConfig.from_flags(group_size=1)
    with pytest.raises(SystemExit):
        main(["--group-size", "1"])
    assert "grpo.num_generations_per_prompt" in capsys.readouterr().err


def test_the_loop_runs_a_job_file_and_flags_set_its_keys(preset, tmp_path, capsys):
    """--config is the services' job YAML: the run's recorded config is that job, with only the flagged key changed."""
    from fp8rl.config import load_job_config

    job = tmp_path / "job.yaml"
    job.write_text("job: {name: loop-file, steps: 5, eval_size: 4, seed: 3}\n"
                   "grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}\n"
                   "policy: {generation: {max_new_tokens: 4}, training: {lr: 0.001}}\n"
                   "loss: {importance_sampling: {mode: tis}}\n")
    assert main(["--config", str(job), "--steps", "1", "--out", str(tmp_path / "out")]) == 0
    recorded = json.loads((tmp_path / "out" / "summary.json").read_text())["config"]["job"]
    assert recorded == load_job_config(job).with_settings({"job.steps": 1}).to_dict()
    assert "fp8_e2e" in capsys.readouterr().out


def _job_beside_its_data(jobs: Path, *extra: str) -> Path:
    """``jobs/job.yaml``, a 1-step tiny-arith job, reading ``data.path: train.jsonl`` from beside it."""
    from fp8rl.data import ArithDataset

    jobs.mkdir()
    rows = ArithDataset(seed=0).eval_set(8)
    (jobs / "train.jsonl").write_text("".join(json.dumps({"prompt": r.prompt, "answer": r.answer}) + "\n"
                                              for r in rows))
    job = jobs / "job.yaml"
    job.write_text("job: {steps: 1, eval_size: 2, seed: 3}\n"
                   "grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}\n"
                   "policy: {generation: {max_new_tokens: 4}}\n"
                   "data: {task: jsonl, path: train.jsonl}\n" + "".join(extra))
    return job


def test_the_loop_reads_data_beside_its_job_file_and_refuses_it_outside_data_root(preset, tmp_path, monkeypatch,
                                                                                   capsys):
    """Issue 47: the data root defaults to the job file's directory (the controller's rule), not the working
    directory; ``--data-root`` names another, and a data file not under it is refused before any engine is built."""
    job = _job_beside_its_data(tmp_path / "jobs")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # train.jsonl is not under the working directory
    assert main(["--config", str(job), "--out", str(tmp_path / "out")]) == 0
    recorded = json.loads((tmp_path / "out" / "run.json").read_text())["data_root"]
    assert Path(recorded) == job.resolve().parent  # what --resume reads the data under again
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--config", str(job), "--data-root", str(tmp_path / "elsewhere"), "--out", str(tmp_path / "out2")])
    err = capsys.readouterr().err
    assert "data.path: 'train.jsonl' does not exist under the data root" in err and "--data-root" in err
    assert not (tmp_path / "out2").exists()


def _small(**kw) -> LoopConfig:
    return _config(3, prompts_per_step=4, group_size=4, num_minibatches=1, eval_size=8, **kw)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_gen_only", "fp8_e2e"])
def test_shared_weights_run_number_for_number_as_copies_and_hold_one_copy(preset, recipe):
    """The synchronous loop's rollout computes with the trainer's tensors (no copy; FP8 forms from the trainer's
    cache under fp8_e2e): the run is the run with a copy per role, sample for sample, and the rollout holds no
    high-precision tensor of its own, nor an FP32 dequantization between generations."""
    from fp8rl.fp8 import Fp8InferenceLinear

    cfg = _small(recipe=recipe)
    shared, copied = GRPOLoop(cfg), GRPOLoop(cfg, share_weights=False)
    assert shared.shares_weights and not copied.shares_weights
    a, b = run(cfg, progress=False, loop=shared), run(cfg, progress=False, loop=copied)
    keys = ("reward_mean", "token_mult_prob_error", "gen_kl_k3", "train/loss", "response_len", "weight_version")
    for x, y in zip(a["steps"], b["steps"], strict=True):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
    assert a["summary"]["val_accuracy_end"] == b["summary"]["val_accuracy_end"]
    trainer = {p.untyped_storage().data_ptr() for p in shared.trainer.model.parameters()}
    own = [n for n, p in shared.rollout.model.named_parameters() if p.untyped_storage().data_ptr() not in trainer]
    assert not own, f"the shared rollout holds copies: {own[:3]}"
    fp8 = [m for m in shared.rollout.model.modules() if isinstance(m, Fp8InferenceLinear)]
    assert bool(fp8) == (recipe != "bf16")
    if recipe == "fp8_e2e":  # the trainer's cached E4M3 forms, not a second quantization
        caches = {m.weight_cache.q.data_ptr() for m in shared.trainer.model.modules()
                  if getattr(m, "weight_cache", None) is not None and m.weight_cache.q is not None}
        assert all(m.weight.data_ptr() in caches for m in fp8)
    # between generations the rollout's FP8 layers hold no FP32 dequantization (the trainer's step needs the room),
    # nor, where the trainer keeps no FP8 form to share (fp8_gen_only), an E4M3 form of their own
    assert all(m._w_dequant is None for m in fp8)
    assert all(m.holds_weight == (recipe == "fp8_e2e") for m in fp8)
    with pytest.raises(Exception, match="shares the trainer's weights"):
        shared.rollout.load_weights(shared.trainer.version, shared.trainer.state_dict())


def test_async_with_lag_zero_is_the_synchronous_run_number_for_number(preset):
    sync, k0 = run(_small(), progress=False), run(_small(max_weight_lag=0), progress=False)
    keys = ("reward_mean", "token_mult_prob_error", "mismatch/max_abs_logprob_diff", "gen_kl_k3", "train/loss",
            "response_len", "weight_version")
    for a, b in zip(sync["steps"], k0["steps"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert sync["summary"]["val_accuracy_end"] == k0["summary"]["val_accuracy_end"]


def test_async_lag_one_overlaps_and_every_sample_has_its_versions_scales(preset):
    """k = 1 in process: each step's samples come from at most one version back (the property over the run), some
    do come from an older one (the overlap happened), and every generate call ran with the QKV scales of the
    version it served (FP8 KV: weights and scales of one version together)."""
    loop = GRPOLoop(_small(max_weight_lag=1))
    seen, gen = [], loop.rollout.generate

    def spy(prompts, params, *, weight_version=None, should_stop=None):
        with loop.rollout._lock:  # the engine's own (re-entrant) lock: no refit between the call and the reading
            out = gen(prompts, params, weight_version=weight_version, should_stop=should_stop)
            seen.append((loop.rollout.weight_version, loop.rollout.scales_version, {s.weight_version for s in out}))
        return out

    loop.rollout.generate = spy
    res = run(loop.cfg, progress=False, loop=loop)
    lags = [h["weight_lag_max"] for h in res["steps"]]
    assert max(lags) <= 1 and lags[1:] == [1.0] * (len(lags) - 1)
    assert all(w == s and versions <= {w} for w, s, versions in seen)
    assert {"stale/token_mult_prob_error", "stale/mismatch/max_abs_logprob_diff"} <= res["steps"][-1].keys()
    assert res["summary"]["weight_lag_max"] == 1.0


@pytest.mark.parametrize("lag", [None, 1])
def test_dapo_and_dr_grpo_keys_run_in_the_loop_with_their_counts_and_pass_at_k(preset, tmp_path, lag):
    """A job with every GRPO variant key (Dr. GRPO's aggregation and unnormalised advantages, DAPO's dynamic
    sampling, overlong shaping and filtering), synchronous and asynchronous: each step reports its counts and the
    policy entropy, and the validations report pass@j and mean@k into metrics.jsonl and the report."""
    extra = {} if lag is None else {"max_weight_lag": lag}
    cfg = _small(loss_agg_mode="seq-mean-token-sum-norm", normalize_rewards=False, dynamic_sampling=True,
                 overlong_filtering=True, eval_k=2, eval_every=2, **extra)
    cfg = LoopConfig(cfg.job.with_settings({"grpo.reward_shaping.enabled": True,
                                            "grpo.reward_shaping.overlong_buffer_length": 2}), str(tmp_path))
    res = run(cfg, progress=False)
    for row in res["steps"]:
        assert 1 <= row["dynamic_sampling/rounds"] <= cfg.job.grpo.dynamic_sampling_max_gen_batches
        assert row["dynamic_sampling/groups_kept"] <= 4 and row["train/entropy"] > 0
        assert 0 <= row["overlong/truncated_fraction"] <= 1 and "overlong/filtered_samples" in row
    assert sorted(res["validation"]) == [0, 2, 3]  # the start, step 2 (eval_every) and the end
    assert [v["val_weight_version"] for v in res["validation"].values()] == [0.0, 2.0, 3.0]
    for v in res["validation"].values():
        assert set(v) == {"val_accuracy", "val/pass@1", "val/pass@2", "val/mean@2", "val_weight_version"}
        assert v["val/pass@1"] <= v["val/pass@2"] and v["val/pass@1"] == v["val/mean@2"]
    assert res["summary"]["val/pass@2_end"] == res["validation"][3]["val/pass@2"]
    assert (tmp_path / "validation.png").is_file() and "pass@2" in (tmp_path / "summary.md").read_text()


def test_the_loop_writes_its_trained_policy_as_an_hf_directory_transformers_loads(preset, tmp_path):
    """With --out, the loop's final policy is an HF directory: its weights are the trainer's own after the last
    step (bitwise), and transformers' model on it gives our model's logits (ATOL_HF, the model tests' tolerance)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fp8rl.model import CausalLM
    from tests.unit.model.test_transformer import ATOL_HF

    cfg = replace(_config(1, prompts_per_step=4, group_size=4, num_minibatches=1, eval_size=4), out_dir=str(tmp_path))
    loop = GRPOLoop(cfg)
    start = {k: v.clone() for k, v in loop.trainer.state_dict().items()}
    run(cfg, progress=False, loop=loop)
    trained = loop.trainer.state_dict()
    saved = load_file(str(tmp_path / "policy" / "model.safetensors"))
    assert set(saved) == {k for k in trained if ".kv_quant." not in k}
    assert all(torch.equal(saved[k], trained[k]) for k in saved)
    assert any(not torch.equal(start[k], trained[k]) for k in saved)  # the step changed them: a real check
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32).eval()
    ours = CausalLM(loop.model_config)
    ours.load_state_dict({**saved, "lm_head.weight": saved.get("lm_head.weight", saved["model.embed_tokens.weight"])})
    ids = torch.tensor([loop.tok.encode("12+7=")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=ATOL_HF, rtol=0)
