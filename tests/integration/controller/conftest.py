"""Controller-test fixtures: a tiny random checkpoint, its job file, and a whole stack started by the launcher.

A stack is started exactly as a user would: ``python -m deploy.launcher up --job J --run-dir R`` (a
fresh redis-server plus trainer, calibrator, reward, one rollout replica and the controller as real
processes), and stopped with ``python -m deploy.launcher down``. Starting one is the slow part, so a
module keeps its stack between tests — but no test relies on what an earlier one left: each asks for
what it needs (``stack``: every process up and no job in flight; ``pristine_stack``: also no job ever
submitted, so the trainer holds v0), and a new stack is launched whenever the current one is not that
(stopped by ``down``, a process dead, a job left in flight, or already used when a pristine one is asked).
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
import redis
import torch
import yaml

from fp8rl.controller.jobstore import JobStore
from fp8rl.model import CausalLM, ModelConfig, save_hf_checkpoint
from fp8rl.model.tokenizer import CharTokenizer
from fp8rl.refit import RefitStore, connect

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


def tiny_job(model_dir: Path, max_weight_lag: int | None = None, max_new_tokens: int = 4,
             calibration_site: str = "auto", **job) -> dict:
    """A 2-step fp8_e2e job with an FP8 KV cache on ``model_dir``; ``job`` overrides ``job.*`` keys;
    ``max_weight_lag`` (when given) makes it asynchronous GRPO with that bound."""
    grpo = {"num_prompts_per_step": 4, "num_generations_per_prompt": 2}
    if max_weight_lag is not None:
        grpo["async_grpo"] = {"enabled": True, "max_weight_lag": max_weight_lag}
    return {
        "job": {"name": "ctl-test", "steps": 2, "seed": 0, "checkpoint_every": 1, **job},
        "policy": {"model": str(model_dir),
                   "generation": {"max_new_tokens": max_new_tokens,
                                  "vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "fp8"}},
                   "training": {"lr": 0.01, "micro_batch_size": 8, "megatron_cfg": {"fp8_cfg": {"enabled": True}}}},
        "grpo": grpo,
        "calibration": {"max_sequences": 4, "site": calibration_site},
    }


def launcher(*args: str, timeout: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_") or k == "FP8RL_REDIS_SERVER"}
    return subprocess.run([sys.executable, "-m", "deploy.launcher", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def alive(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    stat = f"/proc/{pid}/stat"
    return not (os.path.exists(stat) and open(stat).read().rsplit(")", 1)[-1].split()[0] == "Z")


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

    @property
    def client_token(self) -> str:
        """The JobService token the launcher generated for this stack (what the SDK sends)."""
        return Path(self.info["secrets"]["client_token_file"]).read_text().strip()

    @property
    def service_token(self) -> str:
        """The internal RPCs' token the launcher generated for this stack (what the services send each other)."""
        return Path(self.info["secrets"]["service_token_file"]).read_text().strip()

    @property
    def redis_url(self) -> str:
        """The stack's Redis URL with the password the launcher generated (``RUN/secrets/redis.url``, 0600)."""
        return Path(self.info["secrets"]["redis_url_file"]).read_text().strip()

    def job_yaml(self, max_weight_lag: int | None = None, **job) -> str:
        return yaml.safe_dump(tiny_job(self.model_dir, max_weight_lag, **job))  # calibration_site= among job

    def jobs(self) -> JobStore:
        return JobStore(redis.Redis.from_url(self.redis_url))

    def refit(self) -> RefitStore:
        return RefitStore(connect(self.redis_url), self.info["namespace"])

    def usable(self) -> bool:
        """Not stopped, every recorded process (respawned ones under their new pid) running, no job in flight."""
        info = self.info
        if info.get("stopped") or not all(alive(p["pid"]) for p in info["processes"]):
            return False
        try:
            jobs = self.jobs()
            return not (jobs.in_state("pending") or jobs.in_state("running"))
        except redis.RedisError:
            return False

    def pristine(self) -> bool:
        """No job was ever submitted and the trainer's v0 is still the latest version."""
        return not self.jobs().list("", 1) and self.refit().latest() == 0


