"""Qwen3-MoE in fp8rl.model: logits equal to transformers' own Qwen3MoeForCausalLM, checkpoints both ways (per-expert
and fused), the router never in FP8, routing replay, the load-balancing loss against transformers' function, and the
routes on the wire."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from fp8rl.engines.base import Sample
from fp8rl.engines.batch import batch_routes
from fp8rl.fp8 import Fp8Recipe, convert_model, fp8_linear_names
from fp8rl.fp8.linear import Fp8InferenceLinear, Fp8Linear
from fp8rl.model import CausalLM, KVCache, ModelConfig, Routing, load_hf_checkpoint, routing, save_hf_checkpoint
from fp8rl.model.router import TopKRouter
from fp8rl.rpc.routes import routes_from_proto, routes_to_proto

# FP32 both sides; the implementations differ in summation order only (our combine sums a token's K expert outputs
# in slot order, transformers index_adds expert by expert), so a few ulps of O(1) logits, as for the dense models.
ATOL_HF = 1e-4
# Cached decode vs the full forward: the same ops on differently shaped batches (FP32).
ATOL_CACHE = 1e-5

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, max_position_embeddings=128, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=40)
CASES = {
    "untied_norm_topk_mlp_only_layer": dict(norm_topk_prob=True, mlp_only_layers=[1]),
    "tied_sparse_step_2": dict(tie_word_embeddings=True, decoder_sparse_step=2, norm_topk_prob=False),
    "top1_of_8": dict(num_experts=8, num_experts_per_tok=1),
}


def _scramble(model: torch.nn.Module) -> None:
    """O(1) activations (the default 0.02 init makes logits ~0 and routing near-uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))


def _hf(**kw) -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(**{**BASE, **kw})
    cfg._attn_implementation = "eager"
    model = Qwen3MoeForCausalLM(cfg).eval()
    _scramble(model)
    return model


def _ours(**kw) -> CausalLM:
    model = CausalLM(ModelConfig("qwen3_moe", **{**BASE, **kw})).eval()
    _scramble(model)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    torch.manual_seed(0)
    hf = _hf(**CASES[case])
    hf.save_pretrained(tmp_path)  # per-expert tensors on disk (transformers' default)
    ours, cfg = load_hf_checkpoint(tmp_path)
    assert cfg.num_experts == hf.config.num_experts and cfg.moe_layers == [
        i for i in range(3) if i not in hf.config.mlp_only_layers and (i + 1) % hf.config.decoder_sparse_step == 0]
    ids = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        want, got = hf(ids).logits.float(), ours(ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0)


def test_fused_checkpoints_load_and_ours_load_in_transformers(tmp_path):
    torch.manual_seed(1)
    hf = _hf(**CASES["untied_norm_topk_mlp_only_layer"])
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)  # experts.gate_up_proj (E, 2F, C) on disk
    ours, cfg = load_hf_checkpoint(tmp_path / "fused")
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        want = hf(ids).logits.float()
        torch.testing.assert_close(ours(ids), want, atol=ATOL_HF, rtol=0)
    save_hf_checkpoint(ours, cfg, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["num_experts"] == written["num_local_experts"] == 6  # both generations' readers agree
    again = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits.float(), want, atol=ATOL_HF, rtol=0)


def test_config_keys_and_refusals():
    cfg = ModelConfig.from_hf_dict({**_hf().config.to_dict()})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.route_shape) == (6, 2, (3, 2, 6))
    with pytest.raises(ValueError, match="num_experts_per_tok=7 exceeds num_experts=6"):
        ModelConfig("qwen3_moe", **{**BASE, "num_experts_per_tok": 7})
    with pytest.raises(ValueError, match=r"mlp_only_layers \[5\]"):
        ModelConfig("qwen3_moe", **{**BASE, "mlp_only_layers": [5]})
    with pytest.raises(ValueError, match="only deepseek_v3/qwen3_moe have experts"):
        ModelConfig("qwen3", **{**BASE})
    with pytest.raises(ValueError, match="num_experts=6 but num_local_experts=4"):
        ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "num_local_experts": 4})
    assert ModelConfig("qwen3", **{k: v for k, v in BASE.items() if "expert" not in k}).route_shape is None


