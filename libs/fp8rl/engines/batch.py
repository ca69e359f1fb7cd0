"""From samples to a train step: the padded :class:`TrainBatch`, and logprobs → mismatch → optimizer step.

The in-process loop and the trainer service both train through :func:`train_on_batch`, so the mismatch
metrics (``token_mult_prob_error`` ...) of a step are computed one way, on the trainer's logprobs of the
tokens the rollout engine sampled, before the update.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fp8rl.rl import grpo_advantages, mismatch_metrics

from .base import ShouldStop, TrainBatch, TrainerBackend

__all__ = ["TrainOutcome", "build_train_batch", "train_on_batch"]


def build_train_batch(
    samples: Sequence, rewards: torch.Tensor | None, group_size: int, pad_id: int, *,
    advantages: torch.Tensor | None = None,
) -> TrainBatch:
    """Right-padded :class:`TrainBatch` from prompt-major samples (``prompt_ids``, ``token_ids``, ``logprobs``).

    Advantages are the GRPO advantages of ``rewards`` (groups of ``group_size`` consecutive
    samples), or given directly with ``advantages`` (e.g. already computed by a controller).
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
        loss_mask[b, P:P + n] = 1.0
        gen[b, P:P + n] = torch.tensor(s.logprobs)
    adv = grpo_advantages(rewards, group_size).float() if advantages is None else advantages.float()
    return TrainBatch(ids, attn, loss_mask, adv, gen)


@dataclass(frozen=True)
class TrainOutcome:
    """One optimizer step: the mismatch metrics (before it) and the trainer's own, and the two phase times."""

    metrics: dict[str, float]
    logprobs_s: float
    train_s: float


def train_on_batch(trainer: TrainerBackend, batch: TrainBatch, *, should_stop: ShouldStop | None = None
                   ) -> TrainOutcome:
    """The trainer's logprobs of the sampled tokens (stored as ``batch.prev_logprobs``), the train/rollout
    mismatch against the batch's generation logprobs, then one optimizer step.

    Raises whatever the backend raises (``FloatingPointError`` for an overflowing batch, ``Cancelled``
    when ``should_stop`` says so); the weights are unchanged then.
    """
    t = time.perf_counter()
    batch.prev_logprobs = trainer.compute_logprobs(batch, should_stop=should_stop)
    mismatch = mismatch_metrics(batch.prev_logprobs, batch.gen_logprobs, batch.loss_mask)
    t_logprobs, t = time.perf_counter() - t, time.perf_counter()
    train = trainer.train_step(batch, should_stop=should_stop)
    return TrainOutcome({**mismatch, **{f"train/{k}": v for k, v in train.items()}}, t_logprobs,
                        time.perf_counter() - t)
