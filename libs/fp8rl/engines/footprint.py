"""What a training micro-batch of the embedded trainer needs in memory, from the shapes; the refusal when it
cannot fit.

Saved activations per token and transformer layer, in elements of the activation dtype (C hidden, F the SwiGLU
width, Hkv·D the key/value width, H query heads, S the keys each query sees — the padded sequence length)::

    dense layer         8 C + 3 F + 2 Hkv·D + H·S + 8    (norms and residuals, SwiGLU's three F-wide tensors,
                                                           K and V, one attention-probability row per head, the
                                                           norms' statistics)
    QK-norm (qwen3)     + 2 (H·D + Hkv·D) + 8
    batch-invariant     + H·S + 2 Hkv·D + 32              (split-KV attention keeps its rounded probabilities and
                                                           the keys and values in canonical order)
    mixture of experts  3 F' k + (3 + 2k) C + 2 E + 8 in place of 3 F (top-k of E experts of width F': each
                                                           routed copy of the token in and out, the router;
                                                           + 160 batch-invariant: expert rows padded to tiles)
    checkpointed        C per layer (its input), plus one layer's full set while it is recomputed

plus, per token, the embedding and the final norm (3 C) and one chunk of FP32 logits with its softmax and
gradient (:data:`fp8rl.model.logprobs.LOGPROB_CHUNK_ELEMENTS` each, whatever the batch). FP8 linears keep some
inputs as E4M3 (1 byte instead of 4): the estimate ignores that saving, so it errs high on FP8 recipes (by up to
~30% on the shapes the tests measure). ``tests/unit/engines/test_footprint.py`` measures the saved tensors of real
forwards (``torch.autograd.graph.saved_tensors_hooks``) and keeps this estimate between the measurement and 1.25x it
(1.4x on FP8 recipes).

:func:`check_fits` adds what the first step will still allocate (gradients: 4 bytes per trained parameter; AdamW's
two moments: 8; the FP8 weight cache of an ``fp8_e2e`` trainer: 1 per FP8 weight, 5 where it keeps the FP32
dequantization — :func:`keeps_dequantized_weights`) and refuses, naming
``policy.training.micro_batch_size`` and the largest value that fits, when the total passes the memory this process
may still take (:func:`fp8rl.memory.available_bytes`) — before the kernel's OOM killer would end the process with
nothing said.

:func:`recompute_by_default` is ``policy.training.activation_checkpointing`` left unset ("auto"): the embedded
trainer recomputes a dense model's micro-batch whose saved activations would take more than
:data:`AUTO_RECOMPUTE_FLOOR_SHARE` of the trainer's floor (16 bytes per trained parameter: FP32 weights, gradients,
AdamW's two moments) and at least :data:`AUTO_RECOMPUTE_MIN_BYTES` — the activations that would carry a step's peak
past 1.3x the floor, and only where that is worth a third more train time.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.memory import GB, available_bytes
from fp8rl.model.config import ModelConfig
from fp8rl.model.logprobs import LOGPROB_CHUNK_ELEMENTS

__all__ = ["AUTO_RECOMPUTE_FLOOR_SHARE", "AUTO_RECOMPUTE_MIN_BYTES", "DEQUANTIZED_CACHE_MAX_BYTES", "MemoryBudgetError",
           "TrainFootprint", "activation_elements_per_token", "check_fits", "keeps_dequantized_weights",
           "recompute_by_default"]

# activation checkpointing left "auto": recompute a micro-batch whose saved activations pass this share of the
# trainer's floor (the floor is 16 bytes per trained parameter; the memory target is a peak <= 1.3x it, and the
# train phase's other transients — a logits chunk, one layer's gradients — take the rest of that 0.3) ...
AUTO_RECOMPUTE_FLOOR_SHARE = 0.25
# ... and at least this many bytes: a small model's activations can pass the share while costing less than the
# process's fixed memory; recomputing them would spend a third more train time to save nothing that matters
AUTO_RECOMPUTE_MIN_BYTES = 1 << 30


# An FP8 trainer on the reference GEMMs keeps its weights' FP32 dequantization for the version (4 bytes per FP8 weight
# element) up to this many bytes: SmolLM2-135M's 0.42 GB is kept (on CPU the E4M3 -> FP32 conversion per call cost more
# than a micro-batch's GEMM: issue 53), a Qwen2-0.5B-sized model's ~1.4 GB is not (its logprob pass, with gradients
# and AdamW moments held, is the train phase's peak: issue 30). The numbers are the same either way.
DEQUANTIZED_CACHE_MAX_BYTES = 1 << 30


def keeps_dequantized_weights(fp8_elements: int, available: int | None = None) -> bool:
    """Whether a trainer whose FP8 weights have ``fp8_elements`` elements keeps their FP32 dequantization: within
    :data:`DEQUANTIZED_CACHE_MAX_BYTES` and an eighth of the memory available (``available``, default
    :func:`fp8rl.memory.available_bytes`; unknown: the bound alone)."""
    need = 4 * fp8_elements
    room = available_bytes() if available is None else available
    return need <= DEQUANTIZED_CACHE_MAX_BYTES and (room is None or need <= room // 8)


class MemoryBudgetError(MemoryError):
    """A configured micro-batch cannot fit in the memory left (the message names the key and what fits)."""


def activation_elements_per_token(config: ModelConfig, seq_len: int, *, batch_invariant: bool = False,
                                  checkpointing: bool = False) -> int:
    """Saved-for-backward elements per token of a sequence of ``seq_len`` tokens (module docstring)."""
    C, H, D = config.hidden_size, config.num_attention_heads, config.head_dim
    kv = 2 * config.num_key_value_heads * D
    attn = 8 * C + kv + H * seq_len + 8
    if config.qk_norm:
        attn += 2 * (H * D + kv // 2) + 8
    if batch_invariant:
        attn += H * seq_len + kv + 32
    per_layer = []
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            k, E = config.num_experts_per_tok, config.num_experts
            mlp = 3 * config.moe_intermediate_size * k + (3 + 2 * k) * C + 2 * E + 8
            if batch_invariant:  # each expert's rows padded to whole row tiles
                mlp += 160
        else:
            mlp = 3 * config.intermediate_size  # gate and up out, their product (silu recomputed: swiglu)
        per_layer.append(attn + mlp)
    if checkpointing:
        return C * config.num_hidden_layers + max(per_layer) + 3 * C
    return sum(per_layer) + 3 * C


@dataclass(frozen=True)
class TrainFootprint:
    """The bytes a training micro-batch adds on top of what the trainer holds, and what the first step adds."""

    activations: int  # saved for backward by the micro-batch, and its logits chunk
    state_to_come: int  # gradients, AdamW moments and FP8 caches not yet allocated

    @property
    def total(self) -> int:
        return self.activations + self.state_to_come


def micro_batch_footprint(config: ModelConfig, rows: int, seq_len: int, *, batch_invariant: bool,
                          state_to_come: int, activation_bytes: int = 4, checkpointing: bool = False) -> TrainFootprint:
    """:class:`TrainFootprint` of ``rows`` rows of ``seq_len`` tokens."""
    per_token = activation_elements_per_token(config, seq_len, batch_invariant=batch_invariant,
                                              checkpointing=checkpointing)
    logits = 3 * 4 * min(LOGPROB_CHUNK_ELEMENTS, rows * seq_len * config.vocab_size)  # FP32: logits, softmax, grad
    return TrainFootprint(rows * seq_len * per_token * activation_bytes + logits, state_to_come)


def recompute_by_default(config: ModelConfig, rows: int, seq_len: int, *, trained_params: int, batch_invariant: bool,
                         activation_bytes: int = 4, shared: int = 0) -> bool:
    """Whether a micro-batch of ``rows`` rows of ``seq_len`` tokens is recomputed when activation checkpointing is
    left unset (module docstring): never for mixture-of-experts models (their routing plans would see each
    recomputed forward), else when its saved activations pass both :data:`AUTO_RECOMPUTE_FLOOR_SHARE` of the
    floor and :data:`AUTO_RECOMPUTE_MIN_BYTES`. Decided from the shapes only: the same on every machine.
    ``shared`` leading tokens run once for all rows (:mod:`fp8rl.model.shared_prefix`): they count once."""
    if any(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        return False
    tokens = rows * (seq_len - shared) + shared
    saved = tokens * activation_bytes * activation_elements_per_token(config, seq_len, batch_invariant=batch_invariant)
    return saved > max(AUTO_RECOMPUTE_FLOOR_SHARE * 16 * trained_params, AUTO_RECOMPUTE_MIN_BYTES)


def check_fits(config: ModelConfig, *, micro_batch_size: int, rows: int, seq_len: int, batch_invariant: bool,
               state_to_come: int, activation_bytes: int = 4, checkpointing: bool = False,
               available: int | None = None, where: str = "the trainer") -> TrainFootprint:
    """Refuse (:class:`MemoryBudgetError`) a step whose largest micro-batch (``min(micro_batch_size, rows)`` rows of
    ``seq_len`` tokens) and the state still to come pass ``available`` (default: :func:`available_bytes`; None
    there: nothing is checked). Returns the footprint."""
    mb = min(micro_batch_size, rows)
    kw = dict(batch_invariant=batch_invariant, state_to_come=state_to_come, activation_bytes=activation_bytes,
              checkpointing=checkpointing)
    fp = micro_batch_footprint(config, mb, seq_len, **kw)
    room = available_bytes() if available is None else available
    if room is None or fp.total <= room:
        return fp
    fits = next((k for k in range(mb - 1, 0, -1)
                 if micro_batch_footprint(config, k, seq_len, **kw).total <= room), 0)
    what = (f"policy.training.micro_batch_size: {micro_batch_size} does not fit in {where}'s memory: a micro-batch of "
            f"{mb} rows x {seq_len} tokens keeps about {fp.activations / GB:.2f} GB of activations for its backward"
            + (f", and the first step still allocates {fp.state_to_come / GB:.2f} GB of gradients, AdamW moments and "
               f"FP8 weight caches" if fp.state_to_come else "")
            + f" ({fp.total / GB:.2f} GB), but {room / GB:.2f} GB is available")
    if fits:
        raise MemoryBudgetError(f"{what}; micro_batch_size: {fits} fits (nothing was run)")
    hint = "" if checkpointing else ", policy.training.activation_checkpointing: true"
    raise MemoryBudgetError(f"{what}; even micro_batch_size: 1 does not fit: shorter sequences "
                            f"(data.max_prompt_tokens, policy.generation.max_new_tokens){hint} or a machine with more "
                            f"memory (nothing was run)")