@pytest.mark.parametrize("mode,cls", [("train", Fp8Linear), ("inference", Fp8InferenceLinear)])
def test_the_router_is_never_fp8_and_every_expert_linear_is(mode, cls):
    model = _ours()
    convert_model(model, Fp8Recipe(linear="fp8"), mode=mode)
    for i in model.config.moe_layers:
        block = model.model.layers[i].mlp
        assert type(block.gate) is TopKRouter and block.gate.weight.dtype == torch.float32
        assert all(type(getattr(e, n)) is cls for e in block.experts for n in ("gate_proj", "up_proj", "down_proj"))
    names = fp8_linear_names(_ours(mlp_only_layers=[1]), Fp8Recipe(linear="fp8"))
    assert not any(n.endswith("mlp.gate") for n in names)
    assert "model.layers.0.mlp.experts.5.down_proj" in names and "model.layers.1.mlp.gate_proj" in names
    # the payload of an FP8 refit: the router travels in high precision
    sd = {k: v for k, v in model.state_dict().items() if k.endswith("mlp.gate.weight")}
    assert sd and all(v.dtype == torch.float32 for v in sd.values())


def test_replay_reproduces_the_recorded_routes_after_the_router_changes():
    torch.manual_seed(2)
    model = _ours(num_experts=8, num_experts_per_tok=2)
    ids = torch.randint(0, 97, (3, 17))
    with torch.no_grad(), routing(model, Routing(model.num_moe_layers, record=True)) as rec:
        model(ids)
    recorded = rec.routes().view(3, 17, model.num_moe_layers, 2)
    with torch.no_grad():  # another router: on its own it routes differently (the negative control)
        for r in (m for m in model.modules() if isinstance(m, TopKRouter)):
            r.weight.add_(torch.randn_like(r.weight))
        with routing(model, Routing(model.num_moe_layers, record=True)) as own:
            model(ids)
        assert not torch.equal(own.routes().view_as(recorded), recorded)
        with routing(model, Routing(model.num_moe_layers, replay=recorded, record=True)) as replayed:
            model(ids)
    assert torch.equal(replayed.routes().view_as(recorded), recorded)  # exactly the rollout's experts
    agree, total = replayed.agreement()
    assert total == 3 * 17 * model.num_moe_layers and agree < total  # its own choice disagreed somewhere


def test_replayed_gates_come_from_the_trainers_scores_so_the_router_learns():
    torch.manual_seed(3)
    model = _ours().train()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad(), routing(model, Routing(model.num_moe_layers, record=True)) as rec:
        model(ids)
    plan = Routing(model.num_moe_layers, replay=rec.routes().view(2, 9, model.num_moe_layers, 2))
    with routing(model, plan):
        model(ids).logsumexp(-1).sum().backward()
    gates = [m.weight.grad for m in model.modules() if isinstance(m, TopKRouter)]
    assert all(g is not None and bool(g.abs().sum() > 0) for g in gates)


def test_decode_with_a_cache_routes_and_computes_as_the_full_forward():
    torch.manual_seed(4)
    model = _ours()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        with routing(model, Routing(model.num_moe_layers, record=True)) as full_rec:
            full = model(ids)
        cache = KVCache.for_model(model, 2, 12)
        steps, routes = [model(ids[:, :5], kv_cache=cache)], []
        for t in range(5, 12):
            with routing(model, Routing(model.num_moe_layers, record=True)) as step:
                steps.append(model(ids[:, t:t + 1], kv_cache=cache))
            routes.append(step.routes().view(2, 1, model.num_moe_layers, 2))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL_CACHE, rtol=0)
    decoded = torch.cat(routes, 1)
    assert torch.equal(decoded, full_rec.routes().view(2, 12, model.num_moe_layers, 2)[:, 5:])


