"""Trained checkpoints the export tests read: tiny-arith after one FP8 GRPO step (its last layer kept in BF16), a
small Qwen3-MoE after one, and the model directories they name.

Every checkpoint is written by the real :class:`TorchTrainer` after a real optimizer step, so its weights differ
from the model it started from (the round-trip tests check that they do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fp8rl.engines import TorchTrainer, TrainBatch, TrainerConfig
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM, ModelConfig, save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.presets import load_policy


@dataclass
class Trained:
    """A trainer after its steps, its checkpoint, the model it started from and some token ids."""

    trainer: TorchTrainer
    ckpt: Path
    start: dict[str, torch.Tensor]
    ids: torch.Tensor
    source: str


def batch(rows: int = 8, length: int = 20, vocab: int = 100, seed: int = 0) -> TrainBatch:
    """Full rows whose last 12 tokens are the response, random advantages and sampling logprobs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, length), generator=g)
    loss = torch.zeros(rows, length, dtype=torch.long)
    loss[:, 8:] = 1
    return TrainBatch(ids, torch.ones(rows, length, dtype=torch.long), loss, torch.randn(rows, generator=g),
                      -torch.rand(rows, length, generator=g) * loss)


def train(policy: CausalLM, recipe, path: Path, steps: int = 1) -> TorchTrainer:
    """``steps`` GRPO steps of a torch trainer on ``policy`` (lr 1e-3: every weight moves), saved to ``path``."""
    torch.manual_seed(0)
    tr = TorchTrainer(policy, recipe, TrainerConfig(lr=1e-3, micro_batch_size=8))
    for s in range(steps):
        tr.train_step(batch(seed=s, vocab=min(100, policy.config.vocab_size)))
    tr.save_checkpoint(str(path))
    return tr


@pytest.fixture(scope="session")
def tiny_arith(tmp_path_factory) -> Trained:
    """tiny-arith (preset, cached) after one ``fp8_e2e`` step with ``num_last_layers_in_bf16: 1``, as a ``.pt``."""
    policy, _, _ = load_policy("tiny-arith")
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    recipe = recipe_for_role("fp8_e2e", "trainer", num_last_layers_in_bf16=1)
    ck = tmp_path_factory.mktemp("tiny-arith") / "trainer-v000001.pt"
    tr = train(policy, recipe, ck)
    ids = torch.randint(4, 100, (3, 17), generator=torch.Generator().manual_seed(1))
    return Trained(tr, ck, start, ids, "tiny-arith")


def moe_config() -> ModelConfig:
    """A small Qwen3-MoE: 2 layers of 4 experts (top 2), 128-wide (whole FP8 blocks)."""
    return ModelConfig(architecture="qwen3_moe", vocab_size=128, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                       norm_topk_prob=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def model_dir(model: CausalLM, path: Path) -> Path:
    """``model`` saved as an HF directory with the character tokenizer: a ``--model`` for checkpoints of it."""
    save_hf_checkpoint(model, model.config, path)
    CharTokenizer().save(path)
    return path


@pytest.fixture(scope="session")
def moe(tmp_path_factory) -> Trained:
    """The small Qwen3-MoE (O(1) weights, so logits mean something) after one ``fp8_e2e`` step, as a ``.pt``
    whose recorded source is its model directory."""
    torch.manual_seed(3)
    policy = CausalLM(moe_config())
    with torch.no_grad():
        for name, p in policy.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / math.sqrt(p.shape[-1]))
    root = tmp_path_factory.mktemp("moe")
    policy.name_or_path = str(model_dir(policy, root / "model"))
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    tr = train(policy, recipe_for_role("fp8_e2e", "trainer"), root / "trainer-v000001.pt")
    ids = torch.randint(4, 100, (3, 17), generator=torch.Generator().manual_seed(2))
    return Trained(tr, root / "trainer-v000001.pt", start, ids, policy.name_or_path)
