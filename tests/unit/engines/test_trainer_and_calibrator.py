"""Embedded trainer (logprobs, train step, micro-batching, checkpoints) and the QKV calibrator."""

import torch

from fp8rl.engines import (
    QKVCalibrator,
    SamplingParams,
    TorchRolloutEngine,
    TorchTrainer,
    TrainBatch,
    TrainerConfig,
    build_train_batch,
)
from fp8rl.fp8 import Fp8Linear, recipe_for_role
from fp8rl.rl import mismatch_metrics

ATOL_LOGPROB_SAME_CODE = 1e-5  # same FP32 numerics, only cached-vs-full summation order differs
ATOL_MICROBATCH_GRAD = 1e-6
RTOL_PADDING = 1e-5  # padded vs unpadded batches: same values, different FP32 summation order


def _rollout_batch(policy, prompts, recipe_name, seed=0, kv="auto"):
    eng = TorchRolloutEngine(policy, recipe_for_role(recipe_name, "rollout", kv_cache_dtype=kv),
                             eos_token_ids=[2], pad_token_id=0)
    if kv == "fp8":
        eng.load_scales(QKVCalibrator(policy).calibrate(0, prompts))
    samples = eng.generate(prompts, SamplingParams(max_tokens=10, n=4, seed=seed))
    # every group holds both rewards whatever was sampled (a reward of the samples could be the same for all)
    rewards = torch.tensor([float(i % 2) for i in range(len(samples))], dtype=torch.float64)
    return build_train_batch(samples, rewards, 4, pad_id=0)


def _trainer(policy, recipe_name, **kw):
    return TorchTrainer(policy, recipe_for_role(recipe_name, "trainer"), TrainerConfig(lr=1e-3, **kw))


def test_bf16_trainer_logprobs_equal_rollout_logprobs(policy, prompts):
    batch = _rollout_batch(policy, prompts, "bf16")
    prev = _trainer(policy, "bf16").compute_logprobs(batch)
    m = batch.loss_mask.bool()
    torch.testing.assert_close(prev[m], batch.gen_logprobs[m], atol=ATOL_LOGPROB_SAME_CODE, rtol=0)


def test_mismatch_ordering_bf16_lt_e2e_lt_gen_only(policy, prompts):
    """The recipe's raison d'être: both engines rounding the same weights the same way."""
    err = {}
    for name in ("bf16", "fp8_e2e", "fp8_gen_only"):
        batch = _rollout_batch(policy, prompts, name, seed=3)
        prev = _trainer(policy, name).compute_logprobs(batch)
        err[name] = mismatch_metrics(prev, batch.gen_logprobs, batch.loss_mask)["gen_kl_k3"]
    assert err["bf16"] < err["fp8_e2e"] < err["fp8_gen_only"], err
    assert err["fp8_gen_only"] > 10 * err["fp8_e2e"], err  # not a near tie


def test_fp8_trainer_uses_fp8_linears_and_learns(policy, prompts):
    tr = _trainer(policy, "fp8_e2e")
    assert isinstance(tr.model.model.layers[0].mlp.up_proj, Fp8Linear)
    assert type(tr.model.lm_head) is torch.nn.Linear
    batch = _rollout_batch(policy, prompts, "fp8_e2e")
    before = {k: v.clone() for k, v in tr.state_dict().items()}
    m = tr.train_step(batch)
    assert tr.version == 1 and m["grad_norm"] > 0
    changed = [k for k, v in tr.state_dict().items() if not torch.equal(v, before[k])]
    assert "model.layers.0.mlp.up_proj.weight" in changed


