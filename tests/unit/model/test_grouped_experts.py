"""Grouped experts (fp8rl.model.grouped, fp8rl.fp8.grouped) against the per-expert reference loop of the same block.

Error model (the one place its bounds are named):

* forward under batch invariance: **bitwise**. A grouped expert's rows are padded to whole row tiles, the GEMM
  ``tiled_mm`` runs for that expert alone; FP8 activations are quantized per row either way.
* forward without invariance: the grouped GEMM and the loop's GEMM see other row counts, so the BLAS may sum over K
  in another order: FP32 rounding, ``|Δ| <= K·u·Σ_k |x_k w_k|`` per output (u = 2^-24), then one rounding to the
  block's dtype.
* weight gradients: the same operands in both (FP8: the 128-row scale groups of each expert start on its first row
  in both layouts, so codes and scales are equal); the grouped GEMM also adds the padding's exact zeros, so only the
  FP32 summation order over the expert's rows differs: ``|Δ| <= n·u·Σ_t |g_t x_t|`` with n the rows summed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8rl.fp8 import Fp8Recipe, convert_model
from fp8rl.fp8.grouped import fp8_grouped_linear
from fp8rl.fp8.linear import Fp8InferenceLinear, Fp8Linear
from fp8rl.model import CausalLM, ModelConfig
from fp8rl.model.grouped import group_layout, grouped_linear, wgrad_layout
from fp8rl.model.invariant import BatchInvariance, TiledLinear
from fp8rl.model.moe import SparseMoeBlock

U = 2.0 ** -24  # FP32 unit roundoff

CONFIG = dict(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=64, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=256, norm_topk_prob=True)


def _block(recipe: str, mode: str, invariant: bool, dtype=torch.float32, seed: int = 0) -> SparseMoeBlock:
    """One MoE block with O(1) activations: ``recipe`` bf16 (plain linears) or an FP8 format, ``mode`` train or
    inference."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig("qwen3_moe", **CONFIG)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    if recipe != "bf16":
        convert_model(model, Fp8Recipe(linear="fp8", scaling=recipe), mode=mode)
    if mode == "inference":
        model.eval()  # as the rollout holds it
    if invariant:
        model.set_batch_invariance(BatchInvariance())
    return model.model.layers[0].mlp


def _loop(block: SparseMoeBlock) -> SparseMoeBlock:
    ref = copy.deepcopy(block)
    ref.grouped = False
    return ref


RECIPES = [("bf16", "train"), ("blockwise", "train"), ("blockwise", "inference"), ("mxfp8", "train"),
           ("mxfp8", "inference")]


@pytest.mark.parametrize("recipe,mode", RECIPES)
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_grouped_experts_are_bitwise_the_per_expert_loop_under_invariance(recipe, mode, rows):
    """Decode-sized (1, 3 tokens: most experts get no row or one) and prefill-sized batches, each in bf16 and in
    FP32 activations; then each row alone must give its bits inside the batch (a row independent of the others in
    its group: the first three rows, each alone)."""
    for dtype in (torch.float32, torch.bfloat16):
        block = _block(recipe, mode, invariant=True, dtype=dtype)
        assert block.grouping() == ("dense" if recipe == "bf16" else "fp8")
        x = torch.randn(1, rows, CONFIG["hidden_size"]).to(dtype)
        with torch.no_grad():
            got, want = block(x), _loop(block)(x)
            alone = torch.cat([block(x[:, i:i + 1]) for i in range(min(rows, 3))], dim=1)
        assert torch.equal(got, want), (recipe, mode, rows, dtype, (got.float() - want.float()).abs().max())
        assert torch.equal(got[:, :3], alone), (recipe, mode, rows, dtype)


