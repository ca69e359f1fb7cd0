"""Batch-invariant numerics through the service stack (issue 18): zero train/rollout mismatch, exactly.

A stack launched for a job with ``policy.numerics.batch_invariant: true`` (fp8_e2e, FP8 KV cache): the rollout
replica decodes, the trainer service recomputes the logprobs in its own process with the QKV scales it reads
from the refit store, and every step's ``mismatch/max_abs_logprob_diff`` is exactly 0 — the trainer's logprobs are
bitwise the rollout's (not merely ``token_mult_prob_error`` 1.0, which FP32 ``exp`` reaches below ~6e-8). The
in-process loop on the same job gives the same. The negative control (the flag off) is the default-tier stack
test, whose mismatch is > 1.
"""

from __future__ import annotations

import re

import pytest

from fp8rl.loop import LoopConfig, run

from .conftest import assert_zero_mismatch, down, run_stack_job, tiny_job, tiny_model
from .test_controller import WATCH_S

pytestmark = [pytest.mark.integration, pytest.mark.invariant]


def run_invariant_job(tmp_path, steps: int, dp_size: int = 1, edit=None):
    """A batch-invariant fp8_e2e + FP8 KV job of ``steps`` steps through a stack on the tiny model (``dp_size`` trainer
    ranks, micro-batches of 3 rows when > 1; ``edit`` changes the job dict first), run to its end and taken down;
    every step's mismatch exactly zero. Returns ``(step reports, the stack, the model dir)``."""
    model_dir = tiny_model(tmp_path / "model")
    job = tiny_job(model_dir, max_new_tokens=12)
    job["policy"]["numerics"] = {"batch_invariant": True}
    job["job"]["steps"] = steps
    if dp_size > 1:
        job["policy"]["training"].update(dp_size=dp_size, micro_batch_size=3)
    if edit is not None:
        edit(job)
    reports, info, stack = run_stack_job(tmp_path, job, model_dir, watch_s=WATCH_S * 2)
    down(stack)
    assert_zero_mismatch(info, reports, steps)
    return reports, stack, model_dir


def assert_the_loop_matches(reports, model_dir, lr: float, **flags) -> None:
    """The in-process loop on the 3-step job (``flags``: its extra loop flags) has zero mismatch every step and the
    same samples as the stack's ``reports`` (the controller runs the loop's step)."""
    loop = run(LoopConfig.from_flags(model=str(model_dir), recipe="fp8_e2e", kv_cache_dtype="fp8", steps=3,
                                     prompts_per_step=4, group_size=2, max_tokens=12, lr=lr, micro_batch_size=8,
                                     calibration_max_sequences=4, eval_size=2, seed=0, batch_invariant=True, **flags),
               progress=False)["steps"]
    assert [h["mismatch/max_abs_logprob_diff"] for h in loop] == [0.0, 0.0, 0.0]
    for r, h in zip(reports, loop, strict=True):
        assert r.reward_mean == pytest.approx(h["reward_mean"]) and r.metrics["response_len"] == h["response_len"]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_fp8_e2e_with_fp8_kv_has_zero_mismatch_in_the_stack_and_the_loop(tmp_path, dp_size):
    """With ``dp_size: 2`` the trainer runs as 2 torchrun ranks (FSDP2): rank 0 forwards each version's QKV scales
    to rank 1 (the rank channel's ``scales`` op), and micro-batches of 3 rows spread the rows over both ranks,
    whose logprobs must be the rollout's bitwise too (invariance does not depend on the micro-batch)."""
    reports, _, model_dir = run_invariant_job(tmp_path, steps=3, dp_size=dp_size)
    if dp_size > 1:
        return  # the loop runs one trainer process: compared once, at dp_size 1

    assert_the_loop_matches(reports, model_dir, lr=0.01)


@pytest.mark.parametrize("scaling", ["mxfp8", "tensorwise"])
def test_each_fp8_recipe_variant_runs_the_stack_with_zero_mismatch(tmp_path, scaling):
    """Issue 32: a stack job per recipe variant. The trainer service publishes its E4M3 weights with the variant's
    scales (uint8 E8M0 for mxfp8, one FP32 per tensor for tensorwise) through the refit store; the rollout replica
    and the calibrator check and apply them; the trainer's logprobs are the rollout's bitwise, every step."""
    run_invariant_job(tmp_path, steps=2, edit=lambda job: job["policy"]["training"]["megatron_cfg"]["fp8_cfg"]
                      .update(fp8_recipe=scaling))


# 1 rank: make test-slow (2 ranks run every LoRA path of 1 and the scales' forwarding besides)
@pytest.mark.parametrize("dp_size", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_lora_runs_the_stack_with_zero_mismatch_and_refits_adapters_only(tmp_path, dp_size):
    """Issue 33: a LoRA job through the stack (fp8_e2e, FP8 KV). The trainer publishes version 0 with the frozen base
    and every later version with the adapters alone; the rollout replica and the calibrator apply them on the base
    they hold; the trainer's logprobs are the rollout's bitwise, every step (the adapters computed the same way).
    With ``dp_size: 2`` the adapters shard over 2 FSDP2 ranks (rank 0 gathers them for each publish)."""
    def lora(job: dict) -> None:
        job["policy"]["lora"] = {"enabled": True, "rank": 4, "alpha": 16.0}
        job["policy"]["training"]["lr"] = 0.02  # the adapters move visibly in 3 steps

    reports, stack, model_dir = run_invariant_job(tmp_path, steps=3, dp_size=dp_size, edit=lora)
    logs = "\n".join(p.read_text(errors="replace") for p in stack.run_dir.rglob("*.log"))
    assert "carries the frozen LoRA base" in logs
    pulled = [(int(v), how, int(n)) for v, how, n in
              re.findall(r"applied weight version (\d+) \(\d+ tensors, (\S+): (\d+) bytes", logs)]
    by_version = {v: (how, n) for v, how, n in pulled}  # the rollout's and the calibrator's agree
    assert by_version[0][0] == "full" and set(by_version) == {0, 1, 2, 3}, pulled
    for v in (1, 2, 3):  # adapters alone after the base (or their delta)
        assert by_version[v][1] < 0.25 * by_version[0][1], pulled
    if dp_size > 1:
        return  # the loop runs one trainer process: compared once, at dp_size 1

    # the in-process loop on the same job: the rollout shares the trainer's adapters and its FP8 base
    assert_the_loop_matches(reports, model_dir, lr=0.02, lora=True, lora_rank=4, lora_alpha=16.0)
