"""A user's own job, start to finish: their Parquet files, validation with pass@k before and after, the trained
policy exported (hf vs hf-fp8).

    python bench/user_job.py [--model tiny-arith|smollm2-135m-instruct] [--steps 30] [--k 4] [--out runs/user_job]

The data is written as verl writes GSM8K: a Parquet file per split whose rows hold the prompt as a list of chat
messages (``prompt``; tiny-arith, which has no chat template, as text in ``question``) and the reference under
``reward_model.ground_truth``. tiny-arith: 512 training and 64 validation problems of its own task (two operands
up to 20, the default job's); the real model: 256 training and 32 validation chat questions ``What is a + b?`` /
``a - b`` (operands up to 20; graded on the response's last number, 24 new tokens) — SmolLM2-135M answers the
bundled word problems almost never within a CPU budget of tokens, so they carry no reward to learn from. The job
is the preset's usual one (``deploy/default-job.yaml`` / ``deploy/smollm2-job.yaml``) with ``data.task: dataset``
on those files, ``eval.k`` samples per validation problem, and ``job.steps`` steps in the
in-process loop. Afterwards the trainer's checkpoint is saved and exported with ``fp8rl.export`` in both formats.

Prints the validation before → after (greedy accuracy, pass@1, pass@k, mean@k), the export times and sizes, and
one ``ratio`` line per format (seconds relative to hf, bytes relative to hf).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import needs  # bench/needs.py: an optional model missing is one line, before any measurement
import pyarrow as pa
import pyarrow.parquet as pq

from fp8rl.config import load_job_config
from fp8rl.data import ArithDataset, Problem
from fp8rl.export import export_checkpoint
from fp8rl.loop import GRPOLoop, LoopConfig, run

REPO = Path(__file__).resolve().parents[1]


def _rows(problems, chat: bool) -> list[dict]:
    if chat:
        return [{"prompt": [{"role": "user", "content": p.prompt}], "reward_model": {"ground_truth": p.answer},
                 "data_source": "fp8rl"} for p in problems]
    return [{"question": p.prompt, "reward_model": {"ground_truth": p.answer}} for p in problems]


def _sums(n: int, seed: int) -> list[Problem]:
    """``What is a + b?`` / ``a - b`` (operands 2..20, no negative results) as chat questions."""
    r, out = random.Random(seed), []
    for _ in range(n):
        a, b, op = r.randint(2, 20), r.randint(2, 20), r.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        out.append(Problem(f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)))
    return out


def _files(model: str, out: Path) -> tuple[Path, Path, bool]:
    chat = model != "tiny-arith"
    if chat:
        train, val = _sums(256, seed=7), _sums(32, seed=8)
    else:
        job = load_job_config(REPO / "deploy/default-job.yaml")
        train = ArithDataset(job.arith_config(), seed=7).eval_set(512)
        val = ArithDataset(job.arith_config(), seed=8).eval_set(64)
    paths = out / "train.parquet", out / "validation.parquet"
    for rows, path in zip((_rows(train, chat), _rows(val, chat)), paths, strict=True):
        pq.write_table(pa.Table.from_pylist(rows), path)
    return *paths, chat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-arith", choices=("tiny-arith", "smollm2-135m-instruct"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default="runs/user_job")
    args = ap.parse_args()
    needs.model(args.model, instead="or --model tiny-arith")
    out = Path(args.out).absolute() / args.model
    out.mkdir(parents=True, exist_ok=True)
    train, val, chat = _files(args.model, out)
    base = load_job_config(REPO / ("deploy/default-job.yaml" if not chat else "deploy/smollm2-job.yaml"))
    changes = {"job.steps": args.steps, "job.checkpoint_every": 0, "job.eval_every": 0, "eval.k": args.k,
               "data.task": "dataset", "data.path": str(train), "data.validation_path": str(val),
               "data.prompt_key": "prompt" if chat else "question", "data.answer_key": "reward_model.ground_truth"}
    if chat:  # the messages carry the prompt; the template renders them; the last number is the answer
        changes.update({"data.chat_template": False, "data.system_prompt": None, "job.eval_size": 32,
                        "reward.grader": "exact_match", "policy.generation.max_new_tokens": 24})
    else:
        changes["job.eval_size"] = 64
    cfg = LoopConfig(base.with_settings(changes), str(out / "report"))
    loop = GRPOLoop(cfg)
    t = time.perf_counter()
    res = run(cfg, loop=loop)
    wall = time.perf_counter() - t
    ck = out / "trainer.pt"
    loop.trainer.save_checkpoint(str(ck))
    exports = {}
    for fmt in ("hf", "hf-fp8"):
        r = export_checkpoint(ck, out / f"export-{fmt}", fmt=fmt, force=True, progress=False)
        exports[fmt] = (r.seconds, r.bytes_written)
    v0, v1 = res["validation"][0], res["validation"][args.steps]
    print(f"\n{args.model}: {args.steps} steps in {wall:.0f} s; validation ({cfg.job.job.eval_size} problems, "
          f"k={args.k}) before -> after")
    for key in v0:
        print(f"  {key:<14} {v0[key]:.3f} -> {v1[key]:.3f}")
    for fmt, (sec, size) in exports.items():
        print(f"  export {fmt:<7} {sec:6.2f} s  {size / 1e6:8.1f} MB")
    print(f"ratio export_seconds/hf-fp8_vs_hf {exports['hf-fp8'][0] / exports['hf'][0]:.3f}")
    print(f"ratio export_bytes/hf-fp8_vs_hf {exports['hf-fp8'][1] / exports['hf'][1]:.3f}")
    (out / "user_job.json").write_text(json.dumps({"validation_before": v0, "validation_after": v1,
                                                   "exports": exports, "wall_s": wall}, indent=2))


if __name__ == "__main__":
    main()