@pytest.mark.parametrize("recipe", ["bf16", "blockwise", "mxfp8"])
def test_one_grouped_projection_and_its_gradients_against_each_experts_own_linear(recipe):
    """One projection of every expert (the block's ``gate_proj``\\ s) on grouped rows — groups of 0, 1, 130 and 61
    rows — against each expert's own linear on its rows: forward bitwise (invariance on), dgrad and wgrad within the
    FP32 summation bounds of the module docstring, their majorants from the unquantized operands (E4M3 rounds each
    operand by at most 2^-4 relative: a factor (1 + 2^-4)^2 on the products)."""
    block = _block(recipe, "train", invariant=True)
    linears = [e.gate_proj for e in block.experts][:4]
    counts = [0, 1, 130, 61]
    experts = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    lay = group_layout(experts, 4, 8)
    w_plan = wgrad_layout(lay, experts, 4, 128)  # the trainer's wgrad layout
    x = torch.randn(sum(counts), CONFIG["hidden_size"])
    g = torch.randn(sum(counts), CONFIG["moe_intermediate_size"])
    xg = x.clone().requires_grad_()
    buf = lay.scatter(xg)
    if recipe == "bf16":
        out = lay.gather(grouped_linear(buf, [m.weight for m in linears], lay.offs))
    else:
        out = lay.gather(fp8_grouped_linear(buf, lay.offs, linears, invariant=True,
                                            wgrad=w_plan))
    out.backward(g)
    grouped_w = [m.weight.grad.clone() for m in linears]
    for m in linears:
        m.weight.grad = None
    start = 0
    majorant = (1 + 2.0 ** -4) ** 2 if recipe != "bf16" else 1.0
    for e, (m, n) in enumerate(zip(linears, counts, strict=True)):
        rows = slice(start, start + n)
        if n == 0:  # no row: an exact zero gradient (the loop never calls it)
            assert not grouped_w[e].any(), e
            continue
        xe = x[rows].clone().requires_grad_()
        want = m(xe)
        assert torch.equal(out[rows].detach(), want.detach()), e
        want.backward(g[rows])
        k_out = CONFIG["moe_intermediate_size"]
        dgrad_bound = k_out * U * majorant * (g[rows].abs() @ m.weight.detach().abs())
        assert ((xg.grad[rows] - xe.grad).abs() <= dgrad_bound).all(), e
        wgrad_bound = n * U * majorant * (g[rows].abs().t() @ x[rows].abs())  # a sum of the group's n rows
        assert ((grouped_w[e] - m.weight.grad).abs() <= wgrad_bound).all(), e
        m.weight.grad = None
        start += n


def test_an_expert_no_row_chose_gets_an_exact_zero_gradient():
    block = _block("blockwise", "train", invariant=True)
    x = torch.randn(1, 1, CONFIG["hidden_size"])  # 1 token, top-2: six of the eight experts unchosen
    block(x).sum().backward()
    ids, _ = block.gate(x.reshape(1, -1))
    chosen = set(ids.reshape(-1).tolist())
    for e, expert in enumerate(block.experts):
        for p in expert.parameters():
            assert p.grad is not None
            assert (p.grad.abs().sum() > 0) == (e in chosen), (e, chosen)


