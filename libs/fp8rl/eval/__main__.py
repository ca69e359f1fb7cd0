"""``python -m fp8rl.eval MODEL --data FILE`` (also ``fp8rl eval ...``): greedy accuracy, pass@j and mean@k of a
preset, an HF directory or a trainer checkpoint on a data file.

The run is a job's validation: ``--config JOB.yaml`` gives the rollout recipe, sampling budget, grader, data keys
and ``eval`` section (default: the defaults), and each flag below sets one key of it. Exit codes: 0 scored; 2 bad
input (a missing model or data file, a bad row, a bad setting); 1 anything else; 130 interrupted. Progress goes to
stderr; the result to stdout as a table, and with ``--out FILE`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from fp8rl import limits
from fp8rl.config import ConfigError, JobConfig, load_job_config, recipe_settings
from fp8rl.data import DataRoot
from fp8rl.fp8 import RECIPES

__all__ = ["main"]

EXIT_OK, EXIT_OTHER, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

# flag -> the job key it sets (None: not given)
FLAGS = {"k": "eval.k", "temperature": "eval.temperature", "limit": "job.eval_size", "seed": "job.seed",
         "max_new_tokens": "policy.generation.max_new_tokens", "grader": "reward.grader",
         "prompt_key": "data.prompt_key", "answer_key": "data.answer_key", "chat_template": "data.chat_template",
         "system_prompt": "data.system_prompt", "max_prompt_tokens": "data.max_prompt_tokens",
         "kv_cache_dtype": "policy.generation.vllm_cfg.kv_cache_dtype"}


def build_parser(prog: str = "python -m fp8rl.eval") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Score a policy (a preset, an HF model directory or a trainer "
                                "checkpoint) on a data file: greedy accuracy, pass@j and mean@k, with a job's "
                                "rollout numerics.")
    p.add_argument("model", metavar="MODEL", help="preset name, HF model directory, or trainer checkpoint (.pt, .dcp)")
    p.add_argument("--data", required=True, metavar="FILE", help="JSONL, Parquet or an Arrow dataset directory")
    p.add_argument("--config", metavar="JOB.yaml", help="job file whose settings to use (flags override its keys)")
    p.add_argument("--base-model", default=None, metavar="PRESET_OR_HF_DIR",
                   help="a checkpoint's model when it does not record one")
    p.add_argument("--recipe", choices=RECIPES, help="rollout precision recipe (default: the job's, fp8_e2e)")
    p.add_argument("--k", type=int, help="samples per problem for pass@j / mean@k (eval.k; 0: greedy only)")
    p.add_argument("--temperature", type=float, help="their sampling temperature (eval.temperature)")
    p.add_argument("--limit", type=int, help=f"problems scored, the file's first (job.eval_size; default: the "
                   f"job file's, or without --config up to {limits.MAX_GENERATE_PROMPTS})")
    p.add_argument("--seed", type=int, help="sampling seed (job.seed)")
    p.add_argument("--max-new-tokens", type=int, help="policy.generation.max_new_tokens (the job default is 8, "
                   "tiny-arith's: give a real model's budget, or a --config that has it)")
    p.add_argument("--grader", help="reward.grader (exact_match, math_verify, or one --grader-module registers in "
                   "the reward service; both read \\boxed{} and GSM8K's '#### 72')")
    p.add_argument("--prompt-key", help="data.prompt_key: dotted path of the prompt in a row")
    p.add_argument("--answer-key", help="data.answer_key: dotted path of the reference answer")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="data.chat_template: render text prompts with the tokenizer's chat template")
    p.add_argument("--system-prompt", help="data.system_prompt")
    p.add_argument("--max-prompt-tokens", type=int, help="data.max_prompt_tokens: longer prompts are dropped")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), help="policy.generation.vllm_cfg.kv_cache_dtype")
    p.add_argument("--out", metavar="FILE.json", help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _job(args) -> JobConfig:
    job = load_job_config(args.config) if args.config else JobConfig()
    data = Path(args.data).absolute()
    if args.limit is None and not args.config:
        args.limit = limits.MAX_GENERATE_PROMPTS
    changes = {key: getattr(args, flag) for flag, key in FLAGS.items() if getattr(args, flag) is not None}
    # the file is the validation set (and, as a job needs one, the training file); read from its own directory
    name = data.resolve().name  # read from the directory it really is in (a link's target)
    changes.update({"data.task": "dataset" if job.data.task != "jsonl" else "jsonl", "data.path": name,
                    "data.validation_path": name})
    if args.recipe:
        changes.update(recipe_settings(args.recipe))
    return job.with_settings(changes)


def main(argv: Sequence[str] | None = None, prog: str = "python -m fp8rl.eval") -> int:
    """Run the command line; the exit code (module docstring)."""
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return int(e.code or 0)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    name = prog.split()[-1]
    try:
        from fp8rl.export import load_checkpoint_policy
        from fp8rl.export.readers import ExportError
        from fp8rl.presets import PRESETS, load_policy

        from .run import evaluate_policy

        job = _job(args)
        if args.model in PRESETS:
            policy, tok, model_dir = load_policy(args.model)
        else:
            policy, tok, model_dir = load_checkpoint_policy(args.model, model=args.base_model)
        job = job.with_settings({"policy.model": str(model_dir)})
        # the file's own directory is the data root (resolved: a link into a cache stays inside it)
        report = evaluate_policy(policy, tok, job, DataRoot(Path(args.data).resolve().parent),
                                 progress=not args.no_progress)
    except (ConfigError, ExportError, ValueError, FileNotFoundError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    out = {"model": args.model, "data": args.data, "recipe": job.recipe, **report.as_dict()}
    width = max(len(k) for k in out)
    print("\n".join(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                    for k, v in out.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
