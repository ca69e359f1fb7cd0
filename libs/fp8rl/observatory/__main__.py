"""``python -m fp8rl.observatory``: attribute one batch's rollout-vs-trainer mismatch, print the tables.

    python -m fp8rl.observatory --model tiny-arith|smollm2-135m-instruct|PATH --recipe fp8_e2e \\
        --kv-cache-dtype fp8 --prompts 4 --max-tokens 16 --out DIR

Prompts: a model whose tokenizer has a chat template answers the grade-school word problems shipped in
``fp8rl.data`` (rendered with the template); any other answers generated arithmetic problems (BOS + text,
as the in-process loop's default job does).
"""

from __future__ import annotations

import argparse
import signal
import sys
from importlib.resources import files

import torch

from fp8rl.data import ArithDataset
from fp8rl.data.jsonl import load_jsonl
from fp8rl.fp8 import DEFAULT_SCALING, RECIPES, SCALINGS
from fp8rl.model.tokenizer import chat_template_of, render_chat_prompt, stop_token_ids
from fp8rl.presets import load_policy

from . import ObservatoryConfig, observe


def prompts_for(tok, count: int, seed: int) -> list[list[int]]:
    """``count`` prompt token ids for ``tok``'s model (see the module docstring)."""
    if chat_template_of(tok) is not None:
        problems = load_jsonl(files("fp8rl.data") / "sets" / "math_word_problems.jsonl")
        return [tok.encode(render_chat_prompt(tok, problems[i % len(problems)].prompt, None), add_bos=False)
                for i in range(count)]
    return [tok.encode(p.prompt) for p in ArithDataset(seed=seed).batch(0, count)]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fp8rl.observatory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-arith", help="preset name or local HF checkpoint directory")
    ap.add_argument("--recipe", choices=RECIPES, default="fp8_e2e")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="fp8")
    ap.add_argument("--fp8-recipe", choices=SCALINGS, default=DEFAULT_SCALING,
                    help="FP8 linears' scaling in both engines (the job key policy.training.megatron_cfg.fp8_cfg."
                         "fp8_recipe)")
    ap.add_argument("--no-fp8-attention", action="store_true", help="FP8 KV cache without E4M3 Q and probabilities")
    ap.add_argument("--num-first-layers-in-bf16", type=int, default=0)
    ap.add_argument("--num-last-layers-in-bf16", type=int, default=0)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--prompts", type=int, default=4, help="number of prompts")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=1.03, help="token_mult_prob_error the suggestion must reach")
    ap.add_argument("--max-bf16-layers", type=int, default=4, help="the suggestion's budget: most first + last")
    ap.add_argument("--no-layer-logprobs", action="store_true", help="skip the one-forward-per-layer pass")
    ap.add_argument("--no-search", action="store_true", help="skip the bf16-layer suggestion")
    ap.add_argument("--out", default=None, help="write observatory.md / .json / .png here — each table as soon as it "
                    "is measured, so a stopped run keeps them")
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="stop after this long and write the tables measured so far (SIGINT/SIGTERM do the same)")
    return ap


class _Stopped(BaseException):
    """Raised by the signal handler wherever the main thread is: a BaseException (like KeyboardInterrupt), so no
    library's ``except Exception`` (matplotlib's, torch's) can swallow the stop and let the run go on."""

    def __init__(self, why: str, code: int) -> None:
        super().__init__(why)
        self.code = code


_pending: list[_Stopped] = []  # the stop asked for, until main() has acted on it


def _stop(signum, _frame) -> None:
    stop = (_Stopped("its --time-limit", 124) if signum == signal.SIGALRM
            else _Stopped(signal.Signals(signum).name, 128 + signum))
    _pending.append(stop)
    raise stop


def _check_stop() -> None:
    """Raise the stop again at a safe point (each progress line, each partial result): the handler raises wherever
    the main thread is, and C code that clears the error it was handed loses it. Seen: a SIGTERM raised in
    ``copyreg._slotnames`` under ``object.__reduce_ex__`` (the rollout engine's ``deepcopy`` of the model) vanished
    without a trace, and the run finished its search (a CI failure of 2026-12-06; 1 run in ~15 here)."""
    if _pending:
        raise _pending[0]


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        cfg = ObservatoryConfig(
            recipe=args.recipe, kv_cache_dtype=args.kv_cache_dtype, fp8_recipe=args.fp8_recipe,
            fp8_attention=not args.no_fp8_attention,
            num_first_layers_in_bf16=args.num_first_layers_in_bf16,
            num_last_layers_in_bf16=args.num_last_layers_in_bf16,
            batch_invariant=args.batch_invariant, n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
            seed=args.seed, target=args.target, max_bf16_layers=args.max_bf16_layers,
            layer_logprobs=not args.no_layer_logprobs)
    except ValueError as exc:
        ap.error(str(exc))
    if args.prompts < 1:
        ap.error(f"--prompts must be >= 1, got {args.prompts}")
    torch.manual_seed(args.seed)
    model, tok, path = load_policy(args.model)
    prompts = prompts_for(tok, args.prompts, args.seed)
    print(f"model {args.model} ({path}): {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{model.num_layers} layers; {len(prompts)} prompts x {args.n}, <= {args.max_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    if args.time_limit is not None and args.time_limit <= 0:
        ap.error(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    last: list = []  # the newest partial result

    def keep(partial) -> None:
        last[:] = [partial]
        if args.out:
            partial.write(args.out)
        if not partial.layers:  # the sources are measured: print them now
            print("\n" + partial.to_markdown().split("\n| layer |")[0], flush=True)
        _check_stop()

    def say(msg: str) -> None:
        print(msg, flush=True)
        _check_stop()

    old = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    if args.time_limit is not None:
        signal.setitimer(signal.ITIMER_REAL, args.time_limit)
    try:
        result = observe(model, prompts, cfg, pad_token_id=tok.pad_id, eos_token_ids=stop_token_ids(tok),
                         name=args.model, search=not args.no_search, progress=say,
                         on_partial=keep)
    except _Stopped as stop:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _pending.clear()
        if not last:
            print(f"python -m fp8rl.observatory: stopped by {stop} before the first table was measured",
                  file=sys.stderr)
            return stop.code
        partial = last[0]
        print()
        print(partial.write(args.out) if args.out else partial.to_markdown(), end="", flush=True)
        print(f"python -m fp8rl.observatory: stopped by {stop} during {partial.stopped_in}; the tables above are "
              f"what was measured" + (f" (written to {args.out})" if args.out else ""), file=sys.stderr)
        return stop.code
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, h in old.items():
            signal.signal(sig, h)
    print()
    print(result.write(args.out) if args.out else result.to_markdown(), end="")
    if _pending:  # a stop lost after the last progress line: the observation is whole, the exit status says so
        stop = _pending.pop()
        _pending.clear()
        print(f"python -m fp8rl.observatory: stopped by {stop} as the observation ended; the result above is whole",
              file=sys.stderr)
        return stop.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
