"""Step time of the service stack vs the in-process loop on the same job, and what calibration subsampling costs.

    python bench/overhead.py [--job deploy/default-job.yaml --steps 6 --stack-timeout 300]

The job (default: the shipped tiny-arith job, recipe ``fp8_e2e`` + FP8 KV cache) is cut to
``--steps`` steps with ``job.checkpoint_every: 0`` (the loop has no checkpoints) and run twice:

* in-process: ``fp8rl.loop.run`` with the equivalent :class:`LoopConfig` (every job key that
  shapes a step is mapped; keys the loop cannot express are checked against the loop's fixed
  values and any difference is printed);
* the stack: ``python -m deploy.launcher run --job <tmp job> --run-dir <tmp> --plain`` (Redis,
  trainer, calibrator, reward, one rollout replica, controller as processes), per-step times
  read back from its ``report/metrics.jsonl``.

The first step of each is a warm-up and left out. Prints mean step seconds of each, the ratio
stack / in-process (target ≤ 1.10×), the per-phase means side by side, and the calibration
share of step time in both (target ≤ 2 %). The stack's step time is the controller's wall clock
(phases + RPC and bookkeeping between them); the loop's is the sum of its phases.

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

import torch
import yaml

from fp8rl.config import JobConfig, load_job_config
from fp8rl.engines import QKVCalibrator, SamplingParams, TrainerConfig
from fp8rl.fp8 import recipe_for_role
from fp8rl.loop import PHASES as LOOP_PHASES
from fp8rl.loop import GRPOLoop, LoopConfig, run
from fp8rl.report import PHASES as STACK_PHASES
from fp8rl.rl import LossConfig

REPO = Path(__file__).resolve().parents[1]


def loop_config(job: JobConfig) -> LoopConfig:
    """The :class:`LoopConfig` that runs the same steps as ``job`` on the stack."""
    g = job.get
    return LoopConfig(
        model=g("policy.model"), recipe=job.recipe, kv_cache_dtype=job.kv_cache_dtype, steps=g("job.steps"),
        prompts_per_step=g("grpo.num_prompts_per_step"), group_size=g("grpo.num_generations_per_prompt"),
        max_tokens=g("policy.generation.max_new_tokens"), temperature=g("policy.generation.temperature"),
        top_p=g("policy.generation.top_p"), lr=g("policy.training.lr"),
        micro_batch_size=g("policy.training.micro_batch_size"), num_minibatches=g("policy.training.num_minibatches"),
        is_mode=g("loss.importance_sampling.mode"), kl_coef=g("loss.kl_coef"),
        num_first_layers_in_bf16=g("policy.generation.vllm_cfg.num_first_layers_in_bf16"),
        num_last_layers_in_bf16=g("policy.generation.vllm_cfg.num_last_layers_in_bf16"),
        calibration_max_sequences=g("calibration.max_sequences"),
        eval_every=0,  # the stack's evaluations are outside its step times; the loop's start/end ones are too
        eval_size=g("job.eval_size"), seed=g("job.seed"), arith=dict(g("data.arith")),
    )


def unmapped(job: JobConfig, cfg: LoopConfig) -> list[str]:
    """Job settings the loop cannot express that differ from the values the loop hard-codes."""
    g, out = job.get, []
    loop_trainer = TrainerConfig(lr=cfg.lr, micro_batch_size=cfg.micro_batch_size,
                                 num_minibatches=cfg.num_minibatches, temperature=cfg.temperature,
                                 loss=LossConfig(is_mode=cfg.is_mode, kl_coef=cfg.kl_coef))
    if job.trainer_config() != loop_trainer:
        out.append(f"trainer/loss settings: job {job.trainer_config()} vs loop {loop_trainer}")
    layers = dict(num_first_layers_in_bf16=cfg.num_first_layers_in_bf16,
                  num_last_layers_in_bf16=cfg.num_last_layers_in_bf16)
    for role, extra in (("rollout", {"kv_cache_dtype": cfg.kv_cache_dtype}), ("trainer", {})):
        if job.fp8_recipe(role) != recipe_for_role(cfg.recipe, role, **extra, **layers):
            out.append(f"{role} FP8 recipe (vllm_cfg fp8_attention / pow2 scaling)")
    defaults = QKVCalibrator.__init__.__kwdefaults__
    for key in ("margin", "percentile"):
        if g(f"calibration.{key}") != defaults[key]:
            out.append(f"calibration.{key}={g(f'calibration.{key}')} (loop uses {defaults[key]})")
    if not g("grpo.leave_one_out"):
        out.append("grpo.leave_one_out=false (loop uses true)")
    if g("data.task") != "arith":
        out.append(f"data.task={g('data.task')} (loop runs arith)")
    return out


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
    problems = loop.data.batch(0, cfg.prompts_per_step)
    prompts = [loop.tok.encode(p.prompt) for p in problems]
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                            n=cfg.group_size, seed=cfg.seed * 1_000_003)  # the loop's step-0 seed
    samples = loop.rollout.generate(prompts, params, weight_version=loop.trainer.version)
    seqs = [list(s.prompt_ids) + list(s.token_ids) for s in samples]
    kw = dict(pad_token_id=loop.tok.pad_id, margin=job.get("calibration.margin"),
              percentile=job.get("calibration.percentile"))
    out: dict = {"sequences": len(seqs), "max_sequences": cfg.calibration_max_sequences}
    got = {}
    for name, limit in (("all", None), ("subsample", cfg.calibration_max_sequences)):
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
    raw = yaml.safe_load(Path(args.job).read_text())
    raw.setdefault("job", {}).update(steps=args.steps, checkpoint_every=0, eval_every=0)
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="fp8rl-overhead-") as tmp:
        job_file = Path(tmp) / "job.yaml"
        job_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        job = load_job_config(job_file)
        cfg = loop_config(job)
        from fp8rl.presets import PRESETS, prepare_tiny_arith

        if cfg.model in PRESETS:
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
    res.update(inproc=ip, stack=st, ratio=st["total"] / ip["total"], mapping_gaps=unmapped(job, cfg))
    print(f"service stack vs in-process loop: {job.get('job.name')}, recipe {job.recipe}, kv {job.kv_cache_dtype}, "
          f"{cfg.prompts_per_step}x{cfg.group_size} samples/step, {cfg.num_minibatches} minibatches, "
          f"{args.steps} steps (first left out), torch threads={torch.get_num_threads()}")
    gaps = res["mapping_gaps"]
    print("  job -> LoopConfig: every key that shapes a step is mapped" if not gaps else
          "  job keys the loop does not follow: " + "; ".join(gaps))
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
          f"stack {100 * st['calibrate'] / st['total']:.2f}% (target <= 2%)")
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
