"""The calibrator service's refit target: what it loads from FP8 shards, and that its scales match the loop's.

In-process (no Redis, no server): the shards are built exactly as the trainer service builds them.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.engines import CalibrationModel, QKVCalibrator, TorchTrainer
from fp8rl.fp8 import E4M3, fp8_linear_names, recipe_for_role
from fp8rl.presets import load_policy
from fp8rl.refit import assemble, build_shards

pytestmark = pytest.mark.integration

SEQS = [[1, 20, 21, 22, 23, 24], [1, 30, 31, 32], [1, 50, 51, 52, 53, 54, 55, 56]]


def shipped(policy, recipe: str, scaling: str = "blockwise") -> dict[str, torch.Tensor]:
    """Version 1's tensors as a replica receives them: the rollout's FP8 linears in E4M3 + their format's scales."""
    prefixes = fp8_linear_names(policy, recipe_for_role(recipe, "rollout", kv_cache_dtype="fp8"))
    manifest, shards = build_shards(policy.state_dict(), 1, job="j", recipe=recipe, endpoint="", fp8_prefixes=prefixes,
                                    scaling=scaling)
    return assemble(manifest, shards)


@pytest.mark.parametrize("scaling", ["blockwise", "mxfp8", "tensorwise"])
def test_fp8_e2e_scales_match_the_in_process_loop(tiny_checkpoint, scaling):
    policy, tok, _ = load_policy(str(tiny_checkpoint))
    target = CalibrationModel(policy, recipe_for_role("fp8_e2e", "calibrator", scaling=scaling))
    target.load_weights(1, shipped(policy, "fp8_e2e", scaling))
    assert target.weight_version == 1
    got = QKVCalibrator(target.model, pad_token_id=tok.pad_id).calibrate(1, SEQS)
    # fp8rl.loop calibrates on the trainer's own model (FP8 train-mode linears over the master weights)
    trainer = TorchTrainer(policy, recipe_for_role("fp8_e2e", "trainer", scaling=scaling), initial_version=1)
    want = QKVCalibrator(trainer.model, pad_token_id=tok.pad_id).calibrate(1, SEQS)
    for a, b in ((got.q, want.q), (got.k, want.k), (got.v, want.v)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaling", ["blockwise", "mxfp8", "tensorwise"])
def test_fp8_gen_only_dequantizes_the_fp8_linears_it_runs_in_high_precision(tiny_checkpoint, scaling):
    policy, tok, _ = load_policy(str(tiny_checkpoint))
    tensors = shipped(policy, "fp8_gen_only", scaling)
    name = "model.layers.0.self_attn.k_proj"
    assert tensors[f"{name}.weight"].dtype == E4M3  # the trainer ships what the rollout runs: FP8
    target = CalibrationModel(policy, recipe_for_role("fp8_gen_only", "calibrator", scaling=scaling))  # BF16 linears
    target.load_weights(1, tensors)
    live = dict(target.model.named_parameters())[f"{name}.weight"]
    q, s = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
    if scaling == "mxfp8":  # independent of the format code: 2**(s - 127) per 32 inputs
        want = q.float() * torch.pow(2.0, s.float() - 127).repeat_interleave(32, dim=1)[:, :q.shape[1]]
    else:  # one FP32 scale per 128x128 block, or per tensor
        want = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:q.shape[0], :q.shape[1]]
    torch.testing.assert_close(live, want.to(live.dtype), rtol=0, atol=0)
    scales = QKVCalibrator(target.model, pad_token_id=tok.pad_id).calibrate(1, SEQS)
    assert scales.version == 1 and min(scales.k) > 0


def test_a_taken_model_is_converted_in_place_with_the_copys_numbers(tiny_checkpoint):
    """``take_model`` (the service's freshly loaded policy): the calibrator converts that object itself — the
    process never holds the loaded model and a copy — and calibrates exactly as on a copy."""
    policy, tok, _ = load_policy(str(tiny_checkpoint))
    mine, _, _ = load_policy(str(tiny_checkpoint))
    copied = CalibrationModel(policy, recipe_for_role("fp8_e2e", "calibrator"))
    taken = CalibrationModel(mine, recipe_for_role("fp8_e2e", "calibrator"), take_model=True)
    assert taken.model is mine and copied.model is not policy
    for target in (copied, taken):
        target.load_weights(1, shipped(policy, "fp8_e2e"))
    a, b = (QKVCalibrator(t.model, pad_token_id=tok.pad_id).calibrate(1, SEQS) for t in (copied, taken))
    assert (a.q, a.k, a.v) == (b.q, b.k, b.v)
