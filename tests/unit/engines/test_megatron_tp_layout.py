"""The tensor-parallel layout of the Megatron backend (``fp8rl.engines.megatron.tensor_parallel``): pure index
moves, so exact; and the shapes it refuses. No megatron-core needed (``make test-megatron`` runs the layers)."""

from __future__ import annotations

import pytest
import torch

from fp8rl.engines.megatron.tensor_parallel import check_tensor_parallel, partition_dims, to_full, to_local
from fp8rl.fp8 import Fp8Recipe
from fp8rl.model import ModelConfig


def _config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=64)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name,dim", [("decoder.layers.0.self_attention.linear_qkv.weight", 0),
                                      ("decoder.layers.0.self_attention.linear_proj.weight", 1),
                                      ("decoder.layers.0.mlp.linear_fc1.weight", 0),
                                      ("decoder.layers.0.input_layernorm.weight", None)])
def test_slices_put_back_together_are_the_tensor(tp, name, dim):
    full = torch.randn(16, 8) if dim is not None else torch.randn(8)
    parts = [to_local(name, full, dim, r, tp) for r in range(tp)]
    assert torch.equal(to_full(name, parts, dim), full)
    if dim is not None:
        assert all(p.shape[dim] == full.shape[dim] // tp for p in parts)


def test_fused_gate_up_is_split_per_half():
    full = torch.arange(8.0)[:, None]  # rows 0..3 gate, 4..7 up
    r0, r1 = (to_local("decoder.layers.1.mlp.linear_fc1.weight", full, 0, r, 2).flatten().tolist() for r in (0, 1))
    assert (r0, r1) == ([0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0])  # each rank: its gate rows, then its up rows
    assert to_local("decoder.layers.1.self_attention.linear_qkv.weight", full, 0, 1, 2).flatten().tolist() == \
        [4.0, 5.0, 6.0, 7.0]  # other tensors: contiguous (whole query groups)


def test_partition_dims_are_read_off_the_shapes_and_bad_ones_refused():
    full = {"a": torch.Size([8, 4]), "b": torch.Size([4, 8]), "n": torch.Size([4])}
    assert partition_dims({"a": torch.Size([4, 4]), "b": torch.Size([4, 4]), "n": torch.Size([4])}, full, 2) == \
        {"a": 0, "b": 1, "n": None}
    with pytest.raises(ValueError, match=r"a is \(3, 4\) on this rank, \(8, 4\) whole; expected one dimension split"):
        partition_dims({"a": torch.Size([3, 4]), "b": torch.Size([4, 4]), "n": torch.Size([4])}, full, 2)
    with pytest.raises(ValueError, match="names differ"):
        partition_dims({"a": torch.Size([4, 4])}, full, 2)


def test_sizes_the_model_cannot_split_or_fp8_blocks_would_straddle_are_refused_naming_the_key():
    check_tensor_parallel(_config(), Fp8Recipe(linear="fp8"), 2)  # 128-row slices everywhere: whole blocks
    check_tensor_parallel(_config(num_key_value_heads=2), Fp8Recipe(linear="bf16"), 2)  # no FP8: any even split
    key = "policy.training.megatron_cfg.tensor_model_parallel_size"
    with pytest.raises(ValueError, match=rf"{key}=2 gives each rank 64 k_proj / v_proj rows, not a multiple of 128"):
        check_tensor_parallel(_config(num_key_value_heads=2), Fp8Recipe(linear="fp8"), 2)
    with pytest.raises(ValueError, match=rf"{key}=8 does not divide the model's num_attention_heads \(4\)"):
        check_tensor_parallel(_config(), Fp8Recipe(linear="bf16"), 8)
    with pytest.raises(ValueError, match=rf"{key}=3 does not divide"):
        check_tensor_parallel(_config(), Fp8Recipe(linear="bf16"), 3)
