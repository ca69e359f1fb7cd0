"""The pipeline-parallel layout of the Megatron backend (``fp8rl.engines.megatron.pipeline_parallel``): names only,
so exact. No megatron-core needed (``make test-megatron`` runs the stages through Megatron's schedule)."""

from __future__ import annotations

import pytest

from fp8rl.engines.megatron import hf_to_megatron
from fp8rl.engines.megatron.pipeline_parallel import owner_stage, stage_name, whole_name, whole_param_order
from fp8rl.model import CausalLM, ModelConfig

PER_LAYER = ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
             "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]


def _whole(num_layers: int, tied: bool) -> list[str]:
    """The whole model's Megatron names, from the real HF -> Megatron conversion of a small model."""
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=32, tie_word_embeddings=tied)
    return sorted(hf_to_megatron(CausalLM(cfg).state_dict(), cfg, fused_norms=False))


def _stage_params(layers: range, first: bool, last: bool, tied: bool) -> list[str]:
    """A stage GPTModel's parameter names in registration order."""
    names = ["embedding.word_embeddings.weight"] if first else []
    names += [f"decoder.layers.{i}.{s}" for i in range(len(layers)) for s in PER_LAYER]
    if last:
        names.append("decoder.final_layernorm.weight")
        if not (tied and first):
            names.append("output_layer.weight")
    return names


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_every_whole_tensor_has_one_owner_stage_that_holds_it_under_its_local_name(pp, tied):
    n = 4
    whole = _whole(n, tied)
    per = n // pp
    held = {}
    for p in range(pp):
        layers = range(p * per, (p + 1) * per)
        local = _stage_params(layers, p == 0, p == pp - 1, tied)
        tied_copy = pp > 1 and tied and p == pp - 1
        for name in local:
            w = whole_name(name, layers, tied_copy)
            assert w in whole, name
            if tied_copy and name == "output_layer.weight":
                assert owner_stage(w, n, pp) == 0 != p  # the copy; the first stage owns the embedding
                continue
            assert owner_stage(w, n, pp) == p and stage_name(w, layers) == name
            held.setdefault(w, []).append(p)
    assert sorted(held) == whole and all(len(v) == 1 for v in held.values())  # each owned exactly once


@pytest.mark.parametrize("tied", [False, True])
def test_the_whole_parameter_order_is_the_one_stage_model_s(tied):
    """From a middle stage's or the last stage's local order, the whole model's order is what one stage holding
    everything registers (the optimizer state's positions in a checkpoint)."""
    whole = _whole(4, tied)
    one_stage = _stage_params(range(4), True, True, tied)
    for layers, first, last in [(range(2, 4), False, True), (range(1, 2), False, False), (range(0, 2), True, False)]:
        assert whole_param_order(_stage_params(layers, first, last, tied), whole, layers) == one_stage


def test_a_stage_without_layers_or_names_that_do_not_match_are_refused():
    whole = _whole(2, False)
    with pytest.raises(ValueError, match="holds no decoder layer"):
        whole_param_order(["embedding.word_embeddings.weight"], whole, range(0, 0))
    with pytest.raises(ValueError, match="names differ"):
        extra = whole + ["decoder.layers.1.extra.weight"]
        whole_param_order(_stage_params(range(2), True, True, False), extra, range(2))
