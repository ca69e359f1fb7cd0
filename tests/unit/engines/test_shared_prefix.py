"""The trainer runs a micro-batch's shared leading tokens once (``TrainerConfig.share_prefix``,
:mod:`fp8rl.model.shared_prefix`): a GRPO group's prompt, the system prompt and tools block every trajectory opens
with.

Claims and their checks:

* logprobs — bitwise (``torch.equal``) the rollout's and the unshared trainer's under batch invariance, every
  recipe and KV cache: the suffix forward is the incremental prefill a KV cache already makes exact;
* the QKV amax the logprob pass records (calibration.site logprobs) — equal: prefix and suffixes are one pass;
* gradients — the same up to rounding, with tolerances from the error model:

  - ``GRAD_RTOL_FP32`` — FP32 weights and activations (the ``bf16`` recipe on an FP32 model): the rows' prefix
    gradients are summed over the batch before the prefix's backward instead of inside its GEMMs, another FP32
    summation order; relative Frobenius error a few ulp-sized terms (~1e-7 measured), bound 1e-5 as the
    data-parallel tests' (:mod:`tests.distributed.test_trainer_ranks`);
  - ``GRAD_RTOL_FP8`` — fp8_e2e: the backward quantizes other tensors to E4M3 (the summed prefix gradients
    instead of each row's), so those gradients differ by E4M3 rounding, RMS ``2**-3 / sqrt(12)`` ≈ 0.036 of an
    element (relative step 2**-3); bound one relative step.

Sharing must happen for the claims to mean anything: each case asserts the micro-batches' shared lengths.
"""

import pytest
import torch

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import MIN_SHARED_PREFIX, TorchTrainer, TrainerConfig
from fp8rl.fp8 import recipe_for_role
from fp8rl.model.shared_prefix import SharedPrefix, shared_prefix_length
from fp8rl.rl import LossNorm

GRAD_RTOL_FP32 = 1e-5
GRAD_RTOL_FP8 = 2**-3
SYSTEM = 37  # shared leading tokens of every prompt (past the 32-key chunk: the prefix spans two chunks)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 97, (SYSTEM,), generator=g).tolist()
    return [system + torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 9, 5)]


def _setup(model, prompts, recipe, kv, share, *, invariant=True, micro=4):
    rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=invariant)
    tr = recipe_for_role(recipe, "trainer", kv_cache_dtype=kv, batch_invariant=invariant)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=4)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=micro, share_prefix=share))
    if kv == "fp8":
        scales = QKVCalibrator(model, pad_token_id=0).calibrate(0, prompts)
        engine.load_scales(scales)
        trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, n=2, seed=3))
    batch = build_train_batch(samples, torch.arange(len(samples)).float(), 2, 0)
    shared = [trainer._prefix_len(batch.slice(a, b)) for a, b in trainer._spans(len(samples))]
    return trainer, batch, shared


# the fp8_e2e cases run in the invariant tier (make test-invariant; each ~10 s here), bf16 in the default one
@pytest.mark.parametrize("recipe", ["bf16", pytest.param("fp8_e2e", marks=pytest.mark.invariant)])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_shared_prefix_logprobs_are_bitwise_the_rollouts_and_the_unshared(awkward, prompts, recipe, kv):
    got = {}
    for share in (True, False):
        trainer, batch, shared = _setup(awkward, prompts, recipe, kv, share)
        mask = batch.loss_mask.bool()
        with QKVCalibrator(trainer.model, pad_token_id=0).recording() as rec:
            lp = trainer.compute_logprobs(batch)
        assert torch.equal(lp[mask], batch.gen_logprobs[mask]), f"share_prefix={share}: trainer != rollout"
        got[share] = lp[mask], rec.scales(1), shared
    # rows 0-3 (two prompts) share the system prompt; rows 4-5 (one prompt) all of it
    assert got[True][2] == [SYSTEM, SYSTEM + 5 - 1] and got[False][2] == [0, 0]
    assert torch.equal(got[True][0], got[False][0])
    a, b = got[True][1], got[False][1]
    assert (a.q, a.k, a.v) == (b.q, b.k, b.v)


@pytest.mark.parametrize("recipe,rtol", [("bf16", GRAD_RTOL_FP32),
                                         pytest.param("fp8_e2e", GRAD_RTOL_FP8, marks=pytest.mark.invariant)])