def test_the_load_balancing_loss_is_transformers():
    torch.manual_seed(5)
    model = _ours(num_experts=8, num_experts_per_tok=2)
    ids = torch.randint(0, 97, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    logits = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: logits.append(inp[0].float() @ mod.weight.float().t()))
             for r in model.modules() if isinstance(r, TopKRouter)]
    with torch.no_grad(), routing(model, Routing(model.num_moe_layers, token_mask=mask, aux=True)) as plan:
        model(ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    want = load_balancing_loss_func(tuple(logits), 8, 2, mask)  # transformers' own, over every layer
    # the same FP32 sums over ~40 tokens x 3 layers taken in another order: relative error ~1e-6 of an O(1) loss
    torch.testing.assert_close(plan.aux_loss, want.float(), atol=1e-6, rtol=1e-5)
    assert plan.load.sum(-1).tolist() == [float(mask.sum() * 2)] * model.num_moe_layers  # real tokens only


def _sample(n_prompt: int, n_resp: int, routes) -> Sample:
    return Sample(0, tuple(range(n_prompt)), tuple(range(n_resp)), (0.0,) * n_resp, "stop", 0, routes=routes)


def test_batch_routes_are_checked_and_name_the_sample():
    good = torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]], [[3, 2]]], dtype=torch.uint8)  # 2 + 3 - 1 tokens, L 1, K 2
    out = batch_routes([_sample(2, 3, good), _sample(2, 3, good)], 7, (1, 2, 4))
    assert out.shape == (2, 7, 1, 2) and torch.equal(out[0, :4].long(), good.long()) and bool((out[:, 4:] == -1).all())
    for routes, match in ((None, "sample 1: routing replay is on, but the sample carries no routes"),
                          (good[:3], r"sample 1: routes have shape \(3, 1, 2\), expected \(4, 1, 2\)"),
                          (good + 2, r"sample 1: routes hold expert ids outside \[0, 4\)"),
                          (good.clone().fill_(1), "sample 1: routes name one expert twice")):
        with pytest.raises(ValueError, match=match):
            batch_routes([_sample(2, 3, good), _sample(2, 3, routes)], 7, (1, 2, 4))


def test_routes_on_the_wire():
    for dtype in (torch.uint8, torch.int16):
        r = torch.randint(0, 200, (9, 3, 2)).to(dtype)
        back = routes_from_proto(routes_to_proto(r), "row 0")
        assert back.dtype == dtype and torch.equal(back, r)
    msg = routes_to_proto(torch.zeros(4, 3, 2, dtype=torch.int16))
    msg.ids = msg.ids[:-1]
    with pytest.raises(ValueError, match="row 7: routes hold 47 bytes, not a whole number of 3 x 2 int16 rows"):
        routes_from_proto(msg, "row 7")
    msg.dtype = "float32"
    with pytest.raises(ValueError, match="row 7: routes dtype 'float32' is not uint8 or int16"):
        routes_from_proto(msg, "row 7")


def test_grouped_fp8_experts_equal_a_per_token_reference():
    """The block's dispatch (tokens sorted by expert, one GEMM per expert) and its slot-order combine against an
    independent per-token loop over the same FP8 expert linears. The reference FP8 GEMM multiplies dequantized FP32
    operands, so a row's result does not depend on the rows beside it except through the BLAS's summation order:
    FP32 noise of O(1) activations."""
    torch.manual_seed(6)
    model = _ours(num_experts=8, num_experts_per_tok=2)
    convert_model(model, Fp8Recipe(linear="fp8"), mode="inference")
    block = model.model.layers[0].mlp
    x = torch.randn(3, 7, BASE["hidden_size"])
    with torch.no_grad():
        got = block(x)
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = block.gate(flat)
        want = torch.stack([sum(weights[n, k] * block.experts[int(ids[n, k])](flat[n:n + 1])[0].float()
                                for k in range(ids.shape[1])) for n in range(flat.shape[0])]).view_as(x)
    assert all(type(e.gate_proj) is Fp8InferenceLinear for e in block.experts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
