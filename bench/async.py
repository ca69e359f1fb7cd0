"""Asynchronous vs synchronous GRPO on the service stack: samples/s, reward curves and weight lag, in one run.

Non-colocated roles emulated on one box: each mode gets a fresh stack (``python -m deploy.launcher up``,
so every mode starts from the same initial weights), every service computes on one torch thread, and
the trainer and the rollout replica are pinned to different cores (``taskset``, where it exists and
there are two cores). The job is ``--job`` (default: deploy/default-job.yaml) cut to ``--steps`` steps
with no checkpoints or evaluation, run synchronously and with ``grpo.async_grpo`` at k = 1 and 2.

Printed: per mode samples/s (steps x prompts x G over the time from submission to the last report),
the mean reward of the first and last thirds, mean and max lag; then ``ratio async_k1/sync samples_per_s
X`` lines. Run: ``python bench/async.py [--steps 10]`` (about 1 minute per mode on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))

import needs  # noqa: E402  (bench/needs.py: an optional model or server missing is one line)

from fp8rl.config import load_job_config  # noqa: E402
from fp8rl.sdk import Fp8rlClient  # noqa: E402


def _launcher(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.launcher", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _pin(info: dict) -> str:
    """Trainer on core 0, the rollout replica on core 1 (when taskset and two cores exist)."""
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        return "not pinned (no taskset or one core)"
    for p in info["processes"]:
        core = {"trainer": "0", "rollout-0": "1"}.get(p["name"])
        if core is not None:
            subprocess.run(["taskset", "-a", "-p", "-c", core, str(p["pid"])], capture_output=True, check=False)
    return "trainer on core 0, rollout-0 on core 1"


def run_mode(job: dict, lag: int | None, tmp: Path) -> dict:
    job = json.loads(json.dumps(job))
    if lag is not None:
        job["grpo"]["async_grpo"] = {"enabled": True, "max_weight_lag": lag}
    name = "sync" if lag is None else f"async_k{lag}"
    job_file, run_dir = tmp / f"{name}.yaml", tmp / f"run-{name}"
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    up = _launcher("up", "--job", str(job_file), "--run-dir", str(run_dir), "--ready-timeout", "240")
    if up.returncode != 0:
        raise SystemExit(f"launcher up failed:\n{up.stderr[-3000:]}")
    try:
        info = json.loads((run_dir / "stack.json").read_text())
        pinned = _pin(info)
        token = Path(info["secrets"]["client_token_file"]).read_text().strip()
        with Fp8rlClient(info["controller"], token=token, tls_ca="", timeout_s=30) as c:
            t0 = time.perf_counter()
            job_id = c.submit_job(job_file.read_text())
            reports = list(c.watch(job_id, timeout_s=1800))
            wall = time.perf_counter() - t0
            final = c.get_job(job_id)
        if final.state != "succeeded":
            raise SystemExit(f"{name}: job {final.state}: {final.error}")
    finally:
        _launcher("down", "--run-dir", str(run_dir), "--grace", "10", timeout=120)
    samples = len(reports) * job["grpo"]["num_prompts_per_step"] * job["grpo"]["num_generations_per_prompt"]
    rewards = [r.reward_mean for r in reports]
    third = max(1, len(rewards) // 3)
    lags = [r.metrics.get("weight_lag_max", 0.0) for r in reports]
    idle = [r.metrics["trainer_idle_fraction"] for r in reports if "trainer_idle_fraction" in r.metrics]
    return {"mode": name, "pinned": pinned, "wall_s": wall, "samples_per_s": samples / wall, "rewards": rewards,
            "reward_first": statistics.fmean(rewards[:third]), "reward_last": statistics.fmean(rewards[-third:]),
            "lag_mean": statistics.fmean(r.metrics.get("weight_lag_mean", 0.0) for r in reports),
            "lag_max": max(lags), "trainer_idle": statistics.fmean(idle) if idle else float("nan"),
            "calibrate_share": statistics.fmean(r.phase_times.calibrate / r.phase_times.total for r in reports),
            "step_s": statistics.fmean(r.phase_times.total for r in reports[1:] or reports),
            "trainer_busy_s": statistics.fmean(r.metrics.get("busy/trainer_s", r.phase_times.logprobs
                                                             + r.phase_times.train + r.phase_times.publish)
                                               for r in reports[1:] or reports),
            "rollout_s": statistics.fmean(r.phase_times.rollout + r.phase_times.reward for r in reports)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(REPO / "deploy" / "default-job.yaml"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lags", type=int, nargs="*", default=[1, 2])
    args = ap.parse_args(argv)
    needs.redis_server()  # the stack's; one line naming how to get one, before any stack starts
    needs.model(load_job_config(args.job).policy.model)
    job = yaml.safe_load(Path(args.job).read_text())
    job.setdefault("job", {}).update(steps=args.steps, checkpoint_every=0, eval_every=0)
    job["grpo"].pop("async_grpo", None)
    res = {}
    with tempfile.TemporaryDirectory(prefix="fp8rl-async-") as tmp:
        for lag in (None, *args.lags):
            r = run_mode(job, lag, Path(tmp))
            res[r["mode"]] = r
            print(f"{r['mode']:9s} {r['samples_per_s']:7.1f} samples/s  wall {r['wall_s']:6.1f} s  reward "
                  f"{r['reward_first']:.3f} -> {r['reward_last']:.3f}  lag mean {r['lag_mean']:.2f} max "
                  f"{r['lag_max']:.0f}  trainer idle {r['trainer_idle']:.1%}  calibrate share "
                  f"{r['calibrate_share']:.2%}  ({r['pinned']})", flush=True)
    print("reward per step:")
    for name, r in res.items():
        print(f"  {name:9s} " + " ".join(f"{x:.3f}" for x in r["rewards"]))
    sync = res["sync"]
    print(f"sync step {sync['step_s']:.2f} s = rollout+reward {sync['rollout_s']:.2f} s + trainer "
          f"{sync['trainer_busy_s']:.2f} s + the rest; overlap can at best hide the shorter of the two")
    for name, r in res.items():
        if name != "sync":
            print(f"ratio {name}/sync samples_per_s {r['samples_per_s'] / sync['samples_per_s']:.3f}")
            # Amdahl: async cannot beat one step's trainer time (the trainer is busy the whole step)
            bound = sync["step_s"] / r["trainer_busy_s"]
            print(f"ratio {name}/sync bound {bound:.3f}  (sync step / async trainer busy)")
    return res


if __name__ == "__main__":
    main()
