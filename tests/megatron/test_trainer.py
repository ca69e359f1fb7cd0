"""The Megatron backend against the torch backend on the same weights: logprobs, one train step, export.

Both backends run the same GRPO step code (``MegatronTrainer`` inherits it); what differs is the
model — Megatron's GPTModel (local spec, FP8 through ``fp8rl.fp8`` linears swapped into the spec)
versus our CausalLM. So the comparisons isolate the model build, the weight conversion and the
FP8 wiring.

Tolerances (FP32 master weights and activations, as the embedded tier runs):

* ``LOGPROB_ATOL`` — per-token logprobs on real tokens. The two models do the same FP32 math in
  a different op order (fused QKV / gate-up GEMMs, torch's RMSNorm kernel); observed max 0.
* ``LOSS_RTOL`` — the step's loss (same forward, so as tight as the logprobs).
* ``GRAD_RTOL_*`` — relative Frobenius error of each HF tensor's gradient. FP8 (E4M3, 3 mantissa
  bits) amplifies the FP32 op-order differences: a value sitting on a rounding boundary lands in the
  neighbouring E4M3 bucket (one ulp = 2**-3 relative), so a few elements of dy move by that.
* ``UPDATE_RTOL_*`` — relative error of the weight update ``W1 - W0`` per tensor. Adam's first step
  is ``lr * g / (|g| + eps)``: elements with |g| near eps turn a tiny gradient difference into a
  visible update difference, so this budget is looser than the gradient's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl.engines import TorchTrainer, TrainerConfig
from fp8rl.engines.megatron.convert import megatron_to_hf
from fp8rl.fp8 import Fp8Recipe

from .conftest import make_batch, make_policy

pytestmark = pytest.mark.megatron

LOGPROB_ATOL = 1e-5  # observed 0
LOSS_RTOL = 1e-6  # observed 0
GRAD_RTOL_FP32 = 1e-5  # observed 5e-7
GRAD_RTOL_FP8 = 2e-3  # observed 3e-4
UPDATE_RTOL_FP32 = 5e-4  # observed 4e-5
UPDATE_RTOL_FP8 = 2e-3  # observed 1.2e-4

TRAIN = TrainerConfig(lr=1e-3, micro_batch_size=4, grad_clip=1.0)


def _megatron(policy, recipe, config=TRAIN, **kw):
    from fp8rl.engines.megatron.trainer import MegatronTrainer

    return MegatronTrainer(policy, recipe, config, **kw)


def _real(lp, batch):
    return lp * batch.attention_mask


def _grads_hf(trainer) -> dict[str, torch.Tensor]:
    if isinstance(trainer, TorchTrainer) and not hasattr(trainer.model, "gpt"):
        return {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    mg = {n: p.grad for n, p in trainer.model.gpt.named_parameters()}
    return megatron_to_hf(mg, trainer.model_config)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logprobs_equal_the_torch_backend_in_fp32(megatron_core, kind):
    policy, batch = make_policy(kind), make_batch(vocab=128)
    recipe = Fp8Recipe(linear="bf16")
    ref = TorchTrainer(policy, recipe, TRAIN).compute_logprobs(batch)
    mt = _megatron(policy, recipe)
    got = mt.compute_logprobs(batch)
    diff = float((_real(got, batch) - _real(ref, batch)).abs().max())
    print(f"{kind}: max |logprob diff| = {diff:.3g}")
    assert diff <= LOGPROB_ATOL
    # negative case: one changed weight inside a fused tensor must show (the comparison can fail)
    with torch.no_grad():
        mt.model.gpt.decoder.layers[-1].self_attention.linear_qkv.weight[-1, 0] += 1.0
    assert float((_real(mt.compute_logprobs(batch), batch) - _real(ref, batch)).abs().max()) > 100 * LOGPROB_ATOL


def test_export_is_the_loaded_policy_under_hf_names(megatron_core):
    policy = make_policy("llama")
    mt = _megatron(policy, Fp8Recipe(linear="bf16"))
    sd, ref = mt.state_dict(), policy.state_dict()
    assert set(sd) == set(ref)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


@pytest.mark.parametrize("recipe_name", ["bf16", "fp8_e2e"])
def test_one_train_step_matches_the_torch_backend(megatron_core, recipe_name):
    from fp8rl.fp8 import recipe_for_role

    policy, batch = make_policy("llama"), make_batch(vocab=128)
    # layer 0 kept high precision on the training side too (the rule the torch backend follows)
    recipe = recipe_for_role(recipe_name, "trainer", num_first_layers_in_bf16=1)
    torch_tr, mt = TorchTrainer(policy, recipe, TRAIN), _megatron(policy, recipe)
    if recipe_name == "fp8_e2e":
        kinds = [type(la.self_attention.linear_qkv).__name__ for la in mt.model.gpt.decoder.layers]
        assert kinds == ["ColumnParallelLinear", "Fp8ColumnParallelLinear", "Fp8ColumnParallelLinear"]
    w0 = {k: v.clone() for k, v in policy.state_dict().items()}
    ma = torch_tr.train_step(copy.copy(batch))
    mb = mt.train_step(copy.copy(batch))
    assert mt.version == torch_tr.version == 1
    print(f"{recipe_name}: loss {ma['loss']:.9g} vs {mb['loss']:.9g}, grad_norm {ma['grad_norm']:.7g} vs "
          f"{mb['grad_norm']:.7g}")
    assert mb["loss"] == pytest.approx(ma["loss"], rel=LOSS_RTOL)
    fp8 = recipe_name == "fp8_e2e"
    ga, gb = _grads_hf(torch_tr), _grads_hf(mt)
    grad_err = {k: _rel(gb[k], ga[k]) for k in ga}
    sa, sb = torch_tr.state_dict(), mt.state_dict()
    upd_err = {k: _rel(sb[k] - w0[k], sa[k] - w0[k]) for k in sa}
    worst_g, worst_u = max(grad_err, key=grad_err.get), max(upd_err, key=upd_err.get)
    print(f"{recipe_name}: worst grad rel err {grad_err[worst_g]:.3g} ({worst_g}); "
          f"worst update rel err {upd_err[worst_u]:.3g} ({worst_u}); "
          f"max |W diff| {max(float((sa[k] - sb[k]).abs().max()) for k in sa):.3g}")
    assert grad_err[worst_g] <= (GRAD_RTOL_FP8 if fp8 else GRAD_RTOL_FP32)
    assert upd_err[worst_u] <= (UPDATE_RTOL_FP8 if fp8 else UPDATE_RTOL_FP32)
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=GRAD_RTOL_FP8 if fp8 else GRAD_RTOL_FP32)


def test_fp8_layers_really_compute_in_fp8(megatron_core):
    """Negative control for the FP8 comparison: FP8 and high-precision Megatron logprobs must differ."""
    policy, batch = make_policy("llama"), make_batch(vocab=128)
    hp = _megatron(policy, Fp8Recipe(linear="bf16")).compute_logprobs(batch)
    f8 = _megatron(policy, Fp8Recipe(linear="fp8")).compute_logprobs(batch)
    ref = TorchTrainer(policy, Fp8Recipe(linear="fp8"), TRAIN).compute_logprobs(batch)
    assert float((_real(f8, batch) - _real(hp, batch)).abs().max()) > 100 * LOGPROB_ATOL
    assert float((_real(f8, batch) - _real(ref, batch)).abs().max()) <= LOGPROB_ATOL


def test_parallel_sizes_other_than_one_are_refused(megatron_core):
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2.*only 1 x 1"):
        _megatron(make_policy("llama"), Fp8Recipe(linear="bf16"), tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=4"):
        _megatron(make_policy("llama"), Fp8Recipe(linear="bf16"), pipeline_model_parallel_size=4)


def test_checkpoint_resumes_bit_identically(megatron_core, tmp_path):
    policy, batch = make_policy("qwen2"), make_batch(vocab=128)
    recipe = Fp8Recipe(linear="fp8")
    a = _megatron(policy, recipe)
    a.train_step(copy.copy(batch))
    a.save_checkpoint(str(tmp_path / "ck.pt"))
    a.train_step(copy.copy(batch))
    b = _megatron(policy, recipe)
    b.load_checkpoint(str(tmp_path / "ck.pt"))
    assert b.version == 1
    b.train_step(copy.copy(batch))
    sa, sb = a.state_dict(), b.state_dict()
    assert b.version == a.version == 2 and all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ValueError, match="trained with fp8 linears"):
        _megatron(policy, Fp8Recipe(linear="bf16")).load_checkpoint(str(tmp_path / "ck.pt"))
