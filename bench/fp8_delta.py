"""How much of an FP8 refit changes per step: the share of 128x128 E4M3 blocks whose bytes or FP32 scale move.

The data an FP8 delta refit (ship only changed blocks against a base version) would save. For each
learning rate the default job (deploy/default-job.yaml, in process) is built, its FP8 linears are
quantized the way the trainer ships them (128x128 blocks, FP32 or power-of-two scales), one GRPO
step is trained, and they are quantized again. A block counts as changed when any of its E4M3 bytes or
its scale differs. Printed per (lr, scales): changed blocks / all blocks, the bytes a block delta would
ship (changed blocks' E4M3 bytes + their scales) over the full FP8 payload of the linears, as
``ratio delta_bytes/full_fp8_bytes X`` lines; and the share of E4M3 bytes that changed, with what an
element-sparse delta ((int32 index, byte) per changed element plus every scale) would ship.
Run: ``python bench/fp8_delta.py [--lrs 2e-4 3e-7]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))

from fp8rl.config import load_job_config  # noqa: E402
from fp8rl.fp8 import BLOCK, fp8_linear_names, quantize_blockwise  # noqa: E402
from fp8rl.loop import GRPOLoop, LoopConfig  # noqa: E402


def _blocks(weights: dict[str, torch.Tensor], pow2: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {k: quantize_blockwise(w.float(), pow2_scale=pow2, name=k) for k, w in weights.items()}


def _changed(before, after) -> tuple[int, int, int, int, int, int]:
    """(changed blocks, all blocks, delta bytes, full bytes, changed elements, all elements) over every FP8 linear."""
    changed = total = delta = full = elems = all_elems = 0
    for k, (q0, s0) in before.items():
        q1, s1 = after[k]
        m, n = q0.shape
        bm, bn = s0.shape
        diff = (q0.view(torch.uint8) != q1.view(torch.uint8))
        elems, all_elems = elems + int(diff.sum()), all_elems + diff.numel()
        pad = torch.zeros(bm * BLOCK, bn * BLOCK, dtype=torch.bool)
        pad[:m, :n] = diff
        per_block = pad.view(bm, BLOCK, bn, BLOCK).any(dim=3).any(dim=1) | (s0 != s1)
        sizes = torch.zeros(bm * BLOCK, bn * BLOCK)
        sizes[:m, :n] = 1
        block_bytes = sizes.view(bm, BLOCK, bn, BLOCK).sum(dim=(1, 3)) + 4  # E4M3 bytes + one FP32 scale
        changed += int(per_block.sum())
        total += per_block.numel()
        delta += int(block_bytes[per_block].sum())
        full += int(block_bytes.sum())
    return changed, total, delta, full, elems, all_elems


def measure(lr: float, job_file: str) -> dict:
    job = load_job_config(job_file).with_settings({"policy.training.lr": lr, "job.steps": 1, "job.eval_size": 8})
    loop = GRPOLoop(LoopConfig(job))
    names = fp8_linear_names(loop.trainer.model, loop.rollout_recipe)
    state = loop.trainer.state_dict()
    weights = {f"{n}.weight": state[f"{n}.weight"].detach().clone() for n in names}
    before = {p: _blocks(weights, p) for p in (False, True)}
    loop.step(0)
    state = loop.trainer.state_dict()
    after_w = {k: state[k].detach().clone() for k in weights}
    out = {}
    for pow2 in (False, True):
        c, t, d, f, e, a = _changed(before[pow2], _blocks(after_w, pow2))
        out["pow2" if pow2 else "fp32"] = {"changed_blocks": c, "blocks": t, "delta_bytes": d, "full_bytes": f,
                                           "changed_elements": e, "elements": a}
    rel = max(float((after_w[k] - weights[k]).abs().max() / weights[k].abs().max()) for k in weights)
    out["max_rel_update"] = rel
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(REPO / "deploy" / "default-job.yaml"))
    ap.add_argument("--lrs", type=float, nargs="*", default=[2e-4, 3e-7])
    args = ap.parse_args(argv)
    res = {}
    for lr in args.lrs:
        r = res[lr] = measure(lr, args.job)
        for scales in ("fp32", "pow2"):
            x = r[scales]
            print(f"lr {lr:g} {scales} scales: {x['changed_blocks']}/{x['blocks']} blocks changed "
                  f"({x['changed_blocks'] / x['blocks']:.1%}); largest relative weight update "
                  f"{r['max_rel_update']:.2e}")
            block_ratio = x["delta_bytes"] / x["full_bytes"]
            print(f"ratio delta_bytes/full_fp8_bytes lr={lr:g} scales={scales} {block_ratio:.4f}")
            # an element-sparse delta: (int32 index, E4M3 byte) per changed element, plus every block's scale
            sparse = 5 * x["changed_elements"] + 4 * x["blocks"]
            print(f"  {x['changed_elements'] / x['elements']:.2%} of E4M3 bytes changed")
            print(f"ratio sparse_delta_bytes/full_fp8_bytes lr={lr:g} scales={scales} {sparse / x['full_bytes']:.4f}")
    return res


if __name__ == "__main__":
    main()
