"""Step time of the service stack vs the in-process loop on the same job, and what calibration subsampling costs.

    python bench/overhead.py [--job deploy/default-job.yaml --steps 6 --stack-timeout 300]

The job (default: the shipped tiny-arith job, recipe ``fp8_e2e`` + FP8 KV cache) is cut to
``--steps`` steps with ``job.checkpoint_every: 0`` (the loop has no checkpoints) and run twice:

* in-process: ``fp8rl.loop.run`` on the same :class:`~fp8rl.config.JobConfig` (the loop reads the job
  file itself, so no key can be left out);
* the stack: ``python -m deploy.launcher run --job <tmp job> --run-dir <tmp> --plain`` (Redis,
  trainer, calibrator, reward, one rollout replica, controller as processes), per-step times
  read back from its ``report/metrics.jsonl``.

The first step of each is a warm-up and left out. Prints mean step seconds of each, the ratio
stack / in-process (target ≤ 1.10×), the per-phase means side by side, and the calibration
share of step time in both (target ≤ 1 %) with where it runs (``calibration.site``). The stack's step time is the
controller's wall clock (phases + RPC and bookkeeping between them); the loop's is the sum of its phases.

Last, what ``calibration.max_sequences`` costs in scale accuracy: on the sequences of one step
(step 0's prompts + responses under the initial weights), Q/K/V scales from all sequences vs the
evenly spaced subsample, with :class:`fp8rl.engines.QKVCalibrator` — the largest relative
difference over layers for each of q, k, v, and both calibration times.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import needs  # bench/needs.py: an optional model or server missing is one line, before any measurement
import torch
import yaml

from fp8rl.config import JobConfig, load_job_config
from fp8rl.controller.plan import sampling_seed
from fp8rl.engines import QKVCalibrator, SamplingParams
from fp8rl.loop import PHASES as LOOP_PHASES
from fp8rl.loop import GRPOLoop, LoopConfig, run
from fp8rl.report import PHASES as STACK_PHASES

REPO = Path(__file__).resolve().parents[1]


def loop_config(job: JobConfig) -> LoopConfig:
    """The :class:`LoopConfig` that runs the same steps as ``job`` on the stack: the job itself (the loop reads
    the same :class:`JobConfig`), with evaluation during the run off (the stack's evaluations are outside its
    step times; the loop's start/end ones are too)."""
    return LoopConfig(job.with_settings({"job.eval_every": 0}))


def run_stack(job_file: Path, run_dir: Path, timeout: float) -> list[dict]:
    """Per-step flat rows of the launcher's report (``time/<phase>``, ``time/total``)."""
    cmd = [sys.executable, "-m", "deploy.launcher", "run", "--job", str(job_file), "--run-dir", str(run_dir),
           "--plain"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    metrics = run_dir / "report" / "metrics.jsonl"
    if p.returncode != 0 or not metrics.exists():
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-30:])
        raise SystemExit(f"`{' '.join(cmd)}` exited with {p.returncode}; the end of its output:\n{tail}")
    return sorted((json.loads(line) for line in metrics.read_text().splitlines() if line.strip()),
                  key=lambda r: r["step"])


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return statistics.fmean(vals) if vals else math.nan


