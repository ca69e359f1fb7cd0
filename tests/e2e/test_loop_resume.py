"""The in-process loop loses nothing when it dies (issue 36): rows written as steps end, checkpoints, --resume.

The loop runs as a real process (``python -m fp8rl.loop``) killed by a real signal. "Bitwise the run that was never
stopped" is checked on everything a step measures but time and memory (wall clock and RSS differ between any two
runs), and on the trained weights and AdamW state of the final checkpoint. tiny-arith (3.2M parameters) on its own
task; fp8_e2e with an FP8 KV cache, so the resumed rollout also needs its version's QKV scales from the checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fp8rl.loop import main
from fp8rl.presets import prepare_tiny_arith

JOB = ["--model", "tiny-arith", "--recipe", "fp8_e2e", "--kv-cache-dtype", "fp8", "--prompts-per-step", "4",
       "--group-size", "4", "--eval-size", "8", "--eval-every", "2", "--max-tokens", "8", "--seed", "3"]
STEPS, EVERY = 5, 2  # checkpoints after 2 and 4 steps (and at the end)
VOLATILE = ("time/", "memory/")  # measured per run: wall clock and resident memory


@pytest.fixture(scope="module")
def preset():
    return prepare_tiny_arith(progress=False)


def _start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fp8rl.loop", *extra, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _wait_rows(proc: subprocess.Popen, out: Path, n: int, timeout: float = 240.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (out / "metrics.jsonl").exists() and len(_rows(out)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the loop exited ({proc.returncode}) before {n} rows: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no {n} rows in {timeout} s")


def _steady(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE) and k != "calibrate_share"
            and not isinstance(v, dict)}


def _final_state(out: Path) -> dict:
    state = json.loads((out / "checkpoints" / f"loop-v{STEPS}.json").read_text())
    assert state["finished"] and state["next_step"] == STEPS
    return torch.load(out / "checkpoints" / state["checkpoint"], map_location="cpu", weights_only=True)


@pytest.mark.chaos  # a SIGKILLed loop process (~15 s): the chaos tier (make test-chaos)
def test_a_sigkilled_run_keeps_its_rows_and_resume_finishes_it_bitwise(preset, tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    args = [*JOB, "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
    proc = _start(run_dir, *args)
    _wait_rows(proc, run_dir, 3)  # steps 0-2 finished: the checkpoint after step 2 is whole, step 3 may be running
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed = _rows(run_dir)
    assert [r["step"] for r in killed] == list(range(len(killed))) and len(killed) >= 3
    assert (run_dir / "job.yaml").is_file()
    # a new run may not overwrite the unfinished one
    assert main([*args, "--out", str(run_dir)]) == 2
    # the run that was never stopped, then the resumed one
    assert main([*args, "--out", str(ref_dir)]) == 0
    assert main(["--resume", str(run_dir)]) == 0
    ref, resumed = _rows(ref_dir), _rows(run_dir)
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for a, b in zip(ref, resumed, strict=True):
        assert _steady(a) == _steady(b), f"step {a['step']} differs after the resume"
    a, b = _final_state(ref_dir), _final_state(run_dir)
    assert a["version"] == b["version"] == STEPS
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for pid, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optimizer"]["state"][pid][k]), (pid, k)
    summary = json.loads((run_dir / "summary.json").read_text())["summary"]
    assert summary["val_accuracy_end"] == json.loads((ref_dir / "summary.json").read_text())["summary"][
        "val_accuracy_end"]
    # a finished run cannot be resumed, and may be replaced by a new one (its summary gone until the new one writes)
    assert main(["--resume", str(run_dir)]) == 2
    assert main([*args[:-2], "--checkpoint-every", "0", "--steps", "1", "--out", str(run_dir)]) == 0
    assert len(_rows(run_dir)) == 1 and not (run_dir / "checkpoints").exists()
    assert json.loads((run_dir / "summary.json").read_text())["summary"]["steps"] == 1


def test_sigint_leaves_a_report_of_the_finished_steps_and_says_it_stopped(preset, tmp_path):
    out = tmp_path / "run"
    proc = _start(out, *JOB, "--steps", "50", "--checkpoint-every", "0")
    _wait_rows(proc, out, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "stopped by SIGINT" in err
    done = _rows(out)
    assert done and len(done) < 50
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["stopped"] and summary["steps_done"] == len(done)
    assert (out / "summary.md").is_file() and (out / "reward.png").is_file()
    assert any((out / "tensorboard").iterdir())


def test_resume_refuses_what_it_cannot_continue(preset, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--resume", str(tmp_path)])  # no job.yaml: not a run directory
    assert "not a loop run directory" in capsys.readouterr().err
    (tmp_path / "job.yaml").write_text("job: {steps: 2}\n")
    with pytest.raises(SystemExit):
        main(["--resume", str(tmp_path), "--steps", "3"])
    assert "--resume runs the job saved in its directory: drop --steps" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_resume_before_the_first_checkpoint_starts_over_from_step_0_with_the_runs_data_root(
        preset, tmp_path, monkeypatch, caplog, capsys):
    """Issue 47: a run killed before its first checkpoint kept only its job (and the rows of the steps it finished):
    ``--resume`` runs it from step 0, saying so, with its data read under the data root it started with (the job
    file's directory, recorded in run.json) wherever the resume is run from; the finished run is then refused."""
    from fp8rl.data import ArithDataset
    from fp8rl.rundir import RunDir

    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    jobs.mkdir()
    (jobs / "train.jsonl").write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n"
                                              for p in ArithDataset(seed=0).eval_set(8)))
    job = ("job: {steps: 1, eval_size: 2, seed: 3, checkpoint_every: 0}\n"
           "grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}\n"
           "policy: {generation: {max_new_tokens: 4}}\n"
           "data: {task: jsonl, path: train.jsonl}\n")
    # what `--config jobs/job.yaml --out run` leaves when SIGKILLed after step 0's row, before the run's end
    # (checkpoint_every 0: no checkpoint ever)
    RunDir(run_dir).start(job, data_root=jobs)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": -1.0}) + "\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # train.jsonl is not under the working directory
    with caplog.at_level("WARNING", logger="fp8rl.loop"):
        assert main(["--resume", str(run_dir)]) == 0
    assert "holds no checkpoint" in caplog.text and "starting the run over from step 0" in caplog.text
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0] and rows[0]["reward_mean"] != -1.0  # the dead run's row measured again
    assert json.loads((run_dir / "summary.json").read_text())["config"]["data_root"] == str(jobs)
    capsys.readouterr()
    assert main(["--resume", str(run_dir)]) == 2  # finished without a checkpoint: its summary.json says so
    assert f"the run in {run_dir} finished" in capsys.readouterr().err
