"""Multi-turn asynchronous GRPO in the loop (issue 50): samples/s of synchronous vs ``env.partial: finish`` vs
``env.partial: interrupt`` at ``max_weight_lag`` 1, measured in one run on the same model and job.

    python bench/partial.py [--steps 6] [--turns 4] [--repeats 2] [--env-delay 0.1]

The policy is a seeded random 2-layer Llama with the ChatML character tokenizer (:mod:`fp8rl.presets.chatml`) on
``guess_number`` whose steps wait ``--env-delay`` seconds (a slow tool; a random policy runs every trajectory to
``--turns``), fp8_e2e with an FP8 KV cache and batch
invariance; 2 prompts x 4 trajectories a step. Each mode runs ``--steps`` steps, ``--repeats`` times interleaved
(sync, finish, interrupt, sync, ...); printed: per mode the median samples/s (trajectories per second of the run's
steps), trajectories spanning two versions, and ``ratio samples_per_s <mode>/sync X``.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fp8rl.config import parse_job_config
from fp8rl.envs import register
from fp8rl.loop import GRPOLoop, LoopConfig
from fp8rl.model.config import ModelConfig
from fp8rl.model.hf_io import save_hf_checkpoint
from fp8rl.model.tokenizer import load_tokenizer
from fp8rl.model.transformer import CausalLM
from fp8rl.presets.chatml import build_chatml_tokenizer

PROMPTS, GROUP = 2, 4
MODES = {"sync": None, "finish": "finish", "interrupt": "interrupt"}
# guess_number whose steps wait delay_s: the env-stack tests' SlowGuess, registered under a name of its own here so
# that data.task env draws guess_number's generated tasks for it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "controller"))
SLOW_GUESS = "bench_slow_guess"
register(SLOW_GUESS)(importlib.import_module("stack_envs").SlowGuess)


def _model(path: Path) -> Path:
    build_chatml_tokenizer(path)
    tok = load_tokenizer(path)
    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      bos_token_id=None, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    save_hf_checkpoint(CausalLM(cfg), cfg, path)
    return path


def _job(model: Path, steps: int, turns: int, partial: str | None, delay: float) -> dict:
    grpo = {"num_prompts_per_step": PROMPTS, "num_generations_per_prompt": GROUP}
    if partial is not None:
        grpo["async_grpo"] = {"enabled": True, "max_weight_lag": 1}
    return {"job": {"steps": steps, "seed": 0, "checkpoint_every": 0},
            "policy": {"model": str(model),
                       "generation": {"vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "fp8"}},
                       "training": {"lr": 0.01, "micro_batch_size": 8, "megatron_cfg": {"fp8_cfg": {"enabled": True}}}},
            "grpo": grpo,
            "env": {"name": SLOW_GUESS, "kwargs": {"delay_s": delay}, "max_turns": turns,
                    "max_tokens_per_turn": 16,
                    "max_trajectory_tokens": 400, "partial": partial or "finish"},
            "data": {"task": "env"}}


def _run(model: Path, steps: int, turns: int, partial: str | None, delay: float) -> tuple[float, float]:
    """(trajectories per second over the steps, trajectories that span two versions)."""
    loop = GRPOLoop(LoopConfig(parse_job_config(_job(model, steps, turns, partial, delay))))
    rows: list[dict] = []
    t0 = time.perf_counter()
    if partial is None:
        for step in range(steps):
            rows.append(loop.step(step))
    else:
        loop.run_async(steps, rows.append)
    wall = time.perf_counter() - t0
    return steps * PROMPTS * GROUP / wall, sum(r.get("env/interrupted", 0.0) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--env-delay", type=float, default=0.0, help="seconds each environment step waits (a slow tool)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(Path(tmp) / "model")
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        spans: dict[str, float] = {m: 0.0 for m in MODES}
        for _ in range(args.repeats):
            for mode, partial in MODES.items():
                rate, spanned = _run(model, args.steps, args.turns, partial, args.env_delay)
                rates[mode].append(rate)
                spans[mode] += spanned
                print(f"{mode:9s} {rate:7.2f} trajectories/s, {spanned:.0f} spanning two versions", flush=True)
    for mode in MODES:
        xs = rates[mode]
        runs = ", ".join(f"{x:.2f}" for x in xs)
        print(f"{mode:9s} median {statistics.median(xs):7.2f} trajectories/s (runs {runs}); "
              f"trajectories spanning two versions {spans[mode]:.0f}")
    base = statistics.median(rates["sync"])
    for mode in ("finish", "interrupt"):
        print(f"ratio samples_per_s {mode}/sync {statistics.median(rates[mode]) / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
