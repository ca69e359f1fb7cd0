"""Mixture-of-experts on the Megatron backend (issue 31, first piece): ``qwen3_moe`` as a GPTModel with Megatron's
``MoELayer`` (``TopKRouter`` in FP32, ``SequentialMLP`` experts, the ``allgather`` dispatcher), expert parallelism 1.

Against the torch backend on the same checkpoint, with test_trainer's bounds (named there, from their error models):
logprobs within ``LOGPROB_ATOL``; one train step's loss within ``LOSS_RTOL`` and every gradient within
``GRAD_RTOL_FP32`` (bf16 recipe) or ``GRAD_RTOL_FP8`` (fp8_e2e). Negative controls show each comparison can fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl.engines import TorchTrainer
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM, ModelConfig

from .conftest import make_batch
from .test_trainer import (
    GRAD_RTOL_FP8,
    GRAD_RTOL_FP32,
    LOGPROB_ATOL,
    LOSS_RTOL,
    TRAIN,
    _grads_hf,
    _megatron,
    _real,
    _rel,
    resumed_like_continued,
)

pytestmark = pytest.mark.megatron


def moe_config(norm_topk_prob: bool = True, mlp_only_layers: tuple[int, ...] = (0,)) -> ModelConfig:
    """A small Qwen3-MoE: 4 experts, top-2, layer 0 dense by default (a model mixing both layer kinds)."""
    return ModelConfig(architecture="qwen3_moe", vocab_size=128, max_position_embeddings=64, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=norm_topk_prob,
                       mlp_only_layers=list(mlp_only_layers))


def moe_policy(seed: int = 0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    m = CausalLM(moe_config(**kw))
    with torch.no_grad():  # sharper router logits: top-2 choices far from ties, so both backends route alike
        for layer in m.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.mul_(20.0)
    return m


def test_hf_and_megatron_layouts_round_trip_exactly_with_experts():
    from fp8rl.engines.megatron.convert import hf_to_megatron, megatron_names, megatron_to_hf

    policy = moe_policy()
    cfg = policy.config
    hf = {k: v for k, v in policy.state_dict().items()}
    mg = hf_to_megatron(hf, cfg)
    assert set(mg) == megatron_names(cfg)
    assert "decoder.layers.1.mlp.router.weight" in mg and "decoder.layers.0.mlp.linear_fc1.weight" in mg
    fc1 = mg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                       hf["model.layers.1.mlp.experts.3.up_proj.weight"]]))
    back = megatron_to_hf(mg, cfg)
    assert set(back) == set(hf) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert all(torch.equal(back[k], hf[k]) for k in back)
    with pytest.raises(ValueError, match="missing"):
        hf_to_megatron({k: v for k, v in hf.items() if "experts.2.down_proj" not in k}, cfg)


@pytest.mark.parametrize("recipe_name", ["bf16", "fp8_e2e"])
@pytest.mark.parametrize("norm_topk_prob,mlp_only", [(True, (0,)), (False, ())])
def test_moe_logprobs_equal_the_torch_backend(megatron_core, recipe_name, norm_topk_prob, mlp_only):
    policy, batch = moe_policy(norm_topk_prob=norm_topk_prob, mlp_only_layers=mlp_only), make_batch(vocab=128)
    recipe = recipe_for_role(recipe_name, "trainer")
    ref = TorchTrainer(policy, recipe, TRAIN).compute_logprobs(batch)
    mt = _megatron(policy, recipe)
    layer = mt.model.gpt.decoder.layers[-1]
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert isinstance(layer.mlp, MoELayer) and layer.mlp.router.weight.dtype == torch.float32
    expert = layer.mlp.experts.local_experts[0]
    want = "Fp8ColumnParallelLinear" if recipe.fp8_linears else "ColumnParallelLinear"
    assert type(expert.linear_fc1).__name__ == want  # every expert FP8 per the recipe; the router never
    got = mt.compute_logprobs(batch)
    diff = float((_real(got, batch) - _real(ref, batch)).abs().max())
    print(f"{recipe_name} norm_topk_prob={norm_topk_prob}: max |logprob diff| = {diff:.3g}")
    assert diff <= LOGPROB_ATOL
    # negative control: one changed expert weight shows
    with torch.no_grad():
        for e in layer.mlp.experts.local_experts:
            e.linear_fc2.weight[0, :] += 1.0
    assert float((_real(mt.compute_logprobs(batch), batch) - _real(ref, batch)).abs().max()) > 100 * LOGPROB_ATOL


@pytest.mark.parametrize("recipe_name", ["bf16", "fp8_e2e"])
def test_one_moe_train_step_matches_the_torch_backend(megatron_core, recipe_name):
    policy, batch = moe_policy(), make_batch(vocab=128)
    recipe = recipe_for_role(recipe_name, "trainer")
    torch_tr, mt = TorchTrainer(policy, recipe, TRAIN), _megatron(policy, recipe)
    ma, mb = torch_tr.train_step(copy.copy(batch)), mt.train_step(copy.copy(batch))
    print(f"{recipe_name}: loss {ma['loss']:.9g} vs {mb['loss']:.9g}, grad_norm {ma['grad_norm']:.7g} vs "
          f"{mb['grad_norm']:.7g}")
    assert mb["loss"] == pytest.approx(ma["loss"], rel=LOSS_RTOL)
    ga, gb = _grads_hf(torch_tr), _grads_hf(mt)
    assert set(ga) == set(gb) and any("experts.3.down_proj" in k for k in ga) and any("mlp.gate" in k for k in ga)
    err = {k: _rel(gb[k], ga[k]) for k in ga}
    worst = max(err, key=err.get)
    print(f"{recipe_name}: worst grad rel err {err[worst]:.3g} ({worst})")
    assert err[worst] <= (GRAD_RTOL_FP8 if recipe.fp8_linears else GRAD_RTOL_FP32), worst
    # the export is the trained policy under HF per-expert names
    sd, ref = mt.state_dict(), torch_tr.state_dict()
    assert set(sd) == set(ref) and "model.layers.1.mlp.experts.0.gate_proj.weight" in sd


def test_a_moe_checkpoint_resumes_bit_identically(megatron_core, tmp_path):
    """A Megatron MoE run saved after one step and resumed trains on bitwise as the run that went on (router and
    experts, their AdamW moments)."""
    sa = resumed_like_continued(moe_policy(), recipe_for_role("fp8_e2e", "trainer"), make_batch(vocab=128),
                                tmp_path / "ck.pt")
    assert any(".mlp.experts.3." in k for k in sa) and any(".mlp.gate." in k for k in sa)


def test_what_the_megatron_moe_path_cannot_run_yet_is_refused(megatron_core):
    from fp8rl.engines import TrainerConfig

    policy = moe_policy()
    with pytest.raises(ValueError, match="router_replay"):
        _megatron(policy, recipe_for_role("bf16", "trainer"), TrainerConfig(router_replay=True))


def test_a_three_step_moe_job_through_the_stack_on_the_megatron_backend(megatron_core, controller_stack, tmp_path):
    """A Qwen3-MoE job (fp8_e2e, FP8 KV, the torch rollout) whose trainer service runs the Megatron backend: three
    steps succeed, each version refits the rollout under HF per-expert names, and the mismatch stays within the
    recipe's promise."""
    from fp8rl.model import save_hf_checkpoint
    from fp8rl.model.tokenizer import CharTokenizer
    from fp8rl.rl.metrics import mismatch_promise

    h = controller_stack
    tok = CharTokenizer()
    cfg = ModelConfig(**{**moe_config().__dict__, "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                         "pad_token_id": tok.pad_id, "initializer_range": 0.05})
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    save_hf_checkpoint(CausalLM(cfg), cfg, model_dir)
    tok.save(model_dir)
    job = h.tiny_job(model_dir, max_new_tokens=10)
    job["job"]["steps"] = 3
    job["policy"]["training"]["backend"] = "megatron"
    job["policy"]["numerics"] = {"batch_invariant": False}
    reports, info, stack = h.run_stack_job(tmp_path, job, model_dir, watch_s=300.0)
    h.down(stack)
    assert (info.state, info.error) == ("succeeded", ""), info.error
    assert [r.step for r in reports] == [0, 1, 2]
    for r in reports:
        print(f"step {r.step}: token_mult_prob_error {r.token_mult_prob_error:.5f}")
        assert 1.0 <= r.token_mult_prob_error <= mismatch_promise("fp8_e2e", "fp8", over="step")
        assert {"train/loss", "train/grad_norm"} <= set(r.metrics)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_two_data_parallel_megatron_ranks_train_a_moe_like_one(megatron_core, tmp_path, recipe):
    """Megatron-Core DDP over 2 ranks at expert parallelism 1 (every rank holds every expert; their gradients are
    reduced with the rest): the bounds of the dense data-parallel test (``tests/distributed``'s error model)."""
    from .test_data_parallel import R

    moe = dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
               norm_topk_prob=True, mlp_only_layers=[0])
    args = dict(backend="megatron", recipe=recipe, micro_batch_size=3, rows=10, model=moe)
    one, two = R.torchrun(tmp_path, 1, "step", **args), R.torchrun(tmp_path, 2, "step", **args)
    assert torch.equal(one["logprobs"], two["logprobs"])
    m1, m2 = one["metrics"], two["metrics"]
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=R.LOSS_RTOL)
    assert set(one["grads"]) == set(two["grads"]) and any("local_experts.3" in n for n in one["grads"])
    worst = max(one["grads"], key=lambda n: R.rel(two["grads"][n], one["grads"][n]))
    assert R.rel(two["grads"][worst], one["grads"][worst]) <= R.GRAD_RTOL, worst
    assert int(two["megatron_ddp"]) == 1
