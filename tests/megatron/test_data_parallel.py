"""The Megatron backend over 2 data-parallel ranks (Megatron-Core DDP on gloo, under the real torchrun) against
1 rank on the same global batch, and its checkpoints across world sizes.

The ranks run ``tests/distributed/rank_worker.py`` with ``backend: megatron``. The schedule is the torch
backend's (the very micro-batches one rank runs, micro-batch ``j`` on rank ``j % N``), so the tolerances are
the ones :mod:`tests.distributed.test_trainer_ranks` derives from the same error model, named there:
logprobs bitwise; loss and gradients differ by FP32 summation order only (Megatron DDP's bucket all-reduce
adds the ranks' FP32 gradient buffers in another order than one rank's backward accumulates them).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]


def _ranks_module():
    path = Path(__file__).resolve().parents[1] / "distributed" / "test_trainer_ranks.py"
    spec = importlib.util.spec_from_file_location("_trainer_ranks_harness", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


R = _ranks_module()  # torchrun(), rel(), LOSS_RTOL, GRAD_RTOL


@pytest.mark.parametrize("recipe,minibatches", [("bf16", 2), ("fp8_e2e", 1)])
def test_two_megatron_ranks_train_like_one_on_the_same_global_batch(megatron_core, tmp_path, recipe, minibatches):
    args = dict(backend="megatron", recipe=recipe, micro_batch_size=3, rows=10, num_minibatches=minibatches)
    one, two = R.torchrun(tmp_path, 1, "step", **args), R.torchrun(tmp_path, 2, "step", **args)
    assert torch.equal(one["logprobs"], two["logprobs"])
    m1, m2 = one["metrics"], two["metrics"]
    assert set(m1) == set(m2)
    assert float(m2["num_tokens"]) == float(m1["num_tokens"]) > 0  # the whole batch, counted once
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=R.LOSS_RTOL)
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=R.GRAD_RTOL)
    assert set(one["grads"]) == set(two["grads"]) and any("linear_qkv" in n for n in one["grads"])
    worst = max(one["grads"], key=lambda n: R.rel(two["grads"][n], one["grads"][n]))
    assert R.rel(two["grads"][worst], one["grads"][worst]) <= R.GRAD_RTOL, worst
    assert int(two["megatron_ddp"]) == 1 and int(one["megatron_ddp"]) == 0  # the 2-rank gradients went through it


def test_megatron_checkpoints_move_between_two_ranks_and_one(megatron_core, tmp_path):
    """Saved by 2 ranks (one .pt: the state is replicated), resumed by 1 (weights and AdamW moments bitwise),
    stepped and saved by 1, resumed by 2 (bitwise again)."""
    a, b = tmp_path / "ck" / "trainer-v000002.pt", tmp_path / "ck" / "trainer-v000003.pt"
    base = dict(backend="megatron", recipe="fp8_e2e", micro_batch_size=3, rows=10)
    saved = R.torchrun(tmp_path, 2, "save", **base, steps=2, path=str(a))
    assert sorted(p.name for p in a.parent.iterdir()) == [a.name]  # one file, no temporary left
    one = R.torchrun(tmp_path, 1, "load", **base, path=str(a), then_step=True, save_to=str(b))
    assert int(saved["version"]) == int(one["version"]) == 2
    assert set(saved["state"]) == set(one["state"]) and any(k.endswith("/exp_avg_sq") for k in saved["state"])
    assert [k for k in saved["state"] if not torch.equal(saved["state"][k], one["state"][k])] == []
    two = R.torchrun(tmp_path, 2, "load", **base, path=str(b))
    assert int(two["version"]) == 3
    assert [k for k in two["state"] if not torch.equal(two["state"][k], one["after"][k])] == []
    assert any(not torch.equal(one["after"][k], one["state"][k]) for k in one["state"])  # the step moved them
