"""Logprobs of chosen tokens from final hidden states, never holding more than one chunk of logits.

The trainer needs ``log_softmax(logits / temperature)`` at one token per position, not the logits: for a
Qwen2 vocabulary (151,936) a micro-batch's ``(B, T, V)`` FP32 logits, their log-softmax and their
gradient are each ~0.5-1 GB. :func:`chunked_token_logprobs` takes the hidden states ``(N, C)`` of the
positions instead and runs the output head over at most :data:`LOGPROB_CHUNK_ELEMENTS` logits at a time:

* **Forward** (no autograd state): per chunk ``head(h_c).float()``, the division by the temperature,
  ``log_softmax`` and the gather of the chosen token: the very ops :func:`sampling_log_softmax` applies to
  full logits, so each row's numbers are the full-logits ones as far as the head's GEMM gives a row the
  same bits in a chunk as in the whole (always with batch-invariant numerics: a chunk's rows are whole row
  tiles, :mod:`fp8rl.model.invariant`). Only ``h`` and the targets are kept for backward.
* **Backward** (recomputation, as in activation checkpointing): per chunk the logits again, with autograd,
  and the chunk's upstream gradient backpropagated through them to ``h_c`` (the same graph, hence the same
  per-row ops, as the full-logits backward) and to the head's output; the head's weight gradient
  ``sum_c dout_cᵀ h_c`` (and the bias's) is accumulated in FP32 across chunks. That sum is the one the
  full-logits backward computes with a single GEMM, in another order: it agrees to FP32 reassociation, not
  bitwise. The cost is one more head GEMM (and log-softmax) per chunk. Rows that fit one chunk take plain
  autograd instead (what the full-logits path does, nothing recomputed).

The head's parameters are inputs of the autograd function, so their gradients reach ``.grad`` through
autograd (tied embeddings add theirs; FSDP2 sees them on the unsharded parameters, which the caller's
module holds during its backward: call this from inside the owning module's ``forward``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["LOGPROB_CHUNK_ELEMENTS", "chunk_rows", "chunked_token_logprobs", "entropy_of", "sampling_log_softmax"]

# FP32 logits of one chunk (128 MiB): each of the chunk's temporaries (logits, log-softmax, their gradients) is this
# big. Each chunk's head GEMMs stream the whole weight, so fewer, larger chunks run them nearer full speed: measured on
# 2 CPU cores, a Qwen2-0.5B-shaped training step of 8 x 70 tokens took +18% over the full logits at 1 << 24 (104 rows
# a chunk), +8% at 1 << 26 (the recomputed GEMM alone is ~7%); a step's peak memory over 8 x 256 tokens (2 layers)
# was 1.5 GiB above the weights at 1 << 24, 2.4 GiB at 1 << 26 and 4.1 GiB with the full logits. On the whole 630M
# model (24 layers, 16 rows x 150 tokens, micro-batch 8, activation checkpointing) this size took the backward's peak
# 0.64 GB below 1 << 26's for +2% train-step time (117.0 s vs 114.4 s, one run each; issue 30). Rows that fit one
# chunk are not recomputed at all (plain autograd, as the full logits).
LOGPROB_CHUNK_ELEMENTS = 1 << 25

# rows of the BLAS's small-M path (BatchInvariance.row_tile's floor): no chunk is shorter unless all rows are
_MIN_ROWS = 8


def sampling_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` over the last dim: the distribution a token was sampled from
    (temperature 0, greedy, and 1 leave the logits as they are)."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """``-sum_v p log p`` over the last dim of log-probabilities ``logp``."""
    return -(logp.exp() * logp).sum(dim=-1)


def chunk_rows(vocab: int, row_tile: int | None) -> int:
    """Rows per chunk of ``vocab`` logits: as many as :data:`LOGPROB_CHUNK_ELEMENTS` allows, in whole tiles of
    8 rows and of ``row_tile`` (the head's batch-invariant tile, or None), at least one tile."""
    tile = math.lcm(_MIN_ROWS, row_tile) if row_tile else _MIN_ROWS
    return max(1, LOGPROB_CHUNK_ELEMENTS // vocab // tile) * tile


def _spans(n: int, head: nn.Linear) -> list[tuple[int, int]]:
    """``[start, stop)`` of the chunks of ``n`` rows through ``head``; a tail under :data:`_MIN_ROWS` rows joins the
    chunk before it (no small-M GEMM, and no single-row reduction over the vocabulary, which torch splits
    across threads)."""
    starts = list(range(0, n, chunk_rows(head.out_features, getattr(head, "row_tile", None))))
    if len(starts) > 1 and n - starts[-1] < _MIN_ROWS:
        starts.pop()
    bounds = [*starts, n]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _chosen(out: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp (n, V), logprob of targets (n,))`` from the head's output ``out`` ``(n, V)``."""
    logp = sampling_log_softmax(out.float(), temperature)
    return logp, logp.gather(-1, targets[:, None]).squeeze(-1)


def _forward_chunks(h: torch.Tensor, targets: torch.Tensor, head: nn.Linear, temperature: float, entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = h.shape[0]
    lp = torch.empty(n, dtype=torch.float32, device=h.device)
    ent = torch.empty(n, dtype=torch.float32, device=h.device) if entropy else None
    for a, b in _spans(n, head):
        logp, lp[a:b] = _chosen(head(h[a:b]), targets[a:b], temperature)
        if ent is not None:
            ent[a:b] = entropy_of(logp)
    return lp, ent


class _ChunkedLogprobs(torch.autograd.Function):
    """:func:`chunked_token_logprobs` with a gradient (module docstring); ``weight`` and ``bias`` are the head's
    parameters, inputs so that autograd gives them their gradients."""

    @staticmethod
    def forward(ctx, h, targets, weight, bias, head, temperature, entropy):
        lp, ent = _forward_chunks(h, targets, head, temperature, entropy)
        ctx.save_for_backward(h, targets)
        ctx.head, ctx.temperature = head, temperature
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        h, targets = ctx.saved_tensors
        head = ctx.head
        # the module's own parameters: the forward's inputs (under FSDP2 unsharded again for this backward)
        weight, bias = head.weight, head.bias
        dh = torch.empty_like(h)
        # the parameters' gradients, summed over chunks in FP32 (None where not wanted)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[2] else None
        db = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if ctx.needs_input_grad[3] else None
        for a, b in _spans(h.shape[0], head):
            hc = h[a:b]
            with torch.enable_grad():
                leaf = hc.detach().requires_grad_()
                out = head(leaf)  # (rows, V) in the head's dtype
                _, tok = _chosen(out, targets[a:b], ctx.temperature)
                dh[a:b], dout = torch.autograd.grad(tok, (leaf, out), grad_lp[a:b])
            dout = dout.float()
            if dw is not None:
                dw.addmm_(dout.t(), hc.float())  # dW += doutᵀ h_c
            if db is not None:
                db += dout.sum(0)
        return (dh, None, dw.to(weight.dtype) if dw is not None else None,
                db.to(bias.dtype) if db is not None else None, None, None, None)


def chunked_token_logprobs(h: torch.Tensor, head: nn.Linear, targets: torch.Tensor, temperature: float = 1.0,
                           entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of ``targets`` under ``sampling_log_softmax(head(h).float(), temperature)``, chunk by chunk.

    Args:
        h: ``(N, C)`` final hidden states of the positions that predict a token.
        head: the output projection (an ``nn.Linear``, batch-invariant or not; its parameters get gradients).
        targets: ``(N,)`` the token each position predicts.
        temperature: the sampling temperature (0 and 1: none).
        entropy: also return the entropy of each position's distribution (no gradient).

    Returns:
        ``(N,)`` FP32 logprobs (differentiable in ``h`` and the head's parameters when grad is enabled), and
        ``(N,)`` FP32 entropy or None.
    """
    params = [p for p in (head.weight, head.bias) if p is not None]
    if not torch.is_grad_enabled() or not (h.requires_grad or any(p.requires_grad for p in params)):
        return _forward_chunks(h, targets, head, temperature, entropy)
    if len(_spans(h.shape[0], head)) == 1:  # one chunk holds it all: plain autograd keeps it, nothing recomputed
        logp, lp = _chosen(head(h), targets, temperature)
        return lp, entropy_of(logp.detach()) if entropy else None
    return _ChunkedLogprobs.apply(h, targets, head.weight, head.bias, head, temperature, entropy)
