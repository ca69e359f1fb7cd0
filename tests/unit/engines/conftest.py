"""Small random models shared by the engine tests (FP32, seeded)."""

import pytest
import torch

from fp8rl.model import CausalLM, ModelConfig


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="module")
def policy() -> CausalLM:
    torch.manual_seed(1234)
    m = CausalLM(tiny_config())
    with torch.no_grad():  # sharpen the random model a little so sampling is not uniform noise
        m.lm_head.weight.mul_(3.0)
    return m.eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [[1] + torch.randint(4, 100, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]


@pytest.fixture(scope="module")
def awkward():
    """Dims that are not multiples of 128 (FP8 blocks padded), GQA 3:1, tied embeddings."""
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=97, hidden_size=192, intermediate_size=320, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, initializer_range=0.08)
    return CausalLM(cfg).eval()