def scale_accuracy(job: JobConfig, cfg: LoopConfig) -> dict:
    """Scales of one step's sequences, all of them vs the job's subsample."""
    loop = GRPOLoop(cfg)
    prompts = loop.plan.prompts(loop.plan.batch(0))
    g = job.policy.generation
    params = SamplingParams(temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_new_tokens,
                            n=job.grpo.num_generations_per_prompt, seed=sampling_seed(job.job.seed, 0, 0))
    samples = loop.rollout.generate(prompts, params, weight_version=loop.trainer.version)
    seqs = [list(s.prompt_ids) + list(s.token_ids) for s in samples]
    kw = dict(pad_token_id=loop.tok.pad_id, margin=job.calibration.margin,
              percentile=job.calibration.percentile)
    out: dict = {"sequences": len(seqs), "max_sequences": job.calibration.max_sequences}
    got = {}
    for name, limit in (("all", None), ("subsample", job.calibration.max_sequences)):
        cal = QKVCalibrator(loop.trainer.model, max_sequences=limit, **kw)
        cal.calibrate(loop.trainer.version, seqs)  # warm-up
        got[name] = cal.calibrate(loop.trainer.version, seqs)
        out[f"seconds_{name}"] = cal.last_seconds
    for t in ("q", "k", "v"):
        full, sub = torch.tensor(getattr(got["all"], t)), torch.tensor(getattr(got["subsample"], t))
        rel = (sub - full) / full  # (num_layers,)
        out[t] = {"max_abs_rel": float(rel.abs().max()), "worst_layer": int(rel.abs().argmax()),
                  "below": int((rel < 0).sum()), "layers": rel.numel()}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(REPO / "deploy" / "default-job.yaml"))
    ap.add_argument("--steps", type=int, default=6, help="steps per run; the first is a warm-up")
    ap.add_argument("--stack-timeout", type=float, default=300.0, help="seconds the launcher may take")
    args = ap.parse_args(argv)
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is a warm-up)")
    needs.redis_server()  # the stack's; one line naming how to get one, before either run
    needs.model(load_job_config(args.job).policy.model)
    raw = yaml.safe_load(Path(args.job).read_text())
    raw.setdefault("job", {}).update(steps=args.steps, checkpoint_every=0, eval_every=0)
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="fp8rl-overhead-") as tmp:
        job_file = Path(tmp) / "job.yaml"
        job_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        job = load_job_config(job_file)
        cfg = loop_config(job)
        from fp8rl.presets import PRESETS, prepare_tiny_arith

        if job.policy.model in PRESETS:
            prepare_tiny_arith()  # cached after the first call; neither timing includes it
        t = time.perf_counter()
        inproc = run(cfg, progress=False)["steps"][1:]
        res["inproc_wall"] = time.perf_counter() - t
        t = time.perf_counter()
        stack = run_stack(job_file, Path(tmp) / "run", args.stack_timeout)[1:]
        res["stack_wall"] = time.perf_counter() - t
        res["scales"] = scale_accuracy(job, cfg)

    ip = {p: _mean(inproc, f"time/{p}") for p in LOOP_PHASES} | {"total": _mean(inproc, "time/step")}
    st = {p: _mean(stack, f"time/{p}") for p in STACK_PHASES} | {"total": _mean(stack, "time/total")}
    res.update(inproc=ip, stack=st, ratio=st["total"] / ip["total"])
    shape = f"{job.grpo.num_prompts_per_step}x{job.grpo.num_generations_per_prompt} samples/step"
    print(f"service stack vs in-process loop: {job.job.name}, recipe {job.recipe}, kv {job.kv_cache_dtype}, "
          f"{shape}, {job.policy.training.num_minibatches} minibatches, "
          f"{args.steps} steps (first left out), torch threads={torch.get_num_threads()}")
    print(f"  {'phase':10s} {'in-process':>11s} {'stack':>9s}   (mean seconds per step)")
    for p in (*STACK_PHASES, "total"):
        a = f"{ip[p]:11.3f}" if p in ip else f"{'-':>11s}"
        print(f"  {p:10s} {a} {st[p]:9.3f}")
    print(f"  {'(between)':10s} {'':11s} {st['total'] - sum(st[p] for p in STACK_PHASES):9.3f}"
          "   stack wall clock not in any phase (RPCs, controller)")
    for name, rows, key in (("in-process", inproc, "time/step"), ("stack", stack, "time/total")):
        print(f"  {name:10s} per step: {' '.join(f'{r[key]:.2f}' for r in rows)} s; mean response "
              f"{_mean(rows, 'response_len'):.2f} tokens, reward {_mean(rows, 'reward_mean'):.3f}")
    print(f"  stack / in-process step time: {res['ratio']:.2f}x (target <= 1.10x); whole runs took "
          f"{res['inproc_wall']:.0f} s in-process, {res['stack_wall']:.0f} s stack (start + steps + stop)")
    print(f"  calibrate share of step time: in-process {100 * ip['calibrate'] / ip['total']:.2f}%, "
          f"stack {100 * st['calibrate'] / st['total']:.2f}% (target <= 1%); where: {job.calibration_site[1]} "
          "(site logprobs: the amax hooks run inside the logprobs phase, counted there)")
    s = res["scales"]
    print(f"scale accuracy of calibration.max_sequences={s['max_sequences']} on one step's {s['sequences']} "
          f"sequences (subsample vs all, relative difference of the per-layer scales):")
    for t in ("q", "k", "v"):
        d = s[t]
        print(f"  {t}_scale: max |rel diff| {100 * d['max_abs_rel']:6.2f}% (layer {d['worst_layer']}); "
              f"subsample lower in {d['below']}/{d['layers']} layers")
    print(f"  calibration time: all {s['seconds_all']:.3f} s, subsample {s['seconds_subsample']:.3f} s "
          f"= {s['seconds_subsample'] / s['seconds_all']:.2f}x")
    return res


if __name__ == "__main__":
    main()
