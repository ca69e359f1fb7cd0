"""The train pass's own forwards give a step's prev logprobs (``TorchTrainer.fuses_logprob_pass``): with one
optimizer update per step, the first forward of each micro-batch runs at the weights a logprob pass would run at,
over the same micro-batches, so it computes bitwise the same logprobs (both passes are deterministic functions of
the same inputs, whatever the batch-invariance setting) — and the step may skip that pass.

Checked here against the unfused path (a logprob pass, then the step), built alike: the trained tokens' prev
logprobs, every metric of the step, the weights after it and the Q/K/V scales a recording calibrator takes from the
pass (``calibration.site logprobs``) are all exactly equal, for the bf16 and fp8_e2e recipes, with and without a
shared prefix and batch invariance. Where fusing would change something it is not used: several updates per step,
a recording calibrator beside a micro-batch that recomputes its layers (the recomputed forward would record
twice), and a recording calibrator beside a micro-batch with no trained token (the train pass skips its forward: the
calibration would miss its sequences, or see none at all when every row failed).
"""

import pytest
import torch

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch, train_on_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import recipe_for_role
from fp8rl.rl import MAX_ABS_LOGPROB_DIFF

SYSTEM = 20  # shared leading tokens (past MIN_SHARED_PREFIX: sharing happens)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 97, (SYSTEM,), generator=g).tolist()
    return [system + torch.randint(3, 97, (n,), generator=g).tolist() for n in (3, 7, 4)]


def _pair(model, prompts, recipe, kv, *, share, invariant, **cfg):
    """Two trainers built alike, a rollout batch, and the calibrators recording from each trainer's model."""
    rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=invariant)
    tr = recipe_for_role(recipe, "trainer", kv_cache_dtype=kv, batch_invariant=invariant)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=4)
    config = TrainerConfig(micro_batch_size=4, share_prefix=share, lr=1e-3, **cfg)
    trainers = [TorchTrainer(model, tr, config) for _ in range(2)]
    if kv == "fp8":
        scales = QKVCalibrator(model, pad_token_id=0).calibrate(0, prompts)
        engine.load_scales(scales)
        for t in trainers:
            if t.needs_qkv_scales:  # trainer-side FP8 KV: batch-invariant recipes
                t.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=3))
    adv = torch.linspace(-1, 1, len(samples), dtype=torch.float64)
    batches = [build_train_batch(samples, None, 2, 0, advantages=adv) for _ in trainers]
    return trainers, batches


@pytest.mark.parametrize("recipe,kv", [("bf16", "auto"), pytest.param("fp8_e2e", "fp8", marks=pytest.mark.invariant)])
@pytest.mark.parametrize("share,invariant", [(True, True), (False, False)])
def test_the_fused_step_is_the_unfused_one_exactly(awkward, prompts, recipe, kv, share, invariant):
    (fused, plain), (bf, bp) = _pair(awkward, prompts, recipe, kv, share=share, invariant=invariant)
    plain.fuses_logprob_pass = lambda *_a, **_k: False  # this one runs the logprob pass of its own
    assert fused.fuses_logprob_pass(bf, recording=True)
    outs = []
    for t, b in ((fused, bf), (plain, bp)):  # each recording its own pass's Q/K/V (calibration.site logprobs)
        outs.append(train_on_batch(t, b, record_qkv=QKVCalibrator(t.model, pad_token_id=0)))
    of, op = outs
    assert of.logprobs_s == 0.0 and op.logprobs_s > 0.0  # the fused step ran no logprob pass
    mask = bf.loss_mask.bool()
    assert mask.any() and torch.equal(bf.prev_logprobs[mask], bp.prev_logprobs[mask])
    assert of.metrics == op.metrics  # mismatch, lag and every train/* metric: the same floats
    sf, sp = fused.state_dict(), plain.state_dict()
    assert sf.keys() == sp.keys() and all(torch.equal(sf[k], sp[k]) for k in sf)
    a, b = of.qkv_scales, op.qkv_scales
    assert a is not None and a.version == b.version == 1 and (a.q, a.k, a.v) == (b.q, b.k, b.v)
    if invariant:  # the trainer's logprobs are the rollout's, fused or not
        assert of.metrics[MAX_ABS_LOGPROB_DIFF] == 0.0


def test_fusing_is_not_used_where_it_would_change_the_step(awkward, prompts):
    (several, recomputing), (batch, _) = _pair(awkward, prompts, "bf16", "auto", share=True, invariant=True,
                                               num_minibatches=2)
    assert not several.fuses_logprob_pass(batch)  # a later update's forwards run at newer weights
    (one, _), (batch, _) = _pair(awkward, prompts, "bf16", "auto", share=True, invariant=True,
                                 activation_checkpointing=True)
    assert one.fuses_logprob_pass(batch) and not one.fuses_logprob_pass(batch, recording=True)
    out = train_on_batch(one, batch, record_qkv=QKVCalibrator(one.model, pad_token_id=0))
    assert out.logprobs_s > 0.0 and out.qkv_scales is not None  # the logprob pass recorded the scales


def test_a_recording_calibrator_sees_every_sequence_even_of_rows_without_trained_tokens(awkward, prompts):
    """A step whose rows all carry no trained token (every agent of the step failed: ungraded, masked out) still
    records the logprob pass over all of them — fusing would have run no forward, hence no scales."""
    (one, _), (batch, _) = _pair(awkward, prompts, "bf16", "auto", share=True, invariant=True)
    batch.loss_mask.zero_()
    assert one.fuses_logprob_pass(batch) and not one.fuses_logprob_pass(batch, recording=True)
    out = train_on_batch(one, batch, record_qkv=QKVCalibrator(one.model, pad_token_id=0))
    assert out.logprobs_s > 0.0 and out.qkv_scales is not None and out.qkv_scales.version == 1
