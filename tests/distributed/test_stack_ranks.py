"""A 2-rank trainer in the real service stack: ``deploy.launcher up`` with ``policy.training.dp_size: 2`` starts the
trainer under torchrun (rank 0 serves, rank 1 follows); a 3-step job runs through the SDK, and rank 1 is SIGKILLed
after the first step is recorded. torchrun's agent must restart the group, the trainer resume from its newest
checkpoint (``--resume auto``) and republish it under a new version, and the controller finish the job with
every step recorded exactly once.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import yaml

from fp8rl.sdk import Fp8rlClient
from tests.integration.controller.conftest import Stack, launcher, tiny_job, tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

STEPS = 3
WATCH_S = 240.0


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of worker ``rank`` among torchrun's children (read from each child's environment)."""
    children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    for pid in map(int, children):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} among torchrun's children {children}")


@pytest.fixture
def two_rank_stack(tmp_path) -> Stack:
    model = tiny_model(tmp_path / "model")
    job = tiny_job(model, steps=STEPS, checkpoint_every=1, max_new_tokens=16)
    job["policy"]["training"]["dp_size"] = 2
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run = tmp_path / "run"
    up = launcher("up", "--job", str(job_file), "--run-dir", str(run), "--ready-timeout", "200")
    if up.returncode != 0:
        pytest.fail(f"launcher up failed ({up.returncode}):\n{up.stderr[-4000:]}", pytrace=False)
    st = Stack(run, job_file, model)
    try:
        yield st
    finally:
        launcher("down", "--run-dir", str(run), "--grace", "15", timeout=60)


def test_a_two_rank_trainer_runs_a_job_and_a_rank_killed_mid_job_costs_no_step(two_rank_stack):
    st = two_rank_stack
    trainer = st.process("trainer")
    assert "torch.distributed.run" in trainer["cmd"] and "--resume" in trainer["cmd"]
    first = _rank_pid(trainer["pid"], 1)
    with Fp8rlClient(st.target, token=st.client_token, tls_ca="", timeout_s=30) as c:
        job_id = c.submit_job(st.job_file.read_text(), job_id="two-ranks")
    jobs, deadline = st.jobs(), time.monotonic() + WATCH_S
    while jobs.get(job_id).steps_done < 1:
        assert time.monotonic() < deadline, "the first step was never recorded"
        time.sleep(0.02)
    os.kill(first, signal.SIGKILL)  # a follower: rank 0 sees its collectives fail, torchrun restarts both
    with Fp8rlClient(st.target, token=st.client_token, tls_ca="", timeout_s=30) as c:
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        final = c.get_job(job_id)
    assert final.state == "succeeded", final.error
    assert [r.step for r in reports] == list(range(STEPS))  # none lost, none doubled
    log = Path(trainer["log"]).read_text()
    # torchrun saw the group fail: it reports the first failure it observes, the killed rank 1 (exitcode -9) or
    # rank 0, which exits (exitcode 1) as soon as its collectives fail and says so...
    seen = set(re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", log))
    assert ("-9", "1") in seen or (("1", "0") in seen and "the trainer's rank group failed" in log), seen
    assert log.count("trainer rank 0 of 2") == 2  # ...and started the group again
    assert _rank_pid(trainer["pid"], 1) != first
    ckpts = sorted(p.name for p in (st.run_dir / "checkpoints").iterdir())
    assert ckpts and all(n.endswith(".dcp") for n in ckpts), ckpts  # sharded: both ranks wrote into each
    assert all((st.run_dir / "checkpoints" / n / "__1_0.distcp").exists() for n in ckpts)
