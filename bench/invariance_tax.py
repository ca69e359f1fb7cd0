"""What batch-invariant numerics cost, phase by phase, on one loop: rounds alternate invariance on and off.

    python bench/invariance_tax.py [--rounds 12] [--recipe bf16|fp8_e2e] [--max-tokens 8]

``bench/vs_trl.py`` compares whole runs (a process per arm, or its arms' steps alternating with ``--interleave``); on
a VM whose speed drifts by tens of percent over minutes, a few-percent cost is lost in that drift. Here one
``GRPOLoop`` (SmolLM2-135M-Instruct, vs_trl's batch: 4 prompts × 8 samples, ``--max-tokens`` new tokens, micro-batch
8) takes two steps to warm up and to record a step's prompts and its train batch; then every round runs the same
rollout (those prompts) and the same train step (that batch, one optimizer update) once with batch invariance on
and once off (``CausalLM.set_batch_invariance`` on the loop's models; which goes first alternates), seconds apart.
Each round gives a ratio per phase; the bench prints their median and range over the rounds:

    ratio rollout_seconds invariant/plain X (range a .. b over N rounds)
    ratio train_seconds invariant/plain X (...)
    ratio step_seconds invariant/plain X (...)     the two phases' sum, round by round

The weights move with every train step (both settings train on the same batch in turn), so the rounds are steps of
one run, not repeats of one step; the numbers the two settings compute differ only in rounding.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import needs  # bench/needs.py: an optional model missing is one line, before any measurement
import vs_trl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--recipe", choices=("bf16", "fp8_e2e"), default="bf16")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    needs.model(vs_trl.MODEL)

    import fp8rl.loop as loop_module
    from fp8rl import memory
    from fp8rl.engines.batch import train_on_batch
    from fp8rl.model import CausalLM

    job = vs_trl.write_job(Path(tempfile.mkdtemp(prefix="fp8rl-invariance-tax-")), "chat", args.max_tokens, 2)
    memory.tune_allocator()
    kv = "auto" if args.recipe == "bf16" else "fp8"
    loop = vs_trl._loop(str(job), args.recipe, True, kv)

    seen: dict = {}
    generate = loop.rollout.generate

    def recording_generate(prompts, params, **kw):
        seen["generate"] = (prompts, params)
        return generate(prompts, params, **kw)

    def recording_train(trainer, batch, **kw):
        seen["train"] = (batch, kw)
        return train_on_batch(trainer, batch, **kw)

    loop.rollout.generate = recording_generate
    loop_module.train_on_batch = recording_train  # the loop calls it by this name
    for s in range(2):
        loop.step(s)
    loop.rollout.generate, loop_module.train_on_batch = generate, train_on_batch
    models = [o for o in gc.get_objects() if isinstance(o, CausalLM)]  # the trainer's, and the rollout's own
    inv = loop.trainer.model.batch_invariance
    prompts, params = seen["generate"]
    batch, kw = seen["train"]
    kw = {**kw, "max_weight_lag": 1 << 30}  # the recorded batch, trained again at later versions

    def one(setting) -> tuple[float, float]:
        for m in models:
            m.set_batch_invariance(setting)
        t = time.perf_counter()
        generate(prompts, params)
        t_roll = time.perf_counter() - t
        t = time.perf_counter()
        train_on_batch(loop.trainer, batch, **kw)
        return t_roll, time.perf_counter() - t

    print(f"invariance_tax: {vs_trl.MODEL}, {args.recipe}, {vs_trl.PROMPTS_PER_STEP} prompts x {vs_trl.GROUP} "
          f"samples x {args.max_tokens} tokens, {args.rounds} rounds of invariance on/off ({inv})", flush=True)
    ratios: dict[str, list[float]] = {"rollout": [], "train": [], "step": []}
    for r in range(args.rounds):
        got = {("on" if s is not None else "off"): one(s) for s in vs_trl.rotated([inv, None], r)}
        (ron, ton), (roff, toff) = got["on"], got["off"]
        ratios["rollout"].append(ron / roff)
        ratios["train"].append(ton / toff)
        ratios["step"].append((ron + ton) / (roff + toff))
        print(f"  round {r + 1}/{args.rounds}: on rollout {ron:.2f} s train {ton:.2f} s; off rollout {roff:.2f} s "
              f"train {toff:.2f} s", flush=True)
    for m in models:
        m.set_batch_invariance(inv)
    for phase, xs in ratios.items():
        print(f"ratio {phase}_seconds invariant/plain {statistics.median(xs):.3f} (range {min(xs):.3f} .. "
              f"{max(xs):.3f} over {len(xs)} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
