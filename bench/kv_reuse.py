"""KV reuse across turns (issue 48): prefill tokens and seconds per trajectory, sessions vs re-prefill, in one run.

    python bench/kv_reuse.py [--trajectories 4 --turns 2 8 32 --gen 16 --env 16 --recipe bf16 --kv auto]

Model: a random tiny-arith-shaped Llama (4 layers, 256 wide, FP32 on CPU) with ``max_position_embeddings`` 2048,
batch-invariant (the job default), in the rollout recipe ``--recipe`` (bf16 or fp8_e2e; ``--kv fp8`` for an FP8
KV cache). A synthetic conversation: a 32-token opening, then per turn ``--gen`` sampled tokens (EOS disabled, so
every turn generates them all) and ``--env`` environment tokens; turn ``k``'s prompt is the whole history. The
same conversations (same seeds) run on two engines: with a session key per trajectory (each turn prefills only
the last generated token and the environment's reply) and without (each turn re-prefills the history), turn by
turn on the same histories, their order alternating per turn (these machines are shared and noisy). Prints the
prefill tokens and seconds per trajectory of each, ``ratio prefill_tokens/reuse_vs_reprefill`` and
``ratio seconds/reuse_vs_reprefill`` per turn count, and whether the two runs' samples are bitwise equal (they
must be under batch invariance).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from fp8rl.engines import SamplingParams, TorchRolloutEngine
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM
from fp8rl.presets import tiny_arith_config

OPENING = 32


def _converse(engines: dict[str, TorchRolloutEngine], openings: list[list[int]], turns: int, gen: int, env: int
              ) -> tuple[dict[str, float], dict[str, int], bool]:
    """One conversation driven through both engines turn by turn (the same histories; their order alternates per
    turn, so drifts in machine load hit both alike): seconds and prefill tokens of each, and whether every turn's
    samples were bitwise equal."""
    histories = [list(p) for p in openings]
    g = torch.Generator().manual_seed(123)
    params = SamplingParams(temperature=1.0, max_tokens=gen)
    keys = [f"traj{i}" for i in range(len(histories))]
    seconds = dict.fromkeys(engines, 0.0)
    before = {m: e.session_stats()["prefill_tokens"] for m, e in engines.items()}
    equal = True
    for turn in range(turns):
        order = list(engines) if turn % 2 == 0 else list(engines)[::-1]
        got = {}
        for mode in order:
            t0 = time.perf_counter()
            got[mode] = engines[mode].generate(histories, dataclasses.replace(params, seed=turn),
                                               sessions=keys if mode == "reuse" else None)
            seconds[mode] += time.perf_counter() - t0
        a, b = ([(s.token_ids, s.logprobs) for s in got[m]] for m in engines)
        equal &= a == b
        replies = [torch.randint(4, 100, (env,), generator=g).tolist() for _ in histories]
        histories = [h + list(s.token_ids) + r for h, s, r in zip(histories, got["reprefill"], replies, strict=True)]
    for k in keys:
        engines["reuse"].drop_session(k)
    tokens = {m: e.session_stats()["prefill_tokens"] - before[m] for m, e in engines.items()}
    return seconds, tokens, equal


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=4, help="conversations decoded together")
    ap.add_argument("--turns", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--gen", type=int, default=16, help="sampled tokens per turn")
    ap.add_argument("--env", type=int, default=16, help="environment tokens per turn")
    ap.add_argument("--recipe", default="bf16", choices=["bf16", "fp8_e2e"])
    ap.add_argument("--kv", default="auto", choices=["auto", "fp8"])
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    cfg = dataclasses.replace(tiny_arith_config(), max_position_embeddings=2048)
    model = CausalLM(cfg).eval()
    recipe = recipe_for_role(args.recipe, "rollout", kv_cache_dtype=args.kv, batch_invariant=True)
    # EOS disabled (no token id reaches it): every turn generates --gen tokens
    engines = {mode: TorchRolloutEngine(model, recipe, eos_token_ids=[cfg.vocab_size], max_batch_size=64)
               for mode in ("reuse", "reprefill")}
    if args.kv == "fp8":
        from fp8rl.engines import QKVCalibrator

        g = torch.Generator().manual_seed(2)
        scales = QKVCalibrator(model, pad_token_id=0).calibrate(
            0, [torch.randint(4, 100, (256,), generator=g).tolist() for _ in range(4)])
        for e in engines.values():
            e.load_scales(scales)
    g = torch.Generator().manual_seed(1)
    openings = [[1] + torch.randint(4, 100, (OPENING - 1,), generator=g).tolist() for _ in range(args.trajectories)]
    n = args.trajectories
    print(f"model random tiny-arith shape ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"max_position_embeddings {cfg.max_position_embeddings}), recipe {args.recipe}, kv {args.kv}, batch "
          f"invariant; {n} trajectories, opening {OPENING} + per turn {args.gen} generated + {args.env} environment "
          f"tokens; torch threads {torch.get_num_threads()}")
    _converse(engines, openings, 2, args.gen, args.env)  # warm-up, a session hit included (first-call costs)
    res: dict[str, float] = {}
    for turns in args.turns:
        context = OPENING + turns * (args.gen + args.env) - args.env
        seconds, tokens, equal = _converse(engines, openings, turns, args.gen, args.env)
        tok_r, tok_p = tokens["reuse"] / n, tokens["reprefill"] / n
        s_r, s_p = seconds["reuse"] / n, seconds["reprefill"] / n
        print(f"turns {turns:3d} (context {context} tokens): prefill tokens/trajectory reuse {tok_r:.0f} reprefill "
              f"{tok_p:.0f}; seconds/trajectory reuse {s_r:.3f} reprefill {s_p:.3f}; bitwise equal {equal}")
        print(f"ratio prefill_tokens/reuse_vs_reprefill {tok_r / tok_p:.4f} (turns {turns})")
        print(f"ratio seconds/reuse_vs_reprefill {s_r / s_p:.4f} (turns {turns})")
        res[f"prefill_tokens_ratio_{turns}"], res[f"seconds_ratio_{turns}"] = tok_r / tok_p, s_r / s_p
    return res


if __name__ == "__main__":
    main()
