"""TRL's side of ``bench/vs_trl.py``: GRPO steps of TRL's ``GRPOTrainer`` on a local checkpoint, timed per step.

Runs in a venv of its own (``make trl-venv``: torch, ``trl``, and the transformers / accelerate / datasets versions
the project's venv holds), never imports fp8rl, and is started by ``bench/vs_trl.py``, which writes the prompts
file and reads the one JSON line this prints last::

    .venv-trl/bin/python bench/trl_arm.py --model DIR --prompts FILE --steps 6 --group-size 8 --max-tokens 8

The job is TRL's plain CPU GRPO: FP32 (``use_cpu=True``, no bf16), ``beta=0`` (no reference model), sampling at
temperature 1 and top-p 1 by ``transformers``' ``generate``, ``prompts-per-step × group-size`` completions per step
in micro-batches of ``--micro-batch-size`` with gradient accumulation so that every step is one optimizer update
(TRL then skips the old-logprob pass: its ratio is 1 by construction). A step's time is the wall clock between two
optimizer updates' ends (the first from the start of training), so it holds generation, rewards, the forward /
backward passes and the update.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


class _StepClock(TrainerCallback):
    """The wall-clock seconds of every optimizer step (from the previous step's end, or the start of training)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self._last)
        self._last = now


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None


def _reward(completions, answer, **_kwargs) -> list[float]:
    """1 where the completion's last number is the answer (the score does not change the timing: no KL, one
    update per step, and GRPO's advantages are computed for every row whatever their values)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(_last_number(t) == str(a)) for t, a in zip(texts, answer, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory (FP32 safetensors)")
    ap.add_argument("--prompts", required=True, help="JSON lines of {messages, answer}, prompts-per-step × steps")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--out", default="/tmp/fp8rl-bench-trl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                    help="TRL's default is on; off is faster on these shapes (nothing recomputed) and fits in memory")
    args = ap.parse_args(argv)

    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    completions = args.prompts_per_step * args.group_size
    if completions % args.micro_batch_size:
        ap.error(f"--micro-batch-size {args.micro_batch_size} must divide the step's {completions} completions")
    cfg = GRPOConfig(
        output_dir=args.out, use_cpu=True, bf16=False, fp16=False, beta=0.0, seed=args.seed,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=completions // args.micro_batch_size,
        num_generations=args.group_size, max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0,
        max_steps=args.steps, learning_rate=1e-6, logging_steps=1, save_strategy="no", report_to="none",
        shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    tok = AutoTokenizer.from_pretrained(args.model)
    texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
    lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]  # what TRL's prompts tokenize to
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    clock = _StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[clock])
    t0 = time.perf_counter()
    trainer.train()
    print(json.dumps({"arm": "trl", "step_seconds": clock.seconds, "wall": time.perf_counter() - t0,
                      "prompt_tokens_mean": sum(lens[:args.prompts_per_step]) / args.prompts_per_step,
                      "threads": torch.get_num_threads(), "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