def test_micro_batching_equals_full_batch_gradient(policy, prompts):
    batch = _rollout_batch(policy, prompts, "bf16")
    grads = []
    for mb in (16, 3):
        tr = _trainer(policy, "bf16", micro_batch_size=mb, grad_clip=0.0)
        b = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.advantages, batch.gen_logprobs)
        b.prev_logprobs = tr.compute_logprobs(b)
        tr.optimizer.step = lambda: None  # keep the gradients for inspection
        tr.train_step(b)
        grads.append(torch.cat([p.grad.flatten() for p in tr.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=ATOL_MICROBATCH_GRAD, rtol=1e-4)


def test_checkpoint_resume_is_bit_identical(policy, prompts, tmp_path):
    b1 = _rollout_batch(policy, prompts, "fp8_e2e", seed=1)
    b2 = _rollout_batch(policy, prompts, "fp8_e2e", seed=2)
    tr = _trainer(policy, "fp8_e2e")
    tr.train_step(b1)
    tr.save_checkpoint(str(tmp_path / "ckpt.pt"))
    tr.train_step(_copy(b2))
    want = tr.state_dict()
    tr2 = _trainer(policy, "fp8_e2e")
    tr2.load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert tr2.version == 1
    tr2.train_step(_copy(b2))
    assert tr2.version == 2
    for k, v in want.items():
        assert torch.equal(v, tr2.state_dict()[k]), k


def test_adamw_one_parameter_at_a_time_is_bitwise_the_multi_tensor_path(policy, prompts):
    """The CPU trainer's AdamW runs per parameter (foreach=False: no weights-sized sqrt(v) transient); two steps of it
    leave bitwise the weights and moments that torch's multi-tensor AdamW leaves."""
    batches = [_rollout_batch(policy, prompts, "bf16", seed=s) for s in (1, 2)]
    ours, theirs = _trainer(policy, "bf16"), _trainer(policy, "bf16")
    assert ours.optimizer.defaults["foreach"] is False
    theirs.optimizer = torch.optim.AdamW(theirs.model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0,
                                        foreach=True)
    for b in batches:
        for tr in (ours, theirs):
            tr.train_step(_copy(b))
    for (name, a), b in zip(ours.model.named_parameters(), theirs.model.parameters(), strict=True):
        assert torch.equal(a, b), name
        sa, sb = ours.optimizer.state[a], theirs.optimizer.state[b]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]), name


def _copy(b):
    return TrainBatch(b.input_ids, b.attention_mask, b.loss_mask, b.advantages, b.gen_logprobs)


def test_calibrator_scales_match_manual_amax_and_ignore_padding(policy, prompts):
    cal = QKVCalibrator(policy, micro_batch_size=64, percentile=100.0)
    s = cal.calibrate(5, prompts)
    assert s.version == 5 and s.num_layers == 3
    # manual reference: Q, K and V amax of every layer, each prompt run alone (no padding at all), through hooks
    # of our own; with percentile 100 and one pass the scale is exactly amax * margin / 448
    amax = {(name, i): 0.0 for name in "qkv" for i in range(s.num_layers)}

    def capture(i):
        def hook(_mod, _inputs, outputs):
            for name, t in zip("qkv", outputs, strict=True):
                amax[name, i] = max(amax[name, i], float(t.abs().max()))
        return hook

    hooks = [layer.self_attn.qkv_point.register_forward_hook(capture(i))
             for i, layer in enumerate(policy.model.layers)]
    try:
        with torch.no_grad():
            for p in prompts:
                policy(torch.tensor([p]))
    finally:
        for h in hooks:
            h.remove()
    for name, got in (("q", s.q), ("k", s.k), ("v", s.v)):
        for i, scale in enumerate(got):
            want = amax[name, i] * 1.05 / 448
            assert want > 0 and abs(scale - want) <= RTOL_PADDING * want, (name, i, scale, want)
    # padding never contributes: same scales when the batch is padded differently
    unpadded = QKVCalibrator(policy, micro_batch_size=1, percentile=100.0).calibrate(5, prompts)
    for a, b in zip(unpadded.k + unpadded.q, s.k + s.q, strict=True):
        assert abs(a - b) <= RTOL_PADDING * b


def test_calibrator_subsampling_is_evenly_spaced_and_close(policy, prompts):
    seqs = [p + [10 + i] for i in range(8) for p in prompts]  # 32 distinct sequences
    assert len({tuple(q) for q in seqs}) == 32
    full = QKVCalibrator(policy, percentile=100.0).calibrate(0, seqs)
    sub = QKVCalibrator(policy, percentile=100.0, max_sequences=8)
    # the documented contract, computed here on its own: 8 of 32 evenly spaced is every 4th, from the first
    expected = [seqs[i] for i in range(0, 32, 4)]
    assert sub.select(seqs) == expected
    assert sub.select(seqs[:8]) == seqs[:8]  # at most max_sequences: all of them, in order
    part = sub.calibrate(0, seqs)
    alone = QKVCalibrator(policy, percentile=100.0).calibrate(0, expected)  # the subset, given directly
    for a, b in zip(part.q + part.k + part.v, alone.q + alone.k + alone.v, strict=True):
        assert abs(a - b) <= RTOL_PADDING * b  # calibration ran on exactly that subset
    for a, b in zip(part.k + part.v, full.k + full.v, strict=True):
        assert 0.5 * b <= a <= b + 1e-12  # a subset's amax never exceeds the full amax
