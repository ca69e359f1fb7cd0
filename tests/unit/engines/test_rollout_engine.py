"""Embedded rollout engine: agreement with an HF forward, FP8 bounds, KV-FP8 scales, in-place refit."""

import pytest
import torch
import transformers

from fp8rl.engines import (
    QKVCalibrator,
    SamplingParams,
    TorchRolloutEngine,
    TrainBatch,
    VersionMismatchError,
    WeightLoadError,
    sequence_logprobs,
)
from fp8rl.fp8 import Fp8Recipe, QKVScales, fp8_linear_names, quantize_state_dict
from fp8rl.rl import token_mult_prob_error
from fp8rl.rl.metrics import mismatch_promise

ATOL_HF_LOGPROB = 1e-4  # FP32 engine (cached decode) vs transformers (full forward)
# FP8-linear engine vs the high-precision reference is the fp8_gen_only pairing: its one-step promise
FP8_MAX_ERROR = mismatch_promise("fp8_gen_only", over="step")
BF16 = Fp8Recipe(linear="bf16")
FP8 = Fp8Recipe(linear="fp8")


def _engine(policy, recipe, **kw):
    return TorchRolloutEngine(policy, recipe, eos_token_ids=[2], pad_token_id=0, **kw)


def _batch_from(samples, pad=0):
    rows = [list(s.prompt_ids) + list(s.token_ids) for s in samples]
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), pad)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    gen = torch.zeros(len(rows), T)
    for b, (s, r) in enumerate(zip(samples, rows, strict=False)):
        ids[b, :len(r)] = torch.tensor(r)
        attn[b, :len(r)] = 1
        P, n = len(s.prompt_ids), len(s.token_ids)
        mask[b, P:P + n] = 1
        gen[b, P:P + n] = torch.tensor(s.logprobs)
    return TrainBatch(ids, attn, mask, torch.zeros(len(rows)), gen)


def test_bf16_engine_logprobs_match_hf_forward(policy, prompts, tmp_path):
    from fp8rl.model import save_hf_checkpoint

    save_hf_checkpoint(policy, policy.config, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    eng = _engine(policy, BF16)
    samples = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=3))
    assert len(samples) == 8 and [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    for s in samples:
        ids = torch.tensor([list(s.prompt_ids) + list(s.token_ids)])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        hf_gen = lp[len(s.prompt_ids) - 1:]
        torch.testing.assert_close(torch.tensor(s.logprobs), hf_gen, atol=ATOL_HF_LOGPROB, rtol=0)


def test_sampling_is_seeded_and_stops_on_eos(policy, prompts):
    eng = _engine(policy, BF16)
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, n=3, seed=11)
    a, b = eng.generate(prompts, p), eng.generate(prompts, p)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for s in a:
        assert len(s.token_ids) == len(s.logprobs) <= 10
        assert (s.finish_reason == "stop") == (s.token_ids[-1] == 2)
        assert 2 not in s.token_ids[:-1]
    greedy = eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=6))
    ids = torch.tensor([list(prompts[0])])
    with torch.no_grad():
        first = policy(ids)[0, -1].argmax().item()
    assert greedy[0].token_ids[0] == first


def test_fp8_engine_differs_from_bf16_by_a_bounded_amount(policy, prompts):
    samples = _engine(policy, FP8).generate(prompts, SamplingParams(max_tokens=12, n=4, seed=5))
    batch = _batch_from(samples)
    ref = sequence_logprobs(policy, batch.input_ids, batch.attention_mask)
    err = float(token_mult_prob_error(ref, batch.gen_logprobs, batch.loss_mask))
    print(f"FP8-linear engine vs BF16 reference: token_mult_prob_error {err:.5f}")
    assert 1.0 < err < FP8_MAX_ERROR


def _calibrated(policy, prompts, version=0):
    return QKVCalibrator(policy).calibrate(version, prompts)


def test_fp8_kv_refuses_to_serve_without_matching_scales_and_uses_given_scales(policy, prompts):
    eng = _engine(policy, Fp8Recipe(linear="bf16", kv_cache_dtype="fp8"))
    with pytest.raises(RuntimeError, match="placeholder 1.0 scales"):
        eng.generate(prompts, SamplingParams(max_tokens=4))
    scales = _calibrated(policy, prompts)
    eng.load_scales(scales)
    p = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=9)
    good = eng.generate(prompts, p)
    ref = _batch_from(good)
    ref_lp = sequence_logprobs(policy, ref.input_ids, ref.attention_mask)
    err_good = float(token_mult_prob_error(ref_lp, ref.gen_logprobs, ref.loss_mask))
    # wrong K/V scales (100x too small: values saturate at ±448·scale) must change the outputs a lot
    bad = QKVScales(0, scales.q, [s / 100 for s in scales.k], [s / 100 for s in scales.v])
    eng.load_scales(bad)
    bad_samples = eng.generate(prompts, p)
    b2 = _batch_from(bad_samples)
    err_bad = float(token_mult_prob_error(sequence_logprobs(policy, b2.input_ids, b2.attention_mask),
                                          b2.gen_logprobs, b2.loss_mask))
    assert err_good < FP8_MAX_ERROR
    assert (err_bad - 1) > 3 * (err_good - 1)


