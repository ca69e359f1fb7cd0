"""The Megatron backend's expert-parallel layout as pure functions of names (no megatron-core, no process group):
local ↔ whole (EP = 1) expert names, the EP = 1 parameter order a checkpoint's optimizer state is keyed by, the
owner of each expert, and the layouts refused before anything is built."""

from __future__ import annotations

import pytest

from fp8rl.engines.megatron.expert_parallel import (
    check_expert_parallel,
    expert_owner,
    is_expert,
    whole_expert_name,
    whole_expert_order,
)
from fp8rl.model import ModelConfig

E = "decoder.layers.1.mlp.experts.local_experts."


def _moe(num_experts: int = 4) -> ModelConfig:
    return ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                       num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=64)


def _local(num_local: int) -> list[str]:
    """A rank's parameters() order: a layer's router, then each local expert's fc1 and fc2, then the next tensor."""
    experts = [f"{E}{j}.{w}" for j in range(num_local) for w in ("linear_fc1.weight", "linear_fc2.weight")]
    return ["decoder.layers.1.mlp.router.weight", *experts, "decoder.final_layernorm.weight"]


def test_local_experts_map_to_whole_names_by_rank():
    assert whole_expert_name(f"{E}1.linear_fc2.weight", ep_rank=1, num_local=2) == f"{E}3.linear_fc2.weight"
    assert whole_expert_name(f"{E}0.linear_fc1.weight", ep_rank=0, num_local=2) == f"{E}0.linear_fc1.weight"
    assert whole_expert_name("decoder.layers.1.mlp.router.weight", 1, 2) == "decoder.layers.1.mlp.router.weight"
    assert is_expert(f"{E}3.linear_fc1.weight") and not is_expert("decoder.layers.1.mlp.router.weight")
    assert [expert_owner(f"{E}{g}.linear_fc1.weight", num_local=2) for g in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="not an expert"):
        expert_owner("decoder.layers.1.mlp.router.weight", 2)


def test_the_whole_order_is_the_order_of_one_rank_holding_every_expert():
    assert whole_expert_order(_local(2), num_experts=4) == _local(4)
    assert whole_expert_order(_local(4), num_experts=4) == _local(4)  # EP 1: unchanged


def test_layouts_that_cannot_run_are_refused_naming_the_key():
    cfg = _moe()
    check_expert_parallel(cfg, 2, 2, "alltoall")  # runs
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=3 must divide the model's 4 experts"):
        check_expert_parallel(cfg, 3, 3, "allgather")
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=4 must divide the data-parallel size \(2"):
        check_expert_parallel(cfg, 4, 2, "allgather")
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=0 must be at least 1"):
        check_expert_parallel(cfg, 0, 2, "allgather")
    with pytest.raises(ValueError, match=r"moe_token_dispatcher_type='flex'"):
        check_expert_parallel(cfg, 1, 1, "flex")
    dense = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="has no mixture-of-experts layer"):
        check_expert_parallel(dense, 2, 2, "allgather")
