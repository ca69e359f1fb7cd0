"""What activation checkpointing costs a training step: the 630M Qwen2 shape's train step with it off and on,
alternated in one process (off, on, on, off: drift cancels), as a ratio.

    python bench/recompute.py [--recipe fp8_e2e] [--rows 16] [--tokens 150] [--micro-batch-size 8]

The model is bench/memory.py's random-init checkpoint; the batch is random tokens, the last third of each row
trained on; each timed step is the training pass only (its logprobs given), after one warm-up step that allocates
AdamW's state. Prints per step and::

    ratio train_step_seconds checkpointing on/off X      target <= 1.05 (issue 30)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="fp8_e2e")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from memory import qwen2_600m_dir

    from fp8rl import memory
    from fp8rl.engines import TorchTrainer, TrainBatch, TrainerConfig
    from fp8rl.fp8 import recipe_for_role
    from fp8rl.presets import load_policy

    memory.tune_allocator()
    policy, _, _ = load_policy(str(qwen2_600m_dir()))
    trainer = TorchTrainer(policy, recipe_for_role(args.recipe, "trainer", batch_invariant=True),
                           TrainerConfig(lr=1e-5, micro_batch_size=args.micro_batch_size))
    del policy
    B, T = args.rows, args.tokens
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, trainer.model.config.vocab_size, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    trained = torch.zeros(B, T)
    trained[:, 2 * T // 3:] = 1
    adv, gen = torch.randn(B, dtype=torch.float64, generator=g), torch.full((B, T), -2.0)
    trainer.train_step(TrainBatch(ids, attn, trained, adv, gen))  # warm-up: AdamW's state allocated
    times: dict[bool, list[float]] = {False: [], True: []}
    for on in (False, True, True, False):
        trainer.recomputes = lambda rows, seq, on=on: on  # this step's choice for every micro-batch
        batch = TrainBatch(ids, attn, trained, adv, gen)
        batch.prev_logprobs = gen.clone()  # the training pass only
        t0 = time.perf_counter()
        m = trainer.train_step(batch)
        times[on].append(time.perf_counter() - t0)
        print(f"checkpointing {'on ' if on else 'off'}: {times[on][-1]:.1f} s (recomputed {m['recomputed']:.2f})",
              flush=True)
    off, on_ = (sum(times[k]) / len(times[k]) for k in (False, True))
    print(f"ratio train_step_seconds checkpointing on/off {on_ / off:.3f} (means {on_:.1f} / {off:.1f} s; pairs "
          + ", ".join(f"{a / b:.3f}" for a, b in zip(times[True], times[False], strict=True)) + ")")


if __name__ == "__main__":
    main()