@pytest.mark.parametrize("invariant", [True, False])
def test_shared_prefix_gradients_match_the_full_rows(awkward, prompts, recipe, rtol, invariant):
    grads, losses = {}, {}
    for share in (True, False):
        trainer, batch, shared = _setup(awkward, prompts, recipe, "auto", share, invariant=invariant, micro=6)
        assert (shared[0] > 0) == share
        batch.prev_logprobs = trainer.compute_logprobs(batch)
        trainer._zero_grads()
        totals, _ = trainer._backward(batch, LossNorm.of(batch.loss_mask))
        losses[share] = totals["loss"]
        grads[share] = {n: p.grad.detach().float().clone() for n, p in trainer.model.named_parameters()
                        if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]

    def rel(n: str) -> float:
        return float((grads[True][n] - grads[False][n]).norm() / grads[False][n].norm())

    worst = max(grads[False], key=rel)
    assert rel(worst) <= rtol, (worst, rel(worst))
    assert losses[True] == pytest.approx(losses[False], rel=GRAD_RTOL_FP32)


def test_shared_prefix_length_stops_before_the_first_needed_token_and_at_the_first_difference():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 4, 4], [5, 6, 7, 8, 9, 3]])
    attn = (ids != 0).long()
    assert shared_prefix_length(ids, attn, first_needed=6) == 4  # rows part at index 4
    assert shared_prefix_length(ids, attn, first_needed=3) == 2  # token 3's logprob comes from position 2
    assert shared_prefix_length(ids[:1], attn[:1], first_needed=6) == 0  # one row: nothing to share
    same = ids[[0, 0]]
    assert shared_prefix_length(same, (same != 0).long(), first_needed=6) == 5  # stops at the padding


def test_short_shared_prefixes_and_special_models_run_whole(awkward, prompts):
    trainer, batch, _ = _setup(awkward, [p[SYSTEM - MIN_SHARED_PREFIX + 1:] for p in prompts], "bf16", "auto", True,
                               micro=4)
    assert trainer._prefix_len(batch.slice(0, 4)) == 0  # 15 shared tokens: below MIN_SHARED_PREFIX
    off = TorchTrainer(awkward, recipe_for_role("bf16", "trainer"), TrainerConfig(share_prefix=False))
    assert off._prefix_len(batch.slice(0, 4)) == 0


def test_a_shared_prefix_is_recorded_once_and_read_after(awkward):
    prefix = SharedPrefix()
    with pytest.raises(ValueError, match="one row"):
        awkward(torch.tensor([[3, 4], [3, 4]]), prefix=prefix)
    with pytest.raises(RuntimeError, match="no layer recorded"):
        prefix.seal(2)
    awkward(torch.tensor([[3, 4, 5]]), prefix=prefix, logits_to_keep=1)
    assert prefix.length == 3 and not prefix.recording
    full = awkward(torch.tensor([[3, 4, 5, 6, 7], [3, 4, 5, 8, 9]]))
    suffix = awkward(torch.tensor([[6, 7], [8, 9]]), prefix=prefix)
    torch.testing.assert_close(suffix, full[:, 3:], rtol=1e-5, atol=1e-5)  # FP32, no invariance: rounding only


@pytest.mark.parametrize("recipe,kv", [("bf16", "auto"), ("fp8_e2e", "fp8")])
def test_rollout_prefills_a_repeated_prompt_once_with_the_same_samples(awkward, recipe, kv):
    """The rollout's side: a prompt repeated in one call (``n`` samples, a group's trajectories) is prefilled once and
    its rows seeded from it; under batch invariance the samples are bitwise those of prefilling every row, also
    when a group is split across ``max_batch_size`` chunks (5 rows a chunk, groups of 3)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 19, 7, 40, 11, 3, 31)]
    got = {}
    for share in (True, False):
        engine = TorchRolloutEngine(awkward, recipe_for_role(recipe, "rollout", kv_cache_dtype=kv,
                                                             batch_invariant=True),
                                    eos_token_ids=[2], max_batch_size=5)
        if kv == "fp8":
            engine.load_scales(QKVCalibrator(awkward, pad_token_id=0).calibrate(0, prompts))
        if not share:  # the unshared reference: every row prefilled whole
            engine._shared_prompts = lambda rows, found, version, scales: found
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, n=3, seed=3))
        got[share] = [(s.token_ids, s.logprobs) for s in out], engine.session_stats()["prefill_tokens"]
    assert got[True][0] == got[False][0]
    assert got[False][1] == 3 * sum(map(len, prompts))
    assert got[True][1] < got[False][1]  # the repeats' tokens but the last were fed once per chunk
