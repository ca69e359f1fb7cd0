"""Token logprobs through bounded chunks of logits (fp8rl.model.logprobs) against the full-logits reference.

The reference is what the trainer computed before: ``token_logprobs_and_entropy(model(ids, attention_mask=mask),
ids, t, entropy=True)`` on the ``(B, T, V)`` logits, and ``loss.backward()`` through them. The chunk constant is
patched so that the ``B * (T-1)`` positions fall into three chunks, the last one ragged.

Claims and their error model:

* Forward: logprobs and entropy bitwise equal (``torch.equal``): per chunk the same elementwise ops as on the
  full logits, and the head's GEMM gives a row the same bits in a chunk as in the whole (by construction with
  batch invariance; measured here without it).
* Backward: the gradient reaching the final hidden states is bitwise equal (the backward recomputes a chunk's
  logits and runs the same graph per row; ``dh = dlogits @ W`` row by row), hence so is every parameter's
  gradient upstream of them. The head's weight gradient ``sum_n dlogits[n]ᵀ h[n]`` is the same FP32 sum of
  the same ``n`` products (``n`` = rows the reference's GEMM reduces over) taken in another order (chunk by
  chunk, then across chunks); each order is within ``γ_n · sum_n |dlogits[n]ᵀ| |h[n]|`` of the exact sum
  (``γ_n = n·u / (1 − n·u)``, ``u = 2⁻²⁴``), so the two are within twice that. A tied embedding's gradient adds
  the lookup's part to it: one more FP32 addition on each side, ``u`` of the result each.
* Memory: no tensor of ``B·(T-1)·V`` elements (the logits of the predicting positions) is saved for backward or
  produced by any op, forward or backward; the old path does both.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8rl.model.logprobs as chunked
from fp8rl.engines.logprob_pass import sequence_logprobs_and_entropy, token_logprobs_and_entropy
from fp8rl.fp8 import Fp8Recipe, convert_model
from fp8rl.model import CausalLM, KVCache, ModelConfig

V, B, T = 1000, 3, 40
CHUNK_ROWS = 40  # B * (T-1) = 117 positions: chunks of 40, 40 and 37 rows
U = 2.0**-24  # FP32 unit roundoff


def _config(tied: bool) -> ModelConfig:
    return ModelConfig(architecture="qwen2", vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked, "LOGPROB_CHUNK_ELEMENTS", CHUNK_ROWS * V)


@pytest.fixture(scope="module")
def bases() -> dict[bool, CausalLM]:
    out = {}
    for tied in (False, True):
        torch.manual_seed(11)
        out[tied] = CausalLM(_config(tied))
    return out


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 29:] = 0  # right padding, as the trainer's batches have
    mask[2, 36:] = 0
    return ids, mask


def _model(base: CausalLM, precision: str, invariant: bool) -> CausalLM:
    m = copy.deepcopy(base)
    if precision == "fp8":
        m = convert_model(m, Fp8Recipe(linear="fp8"), mode="train")
    if invariant:
        m.enable_batch_invariance()
    return m.train()


def _head_weight_name(tied: bool) -> str:
    return "model.embed_tokens.weight" if tied else "lm_head.weight"


def test_the_patched_chunks_are_three_with_a_ragged_last():
    head = torch.nn.Linear(8, V, bias=False)
    assert chunked._spans(B * (T - 1), head) == [(0, 40), (40, 80), (80, 117)]
    assert chunked.chunk_rows(V, 16) == 32  # whole tiles of the head's row tile
    assert chunked.chunk_rows(V, 12) == 24  # ... and of 8 rows
    assert chunked.chunk_rows(V, 64) == 64  # at least one tile
    assert chunked._spans(163, head)[-2:] == [(80, 120), (120, 163)]  # a 3-row tail joins the chunk before it


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("invariant", [False, True], ids=["plain", "batch_invariant"])
@pytest.mark.parametrize("precision", ["hp", "fp8"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logprobs_entropy_and_gradients_match_the_full_logits(bases, batch, tied, precision, invariant, temperature):
    ids, mask = batch
    model = _model(bases[tied], precision, invariant)
    hidden: list[torch.Tensor] = []

    def keep(_mod, _inp, out):  # the final hidden states of a pass with gradient, their gradient kept
        if out.requires_grad:
            out.retain_grad()
            hidden.append(out)

    hook = model.model.norm.register_forward_hook(keep)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(2))  # a loss that weighs tokens unevenly

    # reference: the (B, T, V) logits
    logits = model(ids, attention_mask=mask)
    logits.retain_grad()  # FP32 model: the head's own output
    ref_lp, ref_ent = token_logprobs_and_entropy(logits, ids, temperature, entropy=True)
    (ref_lp * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_dh, ref_h, dlogits = hidden[-1].grad, hidden[-1].detach(), logits.grad
    model.zero_grad(set_to_none=True)

    with torch.no_grad():  # the logprob pass
        lp0, ent0 = model(ids, attention_mask=mask, token_logprobs=True, temperature=temperature, entropy=True)
    lp, ent = model(ids, attention_mask=mask, token_logprobs=True, temperature=temperature, entropy=True)
    (lp * weights).sum().backward()
    hook.remove()

    for got in (lp0, lp):
        assert torch.equal(got, ref_lp)
    for got in (ent0, ent):
        assert torch.equal(got, ref_ent)
    assert not ent.requires_grad and lp.requires_grad
    assert torch.equal(hidden[-1].grad, ref_dh)

    head = _head_weight_name(tied)
    for name, p in model.named_parameters():
        if name != head:
            assert torch.equal(p.grad, ref_grads[name]), name
    # the head's weight gradient: the same FP32 sum over the reference's rows, reassociated (module docstring)
    n = dlogits.numel() // V
    gamma = n * U / (1 - n * U)
    terms = dlogits.double().abs().reshape(-1, V).t() @ ref_h.double().abs().reshape(-1, ref_h.shape[-1])  # (V, C)
    bound = 2 * gamma * terms
    ref, got = ref_grads[head].double(), dict(model.named_parameters())[head].grad.double()
    if tied:  # + the embedding lookup's gradient: one FP32 addition on each side
        bound = bound + 2 * U * (ref.abs() + bound)
    err = (got - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound.clamp(min=1e-300)).max()):.3g}"


def test_a_biased_head_gets_both_gradients():
    """The function itself on a plain ``nn.Linear`` with a bias (the model's head has none)."""
    torch.manual_seed(3)
    n, c = 117, 32
    head = torch.nn.Linear(c, V)
    h = torch.randn(n, c, requires_grad=True)
    targets = torch.randint(0, V, (n,))
    g = torch.rand(n)
    ref = torch.log_softmax(head(h).float() / 0.7, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    (ref * g).sum().backward()
    ref_dh, ref_dw, ref_db = h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    h.grad = head.weight.grad = head.bias.grad = None

    lp, ent = chunked.chunked_token_logprobs(h, head, targets, 0.7)
    (lp * g).sum().backward()
    assert ent is None and torch.equal(lp, ref)
    assert torch.equal(h.grad, ref_dh)
    gamma = n * U / (1 - n * U)
    dlogits = (torch.nn.functional.one_hot(targets, V) - torch.softmax(head(h).double() / 0.7, -1)) * g[:, None] / 0.7
    w_bound = 2 * gamma * (dlogits.abs().t() @ h.detach().double().abs())
    b_bound = 2 * gamma * dlogits.abs().sum(0)
    assert bool(((head.weight.grad.double() - ref_dw.double()).abs() <= w_bound).all())
    assert bool(((head.bias.grad.double() - ref_db.double()).abs() <= b_bound).all())


class _LargestOutput(TorchDispatchMode):
    """The most elements any op's tensor output had while active (forward and backward on the CPU alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_saved_and_produced(model: CausalLM, ids, mask, full_logits: bool) -> tuple[int, int]:
    """(most elements of a non-parameter tensor saved for backward, most elements of any op's output) over one
    training forward and backward (the trainer's ``_backward`` pass, or the old full-logits one)."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.data_ptr() not in params:
            saved = max(saved, t.numel())
        return t

    with _LargestOutput() as produced:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if full_logits:
                lp, ent = token_logprobs_and_entropy(model(ids, attention_mask=mask), ids, 0.7, entropy=True)
            else:
                lp, ent = sequence_logprobs_and_entropy(model, ids, mask, 0.7, entropy=True)
        lp.sum().backward()
    return saved, produced.largest


@pytest.mark.parametrize("invariant", [False, True], ids=["plain", "batch_invariant"])
def test_no_tensor_of_the_full_logits_size_is_saved_or_made(bases, batch, invariant):
    ids, mask = batch
    model = _model(bases[False], "hp", invariant)
    full = B * (T - 1) * V
    saved, produced = _largest_saved_and_produced(model, ids, mask, full_logits=False)
    assert saved < full and produced < full, (saved, produced, full)
    # the old path: the log-softmax of the predicting positions is saved, the (B, T, V) logits are made
    old_saved, old_produced = _largest_saved_and_produced(model, ids, mask, full_logits=True)
    assert old_saved >= full and old_produced >= B * T * V


def test_logits_of_the_last_positions_are_those_of_the_full_forward(bases, batch):
    """Batch-invariant numerics: the rollout's prefill (``logits_to_keep=1``, with a cache) and the full forward."""
    ids, mask = batch
    model = _model(bases[True], "hp", invariant=True).eval()
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        assert torch.equal(model(ids, attention_mask=mask, logits_to_keep=5), full[:, -5:])
        cache = KVCache.for_model(model, B, T)
        last = model(ids, attention_mask=mask, kv_cache=cache, logits_to_keep=1)
    assert last.shape == (B, 1, V) and torch.equal(last, full[:, -1:])


def test_arguments_are_checked_and_a_single_token_has_no_logprob(bases):
    model = _model(bases[False], "hp", invariant=False)
    ids = torch.randint(3, V, (2, 1))
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, token_logprobs=True, logits_to_keep=1)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)
    with pytest.raises(ValueError, match="token_logprobs"):
        model(ids, entropy=True)
    lp, ent = model(ids, token_logprobs=True, entropy=True)
    assert torch.equal(lp, torch.zeros(2, 1)) and torch.equal(ent, torch.zeros(2, 1))
    lp.sum().backward()  # nothing to differentiate but the graph is whole
