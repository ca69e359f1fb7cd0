"""The Megatron backend over several ranks under the real torchrun (gloo) against 1 rank on the same global batch:
2 data-parallel ranks (Megatron-Core DDP), 2 tensor-parallel ranks (Megatron's column/row-parallel layers, FP8
linears included), 2 pipeline stages (Megatron's 1F1B schedule), data x pipeline parallel on 4 ranks, and its
checkpoints across world sizes and tensor- / pipeline-parallel layouts.

The ranks run ``tests/distributed/rank_worker.py`` with ``backend: megatron``. The schedule is the torch
backend's (the very micro-batches one rank runs, micro-batch ``j`` on rank ``j % N``), so the tolerances are
the ones :mod:`tests.distributed.test_trainer_ranks` derives from the same error model, named there:
logprobs bitwise; loss and gradients differ by FP32 summation order only (Megatron DDP's bucket all-reduce
adds the ranks' FP32 gradient buffers in another order than one rank's backward accumulates them).

Tensor parallel is not bitwise: a row-parallel layer adds its ranks' partial products (an all-reduce) where one
rank sums the whole K at once, and a column-parallel layer's input gradient likewise. That is FP32 summation
order again, so the bounds are :mod:`tests.megatron.test_trainer`'s (torch vs Megatron backend, same error
model, named there): ``LOGPROB_ATOL``, ``LOSS_RTOL``, ``GRAD_RTOL_FP32`` and, with FP8 linears, ``GRAD_RTOL_FP8``
(quantizer inputs that differ by that noise flip an element to the neighbouring E4M3 value now and then).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron  # make test-megatron (installs megatron-core), not test-distributed


def _ranks_module():
    path = Path(__file__).resolve().parents[1] / "distributed" / "test_trainer_ranks.py"
    spec = importlib.util.spec_from_file_location("_trainer_ranks_harness", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


R = _ranks_module()  # torchrun(), rel(), LOSS_RTOL, GRAD_RTOL
ALIGNED = dict(num_key_value_heads=4)  # each of 2 ranks holds 128-row slices of q/k/v, gate/up (FP8 blocks whole)


# bf16: make test-megatron-full (fp8_e2e runs the same data-parallel path, one minibatch)
@pytest.mark.parametrize("recipe,minibatches", [pytest.param("bf16", 2, marks=pytest.mark.slow), ("fp8_e2e", 1)])
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


def _worker():
    path = Path(__file__).resolve().parents[1] / "distributed" / "rank_worker.py"
    spec = importlib.util.spec_from_file_location("_rank_worker", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _loss_bound(batch, lp_a: torch.Tensor, lp_b: torch.Tensor, rtol: float) -> float:
    """Most the step's loss can move when its old-policy logprobs move from ``lp_a`` to ``lp_b``.

    On the first update the policy ratio is exactly 1 on both sides (current = old logprobs, same weights, same
    code), so the loss is ``-sum_t A_t w_t / N`` with the IS weight ``w_t = exp(old_t - gen_t)`` (capped: a cap
    only shrinks differences). ``|dw_t| <= max(w_t) (exp|d old_t| - 1)`` bounds each term; FP32 summation adds
    ``rtol`` of the terms' magnitude ``sum_t |A_t| w_t / N`` — not of the loss, which the group-centred advantages
    cancel to a small fraction of it."""
    m = batch.loss_mask.bool()
    d = (lp_a - lp_b).abs()[m]
    w = torch.exp(torch.maximum(lp_a, lp_b)[m].double() - batch.gen_logprobs[m].double())
    adv = batch.advantages[:, None].expand_as(batch.loss_mask)[m].double().abs()
    return float(((adv * w * torch.expm1(d.double())).sum() + rtol * (adv * w).sum()) / m.sum())


# bf16 untied: the other two cover its path (make test-megatron-full runs it; .ci/run has no room)
@pytest.mark.parametrize("recipe,tied", [pytest.param("bf16", False, marks=pytest.mark.slow), ("fp8_e2e", False),
                                         ("bf16", True)])
def test_two_tensor_parallel_ranks_train_like_one(megatron_core, tmp_path, recipe, tied):
    """bf16: FP32 summation order only (test_trainer's bounds; the loss within what the measured logprob moves and
    FP32 summation can change it by, :func:`_loss_bound`). fp8_e2e: that noise also moves a quantizer input
    across an E4M3 rounding boundary now and then (a one-step flip, 2**-3 relative), which moves whole
    logprobs: the token probabilities then stay within the recipe's own mismatch promise (the bound for two
    FP8 computations of the same tokens in different summation orders), the loss within what the measured
    logprob moves can change it by (:func:`_loss_bound`), gradients within GRAD_RTOL_FP8 (its flip model)."""
    from fp8rl.rl.metrics import mismatch_promise, token_mult_prob_error

    from .test_trainer import GRAD_RTOL_FP8, GRAD_RTOL_FP32, LOGPROB_ATOL, LOSS_RTOL

    rows = 10
    args = dict(backend="megatron", recipe=recipe, micro_batch_size=3, rows=rows,
                model={**ALIGNED, "tie_word_embeddings": tied})  # tied: the vocab-parallel embedding is the head
    one, two = R.torchrun(tmp_path, 1, "step", **args), R.torchrun(tmp_path, 2, "step", **args, tp=2)
    batch = _worker().batch(rows)
    real = batch.attention_mask.bool()
    diff = float((two["logprobs"] - one["logprobs"]).abs()[real].max())
    m1, m2 = one["metrics"], two["metrics"]
    assert float(m2["num_tokens"]) == float(m1["num_tokens"]) > 0
    fp8 = recipe == "fp8_e2e"
    if fp8:
        err = float(token_mult_prob_error(two["logprobs"], one["logprobs"], batch.loss_mask))
        print(f"{recipe}: TP 2 vs 1: max |dlogprob| {diff:.3g}, token_mult_prob_error {err:.6f}")
        assert err <= mismatch_promise("fp8_e2e", "auto", over="step")
    else:
        print(f"{recipe}: TP 2 vs 1: max |dlogprob| {diff:.3g}")
        assert diff <= LOGPROB_ATOL
    bound = _loss_bound(batch, one["logprobs"], two["logprobs"], LOSS_RTOL)
    assert abs(float(m2["loss"]) - float(m1["loss"])) <= bound
    grad_rtol = GRAD_RTOL_FP8 if fp8 else GRAD_RTOL_FP32
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=grad_rtol)
    assert set(one["grads"]) == set(two["grads"])
    err = {n: R.rel(two["grads"][n], one["grads"][n]) for n in one["grads"]}
    worst = max(err, key=err.get)
    print(f"{recipe}: TP 2 vs 1: worst grad rel err {err[worst]:.3g} ({worst})")
    assert err[worst] <= grad_rtol, worst


# --- pipeline parallel: Megatron's 1F1B schedule over 2 stages ------------------------------------------------

@pytest.mark.parametrize("recipe,tied", [pytest.param("bf16", False, marks=pytest.mark.slow), ("fp8_e2e", False),
                                         ("bf16", True)])
def test_two_pipeline_stages_train_like_one(megatron_core, tmp_path, recipe, tied):
    """PP = 2 (one layer per stage, every pass through Megatron's schedule) against one rank: each stage runs the
    very operations one rank runs on the same inputs and the activations travel exactly, so logprobs, loss and
    metrics are bitwise one rank's, and so are the gradients of an untied model. Tied embeddings: the embedding's
    gradient is its two copies' (first and last stage) summed over the embedding group after the schedule, where
    one rank accumulates both uses micro-batch by micro-batch — FP32 summation order (GRAD_RTOL). The global
    gradient norm sums per-tensor squares over the stages, in another order than one rank's: GRAD_RTOL too; so
    that its rounding (through the clip coefficient, which scales every gradient) does not hide what is compared,
    the gradients are compared unclipped (grad_clip 0; the data x pipeline test below clips)."""
    args = dict(backend="megatron", recipe=recipe, micro_batch_size=3, rows=10, grad_clip=0.0,
                model={"tie_word_embeddings": tied})
    one, two = R.torchrun(tmp_path, 1, "step", **args), R.torchrun(tmp_path, 2, "step", **args, pp=2)
    assert torch.equal(one["logprobs"], two["logprobs"])
    m1, m2 = one["metrics"], two["metrics"]
    assert set(m1) == set(m2) and float(m1["num_tokens"]) > 0
    assert {k: float(m2[k]) for k in m1 if k != "grad_norm"} == {k: float(m1[k]) for k in m1 if k != "grad_norm"}
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=R.GRAD_RTOL)
    assert set(one["grads"]) == set(two["grads"])
    err = {n: R.rel(two["grads"][n], one["grads"][n]) for n in one["grads"]}
    if tied:
        assert max(err.values()) <= R.GRAD_RTOL, max(err, key=err.get)
        assert [n for n, e in err.items() if e and not n.startswith("embedding.")] == []
    else:
        assert [n for n in one["grads"] if not torch.equal(one["grads"][n], two["grads"][n])] == []


def test_data_and_pipeline_parallel_together(megatron_core, tmp_path):
    """dp_size 2 x PP 2 (4 ranks) against one rank, fp8_e2e: logprobs bitwise; loss and gradients within the data-
    parallel bounds (Megatron DDP adds the two replicas' FP32 gradient buffers in another order)."""
    args = dict(backend="megatron", recipe="fp8_e2e", micro_batch_size=3, rows=10)
    one, four = R.torchrun(tmp_path, 1, "step", **args), R.torchrun(tmp_path, 4, "step", **args, pp=2)
    assert torch.equal(one["logprobs"], four["logprobs"])
    assert float(four["metrics"]["num_tokens"]) == float(one["metrics"]["num_tokens"]) > 0
    assert float(four["metrics"]["loss"]) == pytest.approx(float(one["metrics"]["loss"]), rel=R.LOSS_RTOL)
    assert float(four["metrics"]["grad_norm"]) == pytest.approx(float(one["metrics"]["grad_norm"]), rel=R.GRAD_RTOL)
    worst = max(one["grads"], key=lambda n: R.rel(four["grads"][n], one["grads"][n]))
    assert R.rel(four["grads"][worst], one["grads"][worst]) <= R.GRAD_RTOL, worst


@pytest.mark.parametrize("save_layout,load_layout,tied", [
    pytest.param(dict(tp=2), dict(tp=2), False, marks=pytest.mark.slow),  # tp2pp2-then-pp2 moves TP shards too
    (dict(tp=2, pp=2), dict(pp=2), True),  # tied: the last stage holds the embedding's copy
], ids=["tp2", "tp2pp2-then-pp2"])
def test_model_parallel_checkpoints_are_whole_and_move_between_layouts(megatron_core, tmp_path, save_layout,
                                                                       load_layout, tied):
    """Saved by tensor- (and pipeline-) parallel ranks: whole tensors in the TP = PP = 1 layout, the optimizer state
    keyed by that model's parameter positions. Resumed by one rank (weights and AdamW moments bitwise), stepped and
    saved by one, resumed by another parallel layout (bitwise again)."""
    a, b = tmp_path / "ck" / "trainer-v000001.pt", tmp_path / "ck" / "trainer-v000002.pt"
    base = dict(backend="megatron", recipe="fp8_e2e", micro_batch_size=3, rows=10,
                model={**ALIGNED, "tie_word_embeddings": tied})
    n = {k: v.get("tp", 1) * v.get("pp", 1) for k, v in (("save", save_layout), ("load", load_layout))}
    saved = R.torchrun(tmp_path, n["save"], "save", **base, **save_layout, steps=1, path=str(a))
    assert sorted(p.name for p in a.parent.iterdir()) == [a.name]  # one file, no temporary left
    one = R.torchrun(tmp_path, 1, "load", **base, path=str(a), then_step=True, save_to=str(b))
    assert int(saved["version"]) == int(one["version"]) == 1
    assert set(saved["state"]) == set(one["state"]) and any(k.endswith("/exp_avg_sq") for k in saved["state"])
    assert [k for k in saved["state"] if not torch.equal(saved["state"][k], one["state"][k])] == []
    again = R.torchrun(tmp_path, n["load"], "load", **base, **load_layout, path=str(b))
    assert int(again["version"]) == 2
    assert [k for k in again["state"] if not torch.equal(again["state"][k], one["after"][k])] == []
    assert any(not torch.equal(one["after"][k], one["state"][k]) for k in one["state"])  # the step moved them
