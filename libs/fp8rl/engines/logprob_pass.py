"""The logprob (and entropy) of every token of a batch of sequences under a policy: the trainer's pass over its
rows, with a micro-batch's shared leading tokens run once (:mod:`fp8rl.model.shared_prefix`). Both trainer
backends and the observatory compute logprobs here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8rl.model import CausalLM
from fp8rl.model.logprobs import entropy_of, sampling_log_softmax
from fp8rl.model.shared_prefix import SharedPrefix
from fp8rl.model.vision import ImageBatch

__all__ = ["ENTROPY_CHUNK_ELEMENTS", "sequence_logprobs", "sequence_logprobs_and_entropy", "token_logprobs",
           "token_logprobs_and_entropy"]


def sequence_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
    images: ImageBatch | None = None,
) -> torch.Tensor:
    """``(B, T)`` logprob of each token given its prefix (0 at t = 0), under ``logits / temperature``."""
    return sequence_logprobs_and_entropy(model, input_ids, attention_mask, temperature, images=images)[0]


def sequence_logprobs_and_entropy(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  temperature: float = 1.0, entropy: bool = False, prefix_len: int = 0,
                                  images: ImageBatch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sequence_logprobs`, and with ``entropy`` the ``(B, T)`` entropy as :func:`token_logprobs_and_entropy`.

    A :class:`CausalLM` computes them inside its forward over bounded chunks of logits (never the ``(B, T, V)``
    logits, forward or backward: :mod:`fp8rl.model.logprobs`), with the numbers :func:`token_logprobs_and_entropy`
    gives on its full logits; another model (the Megatron backend's) returns its full logits, which go through
    :func:`token_logprobs_and_entropy`. Either is called as ``model(input_ids, attention_mask=...)``, the keyword
    forward hooks read (the QKV calibrator's).

    ``prefix_len > 0`` (a :class:`CausalLM`; every row's first ``prefix_len`` tokens equal:
    :func:`~fp8rl.model.shared_prefix.shared_prefix_length`) runs those tokens once and the rows' suffixes on top
    (:mod:`fp8rl.model.shared_prefix`); the logprobs and entropy of tokens ``0 .. prefix_len`` are then 0 (not
    computed: the first one needed comes after).

    ``images`` (a vision-language :class:`CausalLM`; no shared prefix): the rows' images, row order.
    """
    if images is not None:
        if not isinstance(model, CausalLM) or prefix_len > 0:
            raise ValueError("images go to an embedded vision-language model's whole-row forward (no shared prefix)")
        return model(input_ids, attention_mask=attention_mask, token_logprobs=True, temperature=temperature,
                     entropy=entropy, images=images)
    if isinstance(model, CausalLM):
        if prefix_len > 0:
            shared = SharedPrefix()
            model(input_ids[:1, :prefix_len], prefix=shared, logits_to_keep=1)  # the prefix's K/V, recorded
            lp, ent = model(input_ids[:, prefix_len:], attention_mask=attention_mask, prefix=shared,
                            token_logprobs=True, temperature=temperature, entropy=entropy)
            return F.pad(lp, (prefix_len, 0)), F.pad(ent, (prefix_len, 0)) if ent is not None else None
        return model(input_ids, attention_mask=attention_mask, token_logprobs=True, temperature=temperature,
                     entropy=entropy)
    return token_logprobs_and_entropy(model(input_ids, attention_mask=attention_mask), input_ids, temperature, entropy)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``(B, T)`` logprob of each token of ``input_ids`` under the ``(B, T, V)`` FP32 ``logits`` of its sequence."""
    return token_logprobs_and_entropy(logits, input_ids, temperature)[0]


# the policy entropy is computed over this many logits at a time (two FP32 temporaries of 64 MiB each)
ENTROPY_CHUNK_ELEMENTS = 1 << 24


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                               entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs`, and with ``entropy`` the ``(B, T)`` entropy of the sampling distribution each token
    was drawn from (``-sum_v p log p`` of ``logits / temperature`` at the position before it; 0 at t = 0; no
    gradient), else None. The per-row ops are those of :mod:`fp8rl.model.logprobs`, on full logits."""
    logp = sampling_log_softmax(logits[:, :-1], temperature)  # predicts tokens 1..T-1
    tok = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    ent = None
    if entropy:
        with torch.no_grad():  # ENTROPY_CHUNK_ELEMENTS at a time: bounded temporaries, not another (B, T, V)
            lp = logp.detach().reshape(-1, logp.shape[-1])  # (B * (T-1), V)
            step = max(1, ENTROPY_CHUNK_ELEMENTS // lp.shape[-1])
            flat = torch.cat([entropy_of(c) for c in lp.split(step)]) if lp.numel() else lp.sum(-1)
            ent = F.pad(flat.view(tok.shape), (1, 0))  # (B, T)
    return F.pad(tok, (1, 0)), ent  # (B, T)