def run_stack_job(tmp_path: Path, job: dict, model_dir: Path, *, watch_s: float) -> tuple[list, object, Stack]:
    """Launch a stack for ``job`` (written to ``tmp_path/job.yaml``), submit the job and watch it to its end:
    ``(step reports, the final job info, the stack)``. The stack is still up on return — the caller takes it down
    with :func:`down` — and is taken down here when anything fails first."""
    from fp8rl.sdk import Fp8rlClient

    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    up = launcher("up", "--job", str(job_file), "--run-dir", str(run_dir), "--ready-timeout", "180")
    assert up.returncode == 0, up.stderr[-4000:]
    stack = Stack(run_dir, job_file, model_dir)
    try:
        with Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=30) as c:
            job_id = c.submit_job(job_file)
            reports = list(c.watch(job_id, timeout_s=watch_s))
            return reports, c.get_job(job_id), stack
    except BaseException:
        down(stack)
        raise


def assert_zero_mismatch(info, reports, steps: int) -> None:
    """A job that succeeded with ``steps`` step reports, each with generated tokens and the trainer's logprobs
    bitwise the rollout's: ``mismatch/max_abs_logprob_diff`` exactly 0 on the raw logprobs (issue 47; the FP32 means
    token_mult_prob_error and gen_kl_k3 round differences below ~1e-7 away, so they are only the message)."""
    assert (info.state, info.error) == ("succeeded", ""), info.error
    assert [r.step for r in reports] == list(range(steps))
    for r in reports:
        assert r.metrics["response_len"] > 1  # tokens were generated and compared
        assert r.max_abs_logprob_diff == 0.0, (r.step, r.max_abs_logprob_diff, r.token_mult_prob_error,
                                               r.metrics["gen_kl_k3"])


def down(stack: Stack) -> None:
    launcher("down", "--run-dir", str(stack.run_dir), "--grace", "10", timeout=60)


class Stacks:
    """One module's stacks: hands each test a live one, launching a new one only when the current can't serve."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.current: Stack | None = None

    def get(self, *, pristine: bool = False) -> Stack:
        st = self.current
        if st is not None and not (st.usable() and (not pristine or st.pristine())):
            self._down(st)
            st = self.current = None
        if st is None:
            st = self.current = self._up()
        return st

    def _up(self) -> Stack:
        tmp = self.tmp_path_factory.mktemp("controller-stack")
        model_dir = tiny_model(tmp / "model")
        job_file = tmp / "job.yaml"
        job_file.write_text(yaml.safe_dump(tiny_job(model_dir)))
        run_dir = tmp / "run"
        up = launcher("up", "--job", str(job_file), "--run-dir", str(run_dir), "--ready-timeout", "180", "--metrics")
        if up.returncode != 0:
            pytest.fail(f"launcher up failed ({up.returncode}):\n{up.stderr[-4000:]}", pytrace=False)
        return Stack(run_dir, job_file, model_dir)

    @staticmethod
    def _down(st: Stack) -> None:
        if not st.info.get("stopped"):
            launcher("down", "--run-dir", str(st.run_dir), "--grace", "10", timeout=60)

    def close(self) -> None:
        if self.current is not None:
            self._down(self.current)
            self.current = None


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    s = Stacks(tmp_path_factory)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def stack(stacks: Stacks) -> Stack:
    """A running stack with no job in flight; earlier tests' jobs, versions and checkpoints may be in it."""
    return stacks.get()


@pytest.fixture
def pristine_stack(stacks: Stacks) -> Stack:
    """A running stack on which no job was ever submitted: the trainer holds v0 and the job list is empty."""
    return stacks.get(pristine=True)
