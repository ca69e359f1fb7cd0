"""Reward models beside the rule grader (issue 52): throughput, agreement of an FP8 judge with the same judge in bf16,
and the reward phase's share of a GRPO step — in one run.

    python bench/reward_models.py [--judge smollm2-135m-instruct|tiny-arith|DIR] [--items 32] [--max-new-tokens 64]
                                  [--repeats 3]

- **Throughput** (items/s, median of ``--repeats`` after a warm-up): the rule grader (``math_verify`` in process),
  a classifier (a random-init transformers ``LlamaForSequenceClassification`` of the judge's shape: its cost is the
  shape's, not the weights'), and the judge (default template, ``parse: boxed``, greedy), each in bf16 and FP8
  linears. Prints ``ratio items_per_s judge_fp8/judge_bf16 X`` and ``ratio items_per_s classifier_fp8/rule X``.
- **Agreement**: the share of items whose parsed score is the same in the FP8 and the bf16 judge (unparsable
  counts as its own value), over ``--items`` items of the packaged word problems (right and wrong answers).
- **The reward phase's share of a step**: a synchronous in-process loop on tiny-arith with a tiny-arith judge
  (``verdict_prob``) behind the rule, 3 steps: ``time/reward`` over the step's time. (Asynchronous GRPO runs the
  reward phase in the rollout thread, beside the train phase: its share of the step's critical path is the rollout
  thread's, not measured here.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import needs  # bench/needs.py: an optional model missing is one line, before any measurement
import torch


def _items(n: int):
    from fp8rl.data import load_jsonl
    from fp8rl.rewards.items import item_of

    problems = load_jsonl(files("fp8rl.data") / "sets" / "math_word_problems.jsonl")
    out = []
    for k in range(n):  # every other response wrong by one
        p = problems[k % len(problems)]
        answer = p.answer if k % 2 == 0 else str(int(p.answer) + 1)
        out.append(item_of(p, f"Adding it up, the answer is \\boxed{{{answer}}}."))
    return out


def _time(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _classifier_dir(judge_path: Path, tmp: Path) -> Path:
    """A random-init Llama classifier of the judge's shape, with the judge's tokenizer."""
    import shutil

    import transformers

    cfg = json.loads((judge_path / "config.json").read_text())
    keep = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                "rms_norm_eps", "rope_theta", "pad_token_id", "bos_token_id", "eos_token_id")
            if k in cfg}
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**keep, num_labels=2))
    model.config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    model.save_pretrained(tmp)
    for f in judge_path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "fp8rl_tokenizer")):
            shutil.copy(f, tmp / f.name)
    return tmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", default="smollm2-135m-instruct")
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    judge_path = needs.model(args.judge)

    from fp8rl.config import parse_job_config
    from fp8rl.data import get_grader
    from fp8rl.rewards.model import RewardModel

    items = _items(args.items)
    print(f"# reward models: judge {args.judge}, {len(items)} items, max_new_tokens {args.max_new_tokens}, "
          f"median of {args.repeats} after a warm-up")
    grader = get_grader("math_verify")
    rule_s, _ = _time(lambda: [grader(i.response, i.answer) for i in items], args.repeats)
    rows = {"rule (math_verify)": len(items) / rule_s}
    parsed = {}

    def measure(model: dict) -> tuple[float, list]:
        """Seconds per batch (median) and the scores of ``reward.model`` settings ``model`` on the items."""
        rm = RewardModel(parse_job_config({"reward": {"model": {**model, "max_batch": len(items)}}}).reward.model)
        try:
            return _time(lambda: rm.compute(items), args.repeats)
        finally:
            rm.close()

    for precision in ("bf16", "fp8"):
        s, got = measure({"kind": "judge", "model": args.judge, "precision": precision,
                          "max_new_tokens": args.max_new_tokens})
        rows[f"judge {precision}"] = len(items) / s
        parsed[precision] = [g.score for g in got]
        tokens = sum(g.tokens for g in got)
        unscored = [g.error for g in got if g.score is None]
        first = f" (the first: {unscored[0][:80]})" if unscored else ""
        print(f"judge {precision}: {s:.2f} s per batch, {tokens} tokens written, {len(unscored)}/{len(items)} "
              f"unscored{first}, mean score "
              f"{statistics.fmean([x for x in parsed[precision] if x is not None] or [0]):.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        clf = _classifier_dir(Path(judge_path), Path(tmp))
        for precision in ("bf16", "fp8"):
            s, _ = measure({"kind": "classifier", "model": str(clf), "precision": precision})
            rows[f"classifier {precision}"] = len(items) / s
    print("\n| scorer | items/s |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")
    same = sum(a == b for a, b in zip(parsed["bf16"], parsed["fp8"], strict=True)) / len(items)
    print(f"\nagreement fp8_vs_bf16_judge {same:.3f} (share of {len(items)} items with the same parsed score)")
    print(f"ratio items_per_s judge_fp8/judge_bf16 {rows['judge fp8'] / rows['judge bf16']:.3f}")
    print(f"ratio items_per_s classifier_fp8/rule {rows['classifier fp8'] / rows['rule (math_verify)']:.3f}")
    print(f"ratio items_per_s judge_fp8/rule {rows['judge fp8'] / rows['rule (math_verify)']:.4f}")

    from fp8rl.loop import GRPOLoop, LoopConfig

    job = parse_job_config({"job": {"steps": 3}, "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8},
                            "reward": {"model": {"kind": "judge", "model": "tiny-arith", "parse": "verdict_prob",
                                                 "template": "{question}{response}=", "verdicts": {"1": 1.0, "0": 0.0}},
                                       "combine": {"gate": True, "rule_weight": 1.0, "model_weight": 1.0}}})
    loop = GRPOLoop(LoopConfig(job))
    shares = []
    for step in range(3):
        t = time.perf_counter()
        m = loop.step(step)
        shares.append(m["time/reward"] / (time.perf_counter() - t))
    print(f"ratio step_seconds reward_phase/step {statistics.median(shares):.3f} (tiny-arith loop, 8 x 8 samples, "
          f"tiny-arith verdict_prob judge behind the rule gate; median of 3 steps)")


if __name__ == "__main__":
    main()