def test_the_layout_pads_groups_and_gives_the_tail_to_the_last():
    experts = torch.tensor([0, 0, 0, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3])  # sorted; expert 1 has no row
    lay = group_layout(experts, 4, 8)
    assert lay.rows == 48  # ⌈(13 + 4·7) / 8⌉·8, known without the counts
    assert lay.counts.tolist() == [3, 0, 1, 9]
    assert lay.offs.tolist() == [8, 8, 16, 48]
    assert lay.dst.tolist() == [0, 1, 2, 8, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    plain = group_layout(experts, 4, 1)
    assert plain.rows == 13 and plain.offs.tolist() == [3, 3, 4, 13] and plain.dst.tolist() == list(range(13))


class _HostSyncs(TorchDispatchMode):
    """Records the aten ops that read a tensor's data on the host or size an output by its data."""

    FORBIDDEN = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.nonzero", "aten.bincount", "aten.masked_select",
                 "aten.unique", "aten._unique", "aten.masked_scatter")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(self.FORBIDDEN):
            self.seen.append(name)
        if name.startswith("aten.index") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for a in args if isinstance(a, (list, tuple))
                for i in a):
            self.seen.append(f"{name} (boolean mask)")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_host_reads(monkeypatch):
    """``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()`` raise (on a CPU tensor the first and the last two never
    reach the dispatcher), the dispatcher records the rest (:class:`_HostSyncs`)."""
    def refuse(name):
        def method(self, *a, **k):
            raise AssertionError(f"Tensor.{name}() in the MoE forward or backward: a host sync")
        return method
    for name in ("tolist", "item", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    return _HostSyncs


@pytest.mark.parametrize("recipe", ["bf16", "blockwise"])
def test_the_grouped_forward_and_backward_never_sync_with_the_host(recipe, no_host_reads):
    """A step's passes, after the version's weights were quantized: that happens once per optimizer update (the
    weight caches), and checks the weights are finite on the host — the NaN-weight refusal, not the data path."""
    block = _block(recipe, "train", invariant=True)
    x = torch.randn(2, 9, CONFIG["hidden_size"], requires_grad=True)
    block(x).sum().backward()  # this version's FP8 weights, cached
    with no_host_reads() as mode:
        block(x).sum().backward()
    assert mode.seen == []


def test_the_sync_check_catches_the_per_expert_loop(no_host_reads):
    """Negative control: the reference loop reads its counts on the host."""
    block = _loop(_block("bf16", "train", invariant=False))
    x = torch.randn(1, 5, CONFIG["hidden_size"])
    with pytest.raises(AssertionError, match="tolist"), no_host_reads():
        block(x)
    with no_host_reads() as mode:
        torch.bincount(x.argmax(-1).reshape(-1), minlength=4)
    assert mode.seen == ["aten.bincount.default"]


def test_what_cannot_group_runs_the_loop():
    """Tensorwise FP8 scales each expert's rows as one tensor; LoRA-wrapped and hooked experts need their own call."""
    assert _block("tensorwise", "train", invariant=False).grouping() is None
    block = _block("blockwise", "inference", invariant=False)
    assert block.grouping() == "fp8" and type(block.experts[0].up_proj) is Fp8InferenceLinear
    handle = block.experts[3].down_proj.register_forward_hook(lambda *a: None)
    assert block.grouping() is None
    handle.remove()
    trained = _block("blockwise", "train", invariant=True)
    assert type(trained.experts[0].gate_proj) is Fp8Linear and trained.grouping() == "fp8"
    assert type(_block("bf16", "train", invariant=True).experts[0].gate_proj) is TiledLinear


def test_inference_stacks_are_rebuilt_when_a_refit_changes_a_weight():
    block = _block("blockwise", "inference", invariant=True)
    x = torch.randn(1, 6, CONFIG["hidden_size"])
    with torch.no_grad():
        before = block(x)
        fresh = _block("blockwise", "inference", invariant=True, seed=1)
        for mine, theirs in zip(block.experts, fresh.experts, strict=True):  # a refit: copies into the same buffers
            for name in ("gate_proj", "up_proj", "down_proj"):
                src = getattr(theirs, name)
                getattr(mine, name).load_quantized(src.weight, src.weight_scale)
        after = block(x)
        want = _loop(block)(x)
    assert not torch.equal(before, after) and torch.equal(after, want)
    assert set(block._stacks) == {"gate_proj", "up_proj", "down_proj"}  # kept per version while generating
    block.drop_stacks()
    assert block._stacks == {}


def test_a_trainers_held_dequantizations_are_stacked_once_per_version():
    """With the weight caches keeping their FP32 dequantization (the trainer's choice for small models), the grouped
    layer stacks them once per version and the caches then hold the stack's rows (one FP32 copy, not two); an update
    of a weight (the optimizer's in-place step) stacks again, and the numbers stay the per-expert loop's."""
    block = _block("blockwise", "train", invariant=True)
    for e in block.experts:
        for m in (e.gate_proj, e.up_proj, e.down_proj):
            m.weight_cache.keep_dequantized = True
    x = torch.randn(1, 6, CONFIG["hidden_size"])
    with torch.no_grad():
        block(x)
        stack = block._stacks["up_proj"].stack
        assert all(e.up_proj.weight_cache.dequantized._base is stack for e in block.experts)
        block(x)
        assert block._stacks["up_proj"].stack is stack  # the same version: not stacked again
        block.experts[2].up_proj.weight.add_(0.01)  # an update: its version counter moves
        got = block(x)
        assert block._stacks["up_proj"].stack is not stack
        want = _loop(block)(x)
    assert torch.equal(got, want)