def test_refit_in_place_and_invariants(policy, prompts):
    recipe = Fp8Recipe(linear="fp8", kv_cache_dtype="fp8")
    eng = _engine(policy, recipe)
    eng.load_scales(_calibrated(policy, prompts))
    q_proj = eng.model.model.layers[1].self_attn.q_proj
    ptrs = (q_proj.weight.data_ptr(), q_proj.weight_scale.data_ptr(), eng.model.lm_head.weight.data_ptr())
    new_sd = {k: v + 0.01 * torch.randn_like(v) for k, v in policy.state_dict().items()}
    with pytest.raises(WeightLoadError, match="QKV scales"):
        eng.load_weights(1, new_sd)  # FP8 KV without scales
    with pytest.raises(WeightLoadError, match="version 0 but the weights are version 1"):
        eng.load_weights(1, new_sd, _calibrated(policy, prompts, version=0))
    bad = dict(new_sd)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"].clone()
    bad["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    before = eng.generate(prompts, SamplingParams(max_tokens=5, seed=1))
    with pytest.raises(WeightLoadError, match="up_proj.weight"):
        eng.load_weights(1, bad, QKVScales(1, *[[1e-2] * 3] * 3))
    missing = {k: v for k, v in new_sd.items() if not k.endswith("v_proj.weight")}
    with pytest.raises(WeightLoadError, match="missing"):
        eng.load_weights(1, missing, QKVScales(1, *[[1e-2] * 3] * 3))
    assert eng.weight_version == 0
    assert [s.token_ids for s in eng.generate(prompts, SamplingParams(max_tokens=5, seed=1))] == \
        [s.token_ids for s in before]  # failed loads left version 0 serving
    # a good load, shipped as FP8 bytes + block scales
    shipped = quantize_state_dict(new_sd, fp8_linear_names(eng.model, recipe))
    from fp8rl.model import CausalLM

    m1 = CausalLM(policy.config)
    m1.load_state_dict(new_sd)
    eng.load_weights(1, shipped, QKVScales(1, *[list(_calibrated(m1, prompts, 1).q)] * 3))
    assert eng.weight_version == 1
    assert (q_proj.weight.data_ptr(), q_proj.weight_scale.data_ptr(), eng.model.lm_head.weight.data_ptr()) == ptrs
    with pytest.raises(VersionMismatchError, match="pinned to weight version 0.*holds version 1"):
        eng.generate(prompts, SamplingParams(max_tokens=3), weight_version=0)
    with pytest.raises(WeightLoadError, match="already holds 1"):
        eng.load_weights(0, new_sd, QKVScales(0, *[[1e-2] * 3] * 3))
    # FP8 bytes and high-precision weights give the same engine numerics
    eng2 = _engine(policy, recipe)
    eng2.load_weights(1, new_sd, QKVScales(1, *[list(_calibrated(m1, prompts, 1).q)] * 3))
    p = SamplingParams(max_tokens=6, n=2, seed=4)
    assert [s.logprobs for s in eng.generate(prompts, p)] == [s.logprobs for s in eng2.generate(prompts, p)]


def test_bad_requests_are_refused(policy):
    eng = _engine(policy, BF16)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="exceeds"):
        eng.generate([[1] * 100], SamplingParams(max_tokens=64))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_a_taken_model_is_converted_in_place_and_samples_as_a_copy_does(policy, prompts):
    """``take_model`` (the rollout service's freshly loaded policy): the engine converts that object, never a second
    copy, and samples bitwise what an engine on a copy samples; it cannot also share a trainer's weights."""
    import copy

    mine = copy.deepcopy(policy)
    taken = TorchRolloutEngine(mine, FP8, eos_token_ids=[2], take_model=True)
    assert taken.model is mine
    p = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3)
    a, b = _engine(policy, FP8).generate(prompts, p), taken.generate(prompts, p)
    assert [(s.token_ids, s.logprobs) for s in a] == [(s.token_ids, s.logprobs) for s in b]
    with pytest.raises(ValueError, match="take_model and shared_with"):
        TorchRolloutEngine(copy.deepcopy(policy), FP8, eos_token_ids=[2], take_model=True, shared_with=policy)
