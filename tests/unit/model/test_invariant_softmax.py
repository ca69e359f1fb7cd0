"""The batch-invariant attention's softmax: its torch path (the definition: pairwise sums per key chunk, chunks added in
order) against an independent float32 reference, and the fused CPU kernels (``softmax_cpu.c`` in
``fp8rl.fp8.native``) against the torch path — bitwise, on masks with hidden keys, rows that see nothing, ragged
chunks, decode and prefill shapes, and scores with NaN / ±Inf; the fused backward within its error bound."""

import numpy as np
import pytest
import torch

from fp8rl.fp8 import native
from fp8rl.model.invariant import BatchInvariance, KeyLayout, _softmax_normalise, _split_kv_forward

needs_kernels = pytest.mark.skipif(not native.available(), reason="no C compiler: the fused kernels are not built")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, NaN payloads folded (a NaN is a NaN whichever path made it)."""
    def fold(t):
        return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)

    return a.shape == b.shape and torch.equal(fold(a), fold(b))


def _pairwise_f32(values: np.ndarray) -> np.float32:
    """The documented pairwise order, one float32 add at a time: halve the count, add the upper half onto the lower,
    an odd count's last term moves down."""
    a = [np.float32(x) for x in values]
    while len(a) > 1:
        h = len(a) // 2
        a = [np.float32(a[i] + a[i + h]) for i in range(h)] + a[2 * h:]
    return a[0]


@pytest.mark.parametrize("chunk", [1, 5, 7, 32])
def test_the_denominator_is_pairwise_per_chunk_then_chunk_order(chunk):
    g = torch.Generator().manual_seed(chunk)
    n_c = 3
    e = torch.rand(2, 1, 1, 4, n_c * chunk, generator=g) * torch.logspace(-8, 2, n_c * chunk)
    visible = torch.ones(2, 1, 1, 4, n_c * chunk, dtype=torch.bool)
    visible[1, ..., 2, chunk:] = False  # hidden keys of a row that sees some: exactly 0 in the sums
    p = _softmax_normalise(e.clone(), visible, chunk)
    for idx in np.ndindex(2, 4):
        row = e[idx[0], 0, 0, idx[1]].numpy() * visible[idx[0], 0, 0, idx[1]].numpy()
        denom = np.float32(0)
        for c in range(n_c):
            part = _pairwise_f32(row[c * chunk:(c + 1) * chunk])
            denom = part if c == 0 else np.float32(denom + part)
        want = (row / denom).astype(np.float32)
        assert np.array_equal(p[idx[0], 0, 0, idx[1]].numpy(), want), idx


def _layout(key_mask: torch.Tensor, past: int, t: int, chunk: int) -> KeyLayout:
    return KeyLayout.build(key_mask, past, t, BatchInvariance(kv_chunk=chunk))


CASES = [  # (B, H, Hkv, T new, past, chunk, left padding)
    (3, 6, 2, 45, 0, 32, False),  # the trainer's forward, GQA, right-aligned rows
    (3, 6, 2, 45, 0, 32, True),  # left padding: hidden keys before each row's first
    (4, 3, 3, 1, 40, 32, True),  # a decode step over a cache
    (2, 4, 1, 9, 0, 5, True),  # a ragged chunk size, MQA
    (2, 2, 2, 17, 3, 7, False),  # new tokens after 3 cached ones
]


