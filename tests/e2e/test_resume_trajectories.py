"""A multi-turn loop job SIGKILLed with trajectories in flight and resumed (issue 50, lossless resume), both
policies, the loop as a real process (``python -m fp8rl.loop``).

fp8rl does not write in-flight trajectories into its checkpoints: a step's problems and every sampler seed are
functions of the step index, so the resumed run regenerates the rollouts of the steps the killed one had begun past
its checkpoint — none is skipped and none trained twice — and counts them (``resume/steps_redone``,
``resume/rollouts_restarted`` in ``summary.json``). Synchronous: the resumed run is, row for row, the run that was
never stopped (bitwise on everything but time and memory). Asynchronous (``env.partial: interrupt``, lag 1): which
rollouts overlap which step depends on timing, so the check is that every step is trained exactly once with all of
its trajectories graded.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fp8rl.loop import main

from .test_loop_resume import _rows, _steady, _wait_rows
from .test_trajectories import _chat_model, _job

pytestmark = pytest.mark.chaos  # SIGKILLed loop processes: the chaos tier (make test-chaos), not the ISA matrix

STEPS, EVERY, PROMPTS, GROUP = 4, 2, 2, 2
ENV_TIMES = ("env/seconds", "env/share_of_rollout", "env/share_of_step")  # the environment's wall clock, per run


def _steady_mt(row: dict) -> dict:
    return {k: v for k, v in _steady(row).items() if k not in ENV_TIMES}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return _chat_model(tmp_path_factory.mktemp("chat-model-resume"))


def _job_file(tmp: Path, model: Path, **more) -> Path:
    job = _job(model, job={"steps": STEPS, "seed": 0, "checkpoint_every": EVERY, "eval_size": 2},
               grpo={"num_prompts_per_step": PROMPTS, "num_generations_per_prompt": GROUP,
                     **more.pop("grpo", {})}, **more)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _killed_then_resumed(job: Path, out: Path) -> list[dict]:
    proc = subprocess.Popen([sys.executable, "-m", "fp8rl.loop", "--config", str(job), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_rows(proc, out, EVERY + 1)  # the checkpoint after step 2 is whole; step 3's trajectories are in flight
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert main(["--resume", str(out)]) == 0
    return _rows(out)


def test_a_synchronous_multi_turn_run_killed_mid_step_resumes_bitwise(chat_model, tmp_path):
    job = _job_file(tmp_path, chat_model)
    assert main(["--config", str(job), "--out", str(tmp_path / "ref")]) == 0
    resumed = _killed_then_resumed(job, tmp_path / "killed")
    ref = _rows(tmp_path / "ref")
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for a, b in zip(ref, resumed, strict=True):
        assert _steady_mt(a) == _steady_mt(b), f"step {a['step']} differs after the resume"
        assert a["env/turns_mean"] > 1 and b["mismatch/max_abs_logprob_diff"] == 0.0
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())["summary"]
    # killed after 3 rows, checkpoint after 2: steps 2 (measured, dropped) and 3 (in flight) ran again
    assert summary["resume/steps_redone"] == 2 and summary["resume/rollouts_restarted"] == 2 * PROMPTS * GROUP


def test_an_asynchronous_interrupt_run_killed_mid_step_trains_every_step_once(chat_model, tmp_path):
    job = _job_file(tmp_path, chat_model, env={"partial": "interrupt"},
                    grpo={"async_grpo": {"enabled": True, "max_weight_lag": 1}})
    rows = _killed_then_resumed(job, tmp_path / "killed")
    assert [r["step"] for r in rows] == list(range(STEPS))  # every step once: none lost, none trained twice
    for r in rows:
        ends = sum(v for k, v in r.items() if k.startswith("env/end/"))
        assert ends == PROMPTS * GROUP and r["env/ungraded"] == 0 and r["weight_lag_max"] <= 1
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())["summary"]
    assert summary["resume/steps_redone"] >= 1 and summary["steps"] == STEPS
