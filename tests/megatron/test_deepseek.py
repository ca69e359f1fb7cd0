"""The DeepSeek-V3 / Moonlight family on the Megatron backend (issue 34): ``deepseek_v3`` as a GPTModel with
Megatron-Core's multi-latent attention (``MLASelfAttention``) and ``MoELayer`` (sigmoid routing with a selection-only
``expert_bias``, group-limited top-k, scaled weights, ``SharedExpertMLP``), against the torch backend on the same
checkpoint with test_trainer's bounds (named there, from their error models): logprobs within ``LOGPROB_ATOL``; one
train step's loss within ``LOSS_RTOL`` and every gradient within ``GRAD_RTOL_FP32`` (bf16 recipe) or
``GRAD_RTOL_FP8`` (fp8_e2e). Negative controls show each comparison can fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl.engines import TorchTrainer
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM, ModelConfig

from .conftest import make_batch
from .test_moe import (
    assert_moe_steps_within_promise,
    assert_round_trip,
    check_replay_against_the_torch_backend,
    megatron_moe_job,
)
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
)

pytestmark = pytest.mark.megatron

# a Moonlight-shaped model scaled down: MLA (latent 64, rotary 32, nope 32, value 64), layer 0 dense, 4 routed experts
# in 2 groups (top-2 from the best group), one shared expert; every width a multiple of 128 where FP8 blocks need it
DEEPSEEK = dict(architecture="deepseek_v3", num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=128, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, routed_scaling_factor=2.5,
                norm_topk_prob=True, rope_interleave=True)


def deepseek_config(q_lora_rank: int | None = None, **kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=128, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                                 pad_token_id=0, rms_norm_eps=1e-5, hidden_size=128, intermediate_size=256,
                                 num_hidden_layers=2, num_attention_heads=2),
                          **DEEPSEEK, "q_lora_rank": q_lora_rank, **kw})


def deepseek_policy(q_lora_rank: int | None = None, seed: int = 0, sharpen: float = 4.0, **kw) -> CausalLM:
    """Norms away from 1 and a random correction bias (both are identity-like at init, which would hide a swapped
    norm or a bias left out); ``sharpen`` scales the router's logits so its own choices sit farther from ties — not
    so far that the sigmoid saturates (scores of exactly 1.0 tie, and implementations break ties differently). The
    bias is non-negative: DeepSeek's rule (transformers') masks the experts of unchosen groups to 0.0, so a chosen
    expert whose biased score is negative ties with them, a tie transformers and ``torch.topk`` break by position."""
    torch.manual_seed(seed)
    m = CausalLM(deepseek_config(q_lora_rank, **kw))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for layer in m.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.mul_(sharpen)
                gate.e_score_correction_bias.uniform_(0.0, 0.4)
    return m


@pytest.mark.parametrize("q_lora_rank", [None, 64])
def test_hf_and_megatron_layouts_round_trip_exactly_with_latent_attention(q_lora_rank):
    from fp8rl.engines.megatron.convert import hf_to_megatron, megatron_names

    policy = deepseek_policy(q_lora_rank)
    cfg = policy.config
    hf = policy.state_dict()
    mg = hf_to_megatron(hf, cfg)
    assert set(mg) == megatron_names(cfg)
    attn = "decoder.layers.1.self_attention."
    latent = hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(mg[attn + "linear_kv_down_proj.weight"], latent)
    assert torch.equal(mg[attn + "linear_kv_up_proj.weight"], hf["model.layers.1.self_attn.kv_b_proj.weight"])
    query = "linear_q_proj" if q_lora_rank is None else "linear_q_up_proj"
    assert (attn + query + ".weight") in mg and (attn + "q_layernorm.weight" in mg) == (q_lora_rank is not None)
    assert torch.equal(mg["decoder.layers.1.mlp.router.expert_bias"],
                       hf["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert torch.equal(mg["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"],
                       torch.cat([hf["model.layers.1.mlp.shared_experts.gate_proj.weight"],
                                  hf["model.layers.1.mlp.shared_experts.up_proj.weight"]]))
    assert_round_trip(hf, mg, cfg, left_out="kv_a_layernorm")


@pytest.mark.parametrize("q_lora_rank", [None, 64])
@pytest.mark.parametrize("recipe_name", ["bf16", "fp8_e2e"])
def test_deepseek_logprobs_and_a_train_step_equal_the_torch_backend(megatron_core, recipe_name, q_lora_rank):
    """Megatron's MLA and MoE (every MLA projection, routed and shared expert FP8 per the recipe; router and bias
    FP32) give the torch backend's logprobs, loss and gradients; the bias is never trained; the export is the HF
    checkpoint. Negative controls: a changed latent up-projection, a changed shared expert and a zeroed bias each
    show."""
    policy, batch = deepseek_policy(q_lora_rank), make_batch(vocab=128)
    recipe = recipe_for_role(recipe_name, "trainer", mla_absorbed=False)  # the form Megatron's MLA computes
    torch_tr, mt = TorchTrainer(policy, recipe, TRAIN), _megatron(policy, recipe)
    layer = mt.model.gpt.decoder.layers[-1]
    attn, moe = layer.self_attention, layer.mlp
    want = "Fp8ColumnParallelLinear" if recipe.fp8_linears else "ColumnParallelLinear"
    projections = ["linear_kv_down_proj", "linear_kv_up_proj"] + (
        ["linear_q_proj"] if q_lora_rank is None else ["linear_q_down_proj", "linear_q_up_proj"])
    assert [type(getattr(attn, p)).__name__ for p in projections] == [want] * len(projections)
    assert type(moe.shared_experts.linear_fc1).__name__ == want
    assert moe.router.weight.dtype == moe.router.expert_bias.dtype == torch.float32
    assert type(attn.q_layernorm if q_lora_rank else attn.kv_layernorm).__name__ == "RMSNorm"
    ref, got = torch_tr.compute_logprobs(batch), mt.compute_logprobs(batch)
    diff = float((_real(got, batch) - _real(ref, batch)).abs().max())
    print(f"{recipe_name} q_lora_rank={q_lora_rank}: max |logprob diff| = {diff:.3g}")
    assert diff <= LOGPROB_ATOL
    bias = moe.router.expert_bias.clone()
    ma, mb = torch_tr.train_step(copy.copy(batch)), mt.train_step(copy.copy(batch))
    assert mb["loss"] == pytest.approx(ma["loss"], rel=LOSS_RTOL)
    ga, gb = _grads_hf(torch_tr), _grads_hf(mt)
    assert set(ga) == set(gb) and any("shared_experts.down_proj" in k for k in ga)
    assert any("kv_b_proj" in k for k in ga) and any("mlp.gate.weight" in k for k in ga)
    err = {k: _rel(gb[k], ga[k]) for k in ga}
    worst = max(err, key=err.get)
    print(f"{recipe_name} q_lora_rank={q_lora_rank}: worst grad rel err {err[worst]:.3g} ({worst})")
    assert err[worst] <= (GRAD_RTOL_FP8 if recipe.fp8_linears else GRAD_RTOL_FP32), worst
    assert torch.equal(moe.router.expert_bias, bias)  # fixed during RL: no gradient, no Megatron bias update
    sd, sref = mt.state_dict(), torch_tr.state_dict()
    assert set(sd) == set(sref) and torch.equal(sd["model.layers.1.mlp.gate.e_score_correction_bias"], bias)
    if recipe_name == "bf16" or q_lora_rank is None:
        return
    controls = {"kv_b_proj": attn.linear_kv_up_proj.weight, "shared expert": moe.shared_experts.linear_fc2.weight,
                "bias": moe.router.expert_bias}
    for what, t in controls.items():
        saved = t.detach().clone()
        with torch.no_grad():
            t.zero_() if what == "bias" else t[0].add_(1.0)
        moved = float((_real(mt.compute_logprobs(batch), batch) - _real(got, batch)).abs().max())
        with torch.no_grad():
            t.copy_(saved)
        assert moved > 100 * LOGPROB_ATOL, what


def test_a_deepseek_checkpoint_resumes_bit_identically_and_exports(megatron_core, tmp_path):
    """Saved after one step and resumed into a trainer built on another correction bias: the checkpoint brings the
    bias back (it is model state, not trained) and the resumed run's next step is bitwise the run that went on. The
    checkpoint exports as transformers' ``DeepseekV3ForCausalLM`` of the trained weights (``ATOL_HF``; the untrained
    model far off)."""
    from fp8rl.export import export_checkpoint
    from fp8rl.model import save_hf_checkpoint
    from fp8rl.model.tokenizer import CharTokenizer
    from tests.unit.export.checks import assert_export_is_the_trained_policy

    policy, batch = deepseek_policy(64), make_batch(vocab=128)
    recipe = recipe_for_role("fp8_e2e", "trainer")
    a = _megatron(policy, recipe)
    a.train_step(copy.copy(batch))
    a.save_checkpoint(str(tmp_path / "ck.pt"))
    trained = {k: v.clone() for k, v in a.state_dict().items()}  # views of the live weights otherwise
    a.train_step(copy.copy(batch))
    save_hf_checkpoint(policy, policy.config, tmp_path / "model")
    CharTokenizer().save(tmp_path / "model")
    res = export_checkpoint(tmp_path / "ck.pt", tmp_path / "hf", model=str(tmp_path / "model"), progress=False)
    assert_export_is_the_trained_policy(res, trained, policy)
    other = copy.deepcopy(policy)
    with torch.no_grad():
        other.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
    b = _megatron(other, recipe)
    b.load_checkpoint(str(tmp_path / "ck.pt"))
    b.train_step(copy.copy(batch))
    sa, sb = a.state_dict(), b.state_dict()
    assert b.version == a.version == 2 and [k for k in sa if not torch.equal(sa[k], sb[k])] == []
    assert sb["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0


def test_megatron_replays_routes_on_deepseek_as_the_torch_backend(megatron_core):
    """Routing replay through the sigmoid router: the experts used are the rollout's where given (its own elsewhere,
    chosen with the bias), logprobs, routing metrics, loss and gradients within the bounds of the torch backend's
    replay (gradients: ``GRAD_RTOL_FP8_ONE_FLIP``, on the sharpened router as the other tests). Negative controls:
    the same batch without routes is far off, in logprobs and in gradients."""
    check_replay_against_the_torch_backend(deepseek_policy(), "fp8_e2e")


def test_expert_parallel_ranks_train_a_deepseek_model_like_one(megatron_core, tmp_path):
    """Expert parallelism 2 (``alltoall``, fp8_e2e) against one rank: the routed experts split over the ranks, the
    shared experts and the router's bias whole on each; logprobs bitwise, loss and gradients within the data-parallel
    bounds (``tests/distributed``'s error model)."""
    from .test_data_parallel import R

    args = dict(backend="megatron", recipe="fp8_e2e", micro_batch_size=3, rows=10, model=DEEPSEEK,
                dispatcher="alltoall")
    one, two = R.torchrun(tmp_path, 1, "step", **args), R.torchrun(tmp_path, 2, "step", **args, ep=2)
    assert torch.equal(one["logprobs"], two["logprobs"])
    assert float(two["metrics"]["loss"]) == pytest.approx(float(one["metrics"]["loss"]), rel=R.LOSS_RTOL)
    assert set(one["grads"]) == set(two["grads"]) and any("shared_experts.linear_fc2" in n for n in one["grads"])
    err = {n: R.rel(two["grads"][n], one["grads"][n]) for n in one["grads"]}
    worst = max(err, key=err.get)
    print(f"deepseek EP 2: worst grad rel err {err[worst]:.3g} ({worst})")
    assert err[worst] <= R.GRAD_RTOL, worst
    assert (int(one["local_experts"]), int(two["local_experts"])) == (4, 2)


def test_a_three_step_deepseek_job_through_the_stack_on_the_megatron_backend(megatron_core, controller_stack,
                                                                             tmp_path):
    """A DeepSeek-V3-family job (fp8_e2e, FP8 latent KV cache in the torch rollout, scales recalibrated each step,
    routing replay) whose trainer service runs Megatron's MLA and MoE: three steps succeed, each version refits the
    rollout under HF names (the router's bias included), and the mismatch stays within the recipe's per-step
    promise."""
    from fp8rl.model.tokenizer import CharTokenizer
    from fp8rl.rpc import trainer_pb2, trainer_pb2_grpc
    from fp8rl.rpc.channel import make_channel

    h, tok = controller_stack, CharTokenizer()
    cfg = deepseek_config(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                          initializer_range=0.05)
    job, model_dir = megatron_moe_job(h, tmp_path, cfg, tok)
    reports, info, stack = h.run_stack_job(tmp_path, job, model_dir, watch_s=300.0)
    try:
        trainer = trainer_pb2_grpc.TrainerServiceStub(
            make_channel(f"127.0.0.1:{stack.process('trainer')['port']}", token=stack.service_token, tls_ca=""))
        status = trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=30)
    finally:
        h.down(stack)
    assert (status.backend, status.recipe, status.version) == ("megatron", "fp8_e2e", 3)
    assert_moe_steps_within_promise(info, reports)


def test_what_megatron_cannot_run_of_the_deepseek_family_is_refused(megatron_core, monkeypatch):
    """transformers' ``rope_interleave=false`` (Megatron's MLA always de-interleaves), attention biases (its MLA
    projections have none) and tensor parallelism (MLA's projections are not sliced here): refused at build, naming
    the key and what to use."""
    with pytest.raises(ValueError, match="rope_interleave=false.*backend: torch"):
        _megatron(deepseek_policy(rope_interleave=False), recipe_for_role("bf16", "trainer"))
    with pytest.raises(ValueError, match="attention_bias=true.*backend: torch"):
        _megatron(deepseek_policy(attention_bias=True), recipe_for_role("bf16", "trainer"))
    from megatron.core import parallel_state

    from fp8rl.engines.megatron.model import _mla_config

    # the world-size query as two tensor-parallel ranks would answer it (a unit double: the refusal's own arithmetic)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size 1 and pipeline_model_parallel_size 1"):
        _mla_config(deepseek_config(), te=False)
