"""Fixtures of the Megatron backend tests: small seeded HF-layout policies and right-padded batches.

These tests need megatron-core (``pip install 'fp8rl[megatron]'``; ``make test-megatron`` installs it).
When it is missing the ``megatron_core`` fixture FAILS with that instruction rather than skipping, so
the tier cannot go green without running.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fp8rl.engines import TrainBatch
from fp8rl.model import CausalLM, ModelConfig


def model_config(kind: str = "llama") -> ModelConfig:
    """Three small architectures that between them cover GQA, MHA, QKV bias, QK-norm and tied embeddings."""
    common = dict(vocab_size=128, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  rms_norm_eps=1e-5)
    if kind == "llama":  # tiny-arith's shape, fewer layers: GQA 4/2, untied head, theta 10000
        return ModelConfig(architecture="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10000.0, **common)
    if kind == "qwen2":  # q/k/v bias, tied embeddings, one KV head, FFN not a multiple of 128, other theta
        return ModelConfig(architecture="qwen2", hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, rope_theta=1e6,
                           tie_word_embeddings=True, **common)
    if kind == "qwen3":  # per-head QK RMSNorm, plain MHA
        return ModelConfig(architecture="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=64, **common)
    raise ValueError(kind)


def make_policy(kind: str = "llama", seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    m = CausalLM(model_config(kind))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):  # non-trivial norms and biases: a swapped one shows
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
        if not m.config.tie_word_embeddings:
            m.lm_head.weight.mul_(3.0)
    return m


def make_batch(seed: int = 0, rows: int = 6, length: int = 24, vocab: int = 128) -> TrainBatch:
    """Right-padded rows (prompt 6 tokens, responses of varying length) with random advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    lengths[0] = length
    attn = (torch.arange(length)[None, :] < lengths[:, None]).float()
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))
    loss_mask = attn.clone()
    loss_mask[:, :6] = 0
    gen = -torch.rand(rows, length, generator=g) * 3 * loss_mask
    adv = torch.randn(rows, generator=g)
    return TrainBatch(ids, attn, loss_mask, adv, gen)


@pytest.fixture(scope="session")
def megatron_core():
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.fail("megatron-core is not installed: `make test-megatron` installs the fp8rl[megatron] extra",
                    pytrace=False)
    import megatron.core

    return megatron.core
