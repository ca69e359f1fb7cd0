"""Service-test fixtures: a tiny random HF checkpoint, job YAMLs, and real service processes.

Services run as ``python -m services.<role> --port 0 --ready-file F``; each writes F (JSON with its
bound ``port``) once it listens, which is how a test learns where to connect. Readiness to serve is
read from gRPC health / Status, never from the file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import yaml

from fp8rl.model import CausalLM, ModelConfig, save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.rpc.channel import make_channel

REPO = Path(__file__).resolve().parents[3]
READY_TIMEOUT_S = 90.0  # three services import torch at once on two shared cores


def tiny_config() -> ModelConfig:
    """2 layers, width 128 (one FP8 block), 64 positions: loads in milliseconds."""
    tok = CharTokenizer()
    return ModelConfig(architecture="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       max_position_embeddings=64, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                       pad_token_id=tok.pad_id)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random checkpoint directory (config.json, model.safetensors, fp8rl_tokenizer.json)."""
    path = tmp_path_factory.mktemp("tiny-model")
    torch.manual_seed(0)
    cfg = tiny_config()
    model = CausalLM(cfg)
    with torch.no_grad():  # sharper logits: greedy choices are not near-ties between engines
        model.lm_head.weight.mul_(4.0)
    save_hf_checkpoint(model, cfg, path)
    CharTokenizer().save(path)
    return path


def _write_job(path: Path, model_dir: Path, job_id: str, calibration: dict | None = None, **generation) -> Path:
    """A tiny fp8_e2e job with an FP8 KV cache; ``generation`` overrides ``policy.generation`` keys; ``calibration`` the
    calibration keys (its site defaults to the calibrator service, which these tests drive)."""
    job = {
        "job": {"name": job_id, "seed": 0},
        "policy": {
            "model": str(model_dir),
            "generation": {"max_new_tokens": 4, "vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "fp8"},
                           **generation},
            "training": {"lr": 0.02, "micro_batch_size": 8, "megatron_cfg": {"fp8_cfg": {"enabled": True}}},
        },
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        "calibration": calibration or {"max_sequences": 4, "site": "calibrator"},
    }
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="session")
def write_job():
    """``write_job(path, model_dir, job_id, calibration=None, **generation)``: writes a tiny job YAML, returns its
    path."""
    return _write_job


class ServiceProcess:
    """One ``python -m services.<role>`` child process, its log file and its ready file."""

    def __init__(self, role: str, config: Path, redis_url: str, workdir: Path, replica_id: str,
                 extra: tuple[str, ...] = ()) -> None:
        self.role, self.replica_id = role, replica_id
        self.ready_file = workdir / f"{replica_id}.ready.json"
        self.log_path = workdir / f"{replica_id}.log"
        self.ready_file.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")}
        env.update(FP8RL_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", f"services.{role}", "--config", str(config), "--port", "0",
               "--host", "127.0.0.1", "--redis-url", redis_url, "--replica-id", replica_id,
               "--ready-file", str(self.ready_file), "--lease-ttl", "3", *extra]
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.info: dict = {}

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def wait_listening(self, timeout: float = READY_TIMEOUT_S) -> ServiceProcess:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.role} exited with {self.proc.returncode} before listening:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.role} did not write {self.ready_file} within {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.info = json.loads(self.ready_file.read_text())
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.info['port']}"

    def channel(self) -> grpc.Channel:
        return make_channel(self.target, token="", tls_ca="")

    def terminate(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)


class Spawner:
    """Starts service processes and stops every one of them at teardown."""

    def __init__(self, redis_url: str, workdir: Path) -> None:
        self.redis_url, self.workdir = redis_url, workdir
        self.procs: list[ServiceProcess] = []

    def start(self, role: str, config: Path, replica_id: str, *extra: str) -> ServiceProcess:
        p = ServiceProcess(role, config, self.redis_url, self.workdir, replica_id, tuple(extra))
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:  # signal every process first, so their graceful stops overlap
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.procs:
            p.terminate()


@pytest.fixture(scope="module")
def spawner(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawner]:
    s = Spawner(redis_url, tmp_path_factory.mktemp("services"))
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture(scope="module")
def module_job_id() -> str:
    """One job (Redis namespace) per test module."""
    return "svc-" + uuid.uuid4().hex[:10]
