"""From samples to a train step: the padded :class:`TrainBatch`, and logprobs → mismatch → optimizer step.

The in-process loop and the trainer service both train through :func:`train_on_batch`, so the mismatch
metrics (``token_mult_prob_error`` ...) of a step are computed one way, on the trainer's logprobs of the
tokens the rollout engine sampled, before the update.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp8rl import memory
from fp8rl.rl import MAX_ABS_LOGPROB_DIFF, grpo_advantages, mismatch_metrics

from .base import ShouldStop, TrainBatch, TrainerBackend

if TYPE_CHECKING:
    from fp8rl.fp8 import QKVScales

    from .calibrator import QKVCalibrator

__all__ = ["StaleSampleError", "TrainOutcome", "batch_routes", "build_train_batch", "check_lag", "lag_metrics",
           "train_on_batch"]


def build_train_batch(
    samples: Sequence, rewards: torch.Tensor | None, group_size: int, pad_id: int, *,
    advantages: torch.Tensor | None = None, route_shape: tuple[int, int, int] | None = None,
) -> TrainBatch:
    """Right-padded :class:`TrainBatch` from prompt-major samples (``prompt_ids``, ``token_ids``, ``logprobs``; a
    trajectory's ``token_mask`` makes the loss mask 0 on its environment tokens).

    Advantages are the GRPO advantages of ``rewards`` (groups of ``group_size`` consecutive
    samples), or given directly with ``advantages`` (e.g. already computed by a controller).
    ``route_shape`` ``(L, K, E)`` (routing replay on a mixture-of-experts model) takes every sample's
    ``routes`` into the batch (:func:`batch_routes`). A vision-language sample's ``images`` go with its row.
    """
    if (rewards is None) == (advantages is None):
        raise ValueError("build_train_batch needs exactly one of rewards or advantages")
    rows = [list(s.prompt_ids) + list(s.token_ids) for s in samples]
    T = max(len(r) for r in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T)
    gen = torch.zeros(B, T)
    for b, (s, r) in enumerate(zip(samples, rows, strict=True)):
        P, n = len(s.prompt_ids), len(s.token_ids)
        ids[b, :len(r)] = torch.tensor(r)
        attn[b, :len(r)] = 1
        mask = getattr(s, "token_mask", None)  # a trajectory: only the model's tokens are trained
        if mask is None:
            loss_mask[b, P:P + n] = 1.0
        else:
            if len(mask) != n:
                raise ValueError(f"sample {b}: token_mask has {len(mask)} entries for {n} tokens")
            loss_mask[b, P:P + n] = torch.tensor(mask, dtype=loss_mask.dtype)
        gen[b, P:P + n] = torch.tensor(s.logprobs)
    adv = grpo_advantages(rewards, group_size).float() if advantages is None else advantages.float()
    known = [getattr(s, "weight_version", None) for s in samples]
    versions = torch.tensor(known, dtype=torch.long) if all(v is not None for v in known) else None
    images = [getattr(s, "images", None) for s in samples]
    return TrainBatch(ids, attn, loss_mask, adv, gen, versions=versions,
                      routes=batch_routes(samples, T, route_shape),
                      images=images if any(i is not None for i in images) else None)


def batch_routes(samples: Sequence, T: int, route_shape: tuple[int, int, int] | None) -> torch.Tensor | None:
    """``(B, T, L, K)`` int16 routes of right-padded rows (-1 where none), or None when ``route_shape`` is None.

    ``route_shape`` is ``(L, K, E)``: mixture-of-experts layers, experts per token, experts per layer. Every sample
    must then carry ``routes`` of ``(prompt + response - 1, L, K)`` ids in ``[0, E)``, ``K`` distinct per token.

    Raises:
        ValueError: a sample's routes are missing or malformed (the message names the sample and what is wrong).
    """
    if route_shape is None:
        return None
    L, K, E = route_shape
    out = torch.full((len(samples), T, L, K), -1, dtype=torch.int16)
    for b, s in enumerate(samples):
        r = getattr(s, "routes", None)
        n = len(s.prompt_ids) + len(s.token_ids) - 1
        if r is None:
            raise ValueError(f"sample {b}: routing replay is on, but the sample carries no routes (the rollout engine "
                             f"must record them)")
        if tuple(r.shape) != (n, L, K):
            raise ValueError(f"sample {b}: routes have shape {tuple(r.shape)}, expected ({n}, {L}, {K}) (prompt + "
                             f"response - 1 tokens, {L} mixture-of-experts layers, top-{K})")
        r = r.long()
        if bool(((r < 0) | (r >= E)).any()):
            raise ValueError(f"sample {b}: routes hold expert ids outside [0, {E})")
        if K > 1 and bool((r.sort(-1).values.diff(dim=-1) == 0).any()):
            raise ValueError(f"sample {b}: routes name one expert twice for a token (top-{K} experts are distinct)")
        out[b, :n] = r.to(torch.int16)
    return out


@dataclass(frozen=True)
class TrainOutcome:
    """One optimizer step: the mismatch metrics (before it) and the trainer's own, and the two phase times."""

    metrics: dict[str, float]
    logprobs_s: float
    train_s: float
    # calibration.site logprobs: the scales recorded in the logprob pass, labelled with the new version
    qkv_scales: QKVScales | None = None


class StaleSampleError(ValueError):
    """A row was generated by a version older than the trainer's minus ``max_weight_lag`` (or by a newer one)."""


def check_lag(versions: torch.Tensor | None, held: int, max_weight_lag: int) -> None:
    """Refuse (:class:`StaleSampleError`, naming the row and both versions) a batch with a row older than
    ``held - max_weight_lag`` or newer than ``held``; ``versions`` None means every row is from ``held``."""
    if versions is None:
        return
    bad = ((versions < held - max_weight_lag) | (versions > held)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise StaleSampleError(f"row {i} was generated by weight version {int(versions[i])}, but the trainer holds "
                               f"version {held} and accepts versions {held - max_weight_lag}..{held} "
                               f"(max_weight_lag={max_weight_lag}); nothing was trained")


def lag_metrics(batch: TrainBatch, held: int, overall: dict[str, float]) -> dict[str, float]:
    """``weight_lag_mean`` / ``weight_lag_max`` over the rows, and the mismatch split into *numeric* (rows from the
    held version: same weights, different engine) and *stale* (rows from older versions) parts; ``overall`` is
    :func:`mismatch_metrics` of the whole batch, reused for a part that is the whole batch."""
    if batch.versions is None:
        return {"weight_lag_mean": 0.0, "weight_lag_max": 0.0}
    lag = (held - batch.versions).double()
    out = {"weight_lag_mean": float(lag.mean()), "weight_lag_max": float(lag.max()),
           "stale_fraction": float((lag > 0).double().mean())}
    for name, rows in (("numeric", lag == 0), ("stale", lag > 0)):
        if bool(rows.all()):
            m = overall
        else:
            m = mismatch_metrics(batch.prev_logprobs, batch.gen_logprobs,
                                 batch.loss_mask * rows[:, None].to(batch.loss_mask.dtype))
        for key in ("token_mult_prob_error", "gen_kl_k3", MAX_ABS_LOGPROB_DIFF):
            out[f"{name}/{key}"] = m[key]  # e.g. numeric/mismatch/max_abs_logprob_diff: 0.0 iff that part is exact
    return out


def train_on_batch(trainer: TrainerBackend, batch: TrainBatch, *, should_stop: ShouldStop | None = None,
                   max_weight_lag: int = 0, record_qkv: QKVCalibrator | None = None) -> TrainOutcome:
    """The trainer's logprobs of the sampled tokens at the weights it holds (``batch.prev_logprobs``, the
    proximal policy), the train/rollout mismatch against the batch's generation logprobs (split into
    numeric and stale parts by :func:`lag_metrics`), then one optimizer step. A trainer whose train pass can give
    those logprobs itself (``fuses_logprob_pass``: one update per step on one rank, bitwise the same numbers) runs no
    logprob pass: its time is then all ``train_s`` (``logprobs_s`` 0), and the metrics are computed after the step.

    ``record_qkv`` (calibration.site logprobs): that calibrator records the Q/K/V amax of the logprob pass — the
    held version's weights over every sequence of the batch — and the outcome carries them as the new version's
    scales (no forward of their own; one step stale, measured as close to the new weights' whole-batch amax as a
    fresh calibration on a subset: ``bench/RESULTS.md``).

    Both passes are memory phases (``logprobs``, ``train``: :mod:`fp8rl.memory`) of the process's meter.

    Raises :class:`StaleSampleError` (before any work) for a row outside the lag bound,
    :class:`~fp8rl.engines.footprint.MemoryBudgetError` (before any work) for a micro-batch the embedded trainer
    estimates cannot fit, and whatever the
    backend raises (``FloatingPointError`` for an overflowing batch, ``Cancelled`` when ``should_stop``
    says so); the weights are unchanged then.
    """
    check_lag(batch.versions, trainer.version, max_weight_lag)
    check_memory = getattr(trainer, "check_memory", None)  # the embedded trainer: refuse what cannot fit, unrun
    if check_memory is not None:
        check_memory(*batch.input_ids.shape)
    fuses = getattr(trainer, "fuses_logprob_pass", None)
    fused = batch.prev_logprobs is None and fuses is not None and fuses(batch, recording=record_qkv is not None)
    held = trainer.version
    recording = record_qkv.recording() if record_qkv is not None else contextlib.nullcontext()
    t, t_logprobs = time.perf_counter(), 0.0
    if not fused:  # a logprob pass of its own (fused: the train pass's forwards give them, bitwise the same)
        with memory.phase("logprobs"), recording as recorded:
            batch.prev_logprobs = trainer.compute_logprobs(batch, should_stop=should_stop)
        recording = contextlib.nullcontext(recorded)  # recorded already: the train pass adds nothing to it
        t_logprobs, t = time.perf_counter() - t, time.perf_counter()
    with memory.phase("train"), recording as recorded:
        train = trainer.train_step(batch, should_stop=should_stop)
    t_train = time.perf_counter() - t
    mismatch = mismatch_metrics(batch.prev_logprobs, batch.gen_logprobs, batch.loss_mask)
    mismatch.update(lag_metrics(batch, held, mismatch))
    route_metrics = getattr(trainer, "routing_metrics", None)  # mixture-of-experts trainers: moe/* of that pass
    if route_metrics is not None:
        mismatch.update(route_metrics())
    return TrainOutcome({**mismatch, **{f"train/{k}": v for k, v in train.items()}}, t_logprobs, t_train,
                        recorded.scales(trainer.version) if recorded is not None else None)
