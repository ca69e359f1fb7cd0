"""Controller-test fixtures: a tiny random checkpoint, its job file, and a whole stack started by the launcher.

The stack is started exactly as a user would: ``python -m deploy.launcher up --job J --run-dir R`` (a
fresh redis-server plus trainer, calibrator, reward, one rollout replica and the controller as real
processes), and stopped with ``python -m deploy.launcher down``. One stack per test module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from fp8rl.model import CausalLM, ModelConfig, save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer

REPO = Path(__file__).resolve().parents[3]
UP_TIMEOUT_S = 240.0  # five processes import torch at once on two shared cores


def tiny_model(path: Path) -> Path:
    """A seeded random 2-layer, 128-wide Llama + the character tokenizer (no warm start needed)."""
    tok = CharTokenizer()
    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=64, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                      pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    save_hf_checkpoint(CausalLM(cfg), cfg, path)
    tok.save(path)
    return path


def tiny_job(model_dir: Path, **job) -> dict:
    """A 2-step fp8_e2e job with an FP8 KV cache on ``model_dir``; ``job`` overrides ``job.*`` keys."""
    return {
        "job": {"name": "ctl-test", "steps": 2, "seed": 0, "checkpoint_every": 1, **job},
        "policy": {"model": str(model_dir),
                   "generation": {"max_new_tokens": 4, "vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "fp8"}},
                   "training": {"lr": 0.01, "micro_batch_size": 8, "megatron_cfg": {"fp8_cfg": {"enabled": True}}}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2},
        "calibration": {"max_sequences": 4},
    }


def launcher(*args: str, timeout: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_") or k == "FP8RL_REDIS_SERVER"}
    return subprocess.run([sys.executable, "-m", "deploy.launcher", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@dataclass
class Stack:
    """A launched stack: its run directory, job file and controller address."""

    run_dir: Path
    job_file: Path
    model_dir: Path

    @property
    def info(self) -> dict:
        return json.loads((self.run_dir / "stack.json").read_text())

    @property
    def target(self) -> str:
        return self.info["controller"]

    def process(self, name: str) -> dict:
        return next(p for p in self.info["processes"] if p["name"] == name)

    def job_yaml(self, **job) -> str:
        return yaml.safe_dump(tiny_job(self.model_dir, **job))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("controller-stack")
    model_dir = tiny_model(tmp / "model")
    job_file = tmp / "job.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job(model_dir)))
    run_dir = tmp / "run"
    up = launcher("up", "--job", str(job_file), "--run-dir", str(run_dir), "--ready-timeout", "180")
    if up.returncode != 0:
        pytest.fail(f"launcher up failed ({up.returncode}):\n{up.stderr[-4000:]}", pytrace=False)
    try:
        yield Stack(run_dir, job_file, model_dir)
    finally:
        launcher("down", "--run-dir", str(run_dir), "--grace", "10", timeout=60)