def _inputs(B, H, Hkv, T, past, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, D = past + T, 16
    q = torch.randn(B, H, T, D, generator=g) * 3
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    mask = torch.ones(B, S, dtype=torch.long)
    if pad:
        for b in range(B):
            mask[b, :min(b * 3, S - 1)] = 0
    return q, k, v, mask


@needs_kernels
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rounded", [False, True])
def test_the_fused_softmax_is_bitwise_the_torch_path(case, rounded):
    from fp8rl.fp8.kv import QKVQuantizer

    B, H, Hkv, T, past, chunk, pad = case
    q, k, v, mask = _inputs(B, H, Hkv, T, past, pad)
    layout = _layout(mask, past, T, chunk)
    rounding = QKVQuantizer(fp8_attention=True).round_probs if rounded else None
    got = _split_kv_forward(q, k, v, layout, rounding, 0.3)
    with native.disabled():
        ref = _split_kv_forward(q, k, v, layout, rounding, 0.3)
    for name, a, b in zip(("out", "p", "used"), got[:3], ref[:3], strict=True):
        assert _same(a, b), name


@needs_kernels
def test_rows_that_see_nothing_and_non_finite_scores_are_bitwise_too():
    """A row with no visible key (uniform weights: finite garbage, as documented), a visible NaN or +Inf score (the
    row's probabilities all NaN), a visible -Inf score (probability 0; all NaN where every visible score is -Inf), a
    huge score, and a hidden +Inf (ignored)."""
    B, H, Hkv, T, D = 2, 2, 1, 6, 4
    q = torch.ones(B, H, T, D)
    k = torch.randn(B, Hkv, T, D, generator=torch.Generator().manual_seed(1))
    v = torch.randn(B, Hkv, T, D, generator=torch.Generator().manual_seed(2))
    k[0, 0, 2] = float("nan")  # visible to queries 2.. of row 0
    k[1, 0, 1] = float("inf")
    k[1, 0, 2] = k[1, 0, 3] = float("-inf")  # queries 2 and 3 of row 1 see only these: every visible score -Inf
    k[1, 0, 4] = 1e30
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0  # row 1: its first two keys hidden (the +Inf one among them)
    layout = _layout(mask, 0, T, 4)
    layout = type(layout)(**{**layout.__dict__, "visible": layout.visible.clone()})
    layout.visible[0, 0, 5] = False  # query 5 of row 0 sees nothing
    got = _split_kv_forward(q, k, v, layout, None, None)
    with native.disabled():
        ref = _split_kv_forward(q, k, v, layout, None, None)
    assert _same(got[1], ref[1]) and _same(got[0], ref[0])
    p = got[1]
    assert p[0, 0, :, 2:5].isnan().all() and not p[0, 0, :, :2].isnan().any()  # NaN from query 2 on; 5 sees none
    assert torch.equal(p[0, 0, :, 5], torch.full_like(p[0, 0, :, 5], 1 / p.shape[-1]))
    # row 1's canonical keys start at slot 2: slot 3 is its key 1
    assert p[1, 0, :, 2:4].isnan().all() and not p[1, 0, :, 4:].isnan().any() and (p[1, 0, :, 4:, 1] == 0).all()


@needs_kernels
def test_the_fused_backward_is_within_its_error_bound():
    """``ds = p (dp − Σ dp p)`` against float64: the FP32 sum of n products is within n·eps·Σ|dp p| (a sequential
    sum's bound), the subtraction and the product add an eps each, so every element is within
    (n + 2)·eps·p·(|dp| + Σ|dp p|), eps = 2**-24."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(50, 96, generator=g).softmax(-1)
    dp = torch.randn(50, 96, generator=g) * 4
    ref = p.double() * (dp.double() - (dp.double() * p.double()).sum(-1, keepdim=True))
    got = dp.clone()
    assert native.softmax_backward(got, p)
    n, eps = p.shape[-1], 2.0**-24
    bound = (n + 2) * eps * p.double() * (dp.double().abs() + (dp.double() * p.double()).abs().sum(-1, keepdim=True))
    assert bool(((got.double() - ref).abs() <= bound).all())
    # the kernels refuse what they cannot take (the caller then computes it with torch)
    assert not native.softmax_backward(dp.t(), p.t())
    assert not native.softmax_finish(p.clone(), torch.ones(1, 50, 96, dtype=torch.bool), 1, 1, 5)  # 96 % 5
