"""The fused CPU kernels (``fp8rl.fp8.native``) against the torch paths they replace.

The quantizers: bitwise, on inputs built to reach every branch of the E4M3 rounding (normal and subnormal results,
ties, values past 448, -0, NaN, Inf, FP32 subnormals, all-zero and ragged groups) and a sweep over the FP32 bit
patterns. The torch path is itself checked against independent references in ``test_quant.py`` (which runs on both
paths); a kernel that rounded one value differently, read a scale off by one group, or wrote past a ragged edge fails
here. The batch-invariant attention's softmax: bitwise ``fp8rl.model.invariant``'s torch path (whose summation order
``tests/unit/engines/test_batch_invariance.py`` checks against a float32 reference) on masks with hidden keys, rows
that see nothing, ragged chunks, decode and prefill shapes, and scores with NaN / ±Inf; its backward within its
error bound."""

import os
import subprocess
import sys

import pytest
import torch

from fp8rl.fp8 import native
from fp8rl.fp8 import quant as Q
from fp8rl.fp8.kv import QKVQuantizer
from fp8rl.model.invariant import BatchInvariance, KeyLayout, _split_kv_forward

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the fused kernels are not built")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, NaN payloads folded (a NaN is a NaN whichever path made it)."""
    if t.dtype == torch.float32:
        return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)
    return t.view(torch.uint8)


def _same(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _hard(shape, seed=0):
    """Values over 70 binades with the special cases planted where groups and tiles begin and end."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-38, 3, shape[-1]).clamp(min=1e-38)
    flat = x.view(-1)
    n = flat.numel()
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-45, 448.0, 464.0, -470.0, 480.0,
                2.0 ** -6, 2.0 ** -9 * 1.5, 2.0 ** -10]
    for i, v in enumerate(specials):
        flat[(i * 131) % n] = v
    if shape[0] > 2:
        x[1].zero_()  # an all-zero row: its groups get scale 1
    return x


SHAPES = [(384, 576), (7, 130), (129, 100), (1, 5), (256, 1536), (200, 192)]


@pytest.mark.parametrize("shape", SHAPES)
def test_each_kernel_is_bitwise_the_torch_path(shape):
    x = _hard(shape)
    calls = {
        "fake_quantize_per_token_group": lambda: Q.fake_quantize_per_token_group(x),
        "quantize_per_token_group": lambda: Q.quantize_per_token_group(x),
        "quantize_columnwise": lambda: Q.quantize_columnwise(x),
        "fake_quantize_columnwise": lambda: Q.fake_quantize_columnwise(x),
        "quantize_blockwise": lambda: Q.quantize_blockwise(x.nan_to_num(0.0, 0.0, 0.0)),
        "quantize_per_tensor": lambda: Q.quantize_per_tensor(x, torch.tensor(0.37)),
        "round_to_e4m3": lambda: Q.round_to_e4m3(x),
    }
    for name, call in calls.items():
        fused = call()
        with native.disabled():
            ref = call()
        assert _same(fused, ref), name
    q, s = Q.quantize_columnwise(x)
    qb, sb = Q.quantize_blockwise(x.nan_to_num(0.0, 0.0, 0.0))
    qt, st = Q.quantize_per_tensor(x, torch.tensor(0.37))
    inverses = {
        "dequantize_columnwise": lambda: Q.dequantize_columnwise(q, s),
        "dequantize_blockwise": lambda: Q.dequantize_blockwise(qb, sb),
        "dequantize_per_tensor": lambda: Q.dequantize_per_tensor(qt, st),
    }
    for name, call in inverses.items():
        fused = call()
        with native.disabled():
            ref = call()
        assert _same(fused, ref), name


def test_every_float_pattern_rounds_as_torch_casts():
    """A sweep of FP32 bit patterns (every 4099th, both signs, NaN and Inf included) through each rounding: the
    scaled one (groups of 128 whose amax sets the scale) and the plain cast of the attention probabilities."""
    pos = torch.arange(0, 2 ** 31 - 1, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([pos, -pos])
    x = x[: x.numel() // 128 * 128].reshape(-1, 128).contiguous()
    for call in (lambda: Q.fake_quantize_per_token_group(x), lambda: Q.quantize_per_token_group(x),
                 lambda: Q.round_to_e4m3(x), lambda: Q.quantize_per_tensor(x, torch.tensor(1.0))):
        fused = call()
        with native.disabled():
            ref = call()
        assert _same(fused, ref)


def test_blockwise_writes_into_given_tensors_and_tells_autograd():
    """``out=`` (a refit shard's views; the weight cache's previous dequantization): the same numbers in the given
    tensors, whose version counters move (autograd refuses a saved tensor written behind its back)."""
    w = _hard((300, 260)).nan_to_num(0.0, 0.0, 0.0)
    q, s = Q.quantize_blockwise(w)
    out = (torch.empty_like(q), torch.empty_like(s))
    v0 = out[0]._version
    got = Q.quantize_blockwise(w, out=out)
    assert got[0] is out[0] and _same(got, (q, s)) and out[0]._version > v0
    into = torch.empty(q.shape)
    v1 = into._version
    assert Q.dequantize_blockwise(q, s, out=into) is into and into._version > v1
    with native.disabled():
        assert _same(into, Q.dequantize_blockwise(q, s))
    with pytest.raises(ValueError, match="out="):
        Q.dequantize_blockwise(q, s, out=torch.empty(3, 3))


def test_a_non_finite_weight_is_still_refused_by_name():
    w = torch.randn(256, 256)
    w[200, 3] = float("nan")
    with pytest.raises(ValueError, match="'layers.0.mlp.up_proj.weight'"):
        Q.quantize_blockwise(w, name="layers.0.mlp.up_proj.weight")


def test_a_recorded_graph_keeps_the_torch_path():
    """Autograd recording through a quantizer (a caller outside the recipe's own Functions): the torch path runs,
    graph and all, rather than a kernel autograd cannot see."""
    x = torch.randn(4, 256, requires_grad=True)
    y = Q.dequantize_per_tensor(*Q.quantize_per_tensor(x, torch.tensor(0.01)))
    with native.disabled():
        ref = Q.dequantize_per_tensor(*Q.quantize_per_tensor(x, torch.tensor(0.01)))
    assert y.requires_grad == ref.requires_grad and _same(y.detach(), ref.detach())


def test_thread_count_does_not_change_the_numbers():
    x = _hard((512, 1536), seed=3)
    lib = native._lib()
    outs = []
    for threads in (1, 2, 3):
        o = torch.empty_like(x)
        lib.fp8rl_fake_rows(x.data_ptr(), o.data_ptr(), x.shape[0], x.shape[1], 128, threads)
        c = torch.empty_like(x)
        lib.fp8rl_fake_cols(x.data_ptr(), c.data_ptr(), x.shape[0], x.shape[1], 128, threads)
        outs.append((o, c))
    assert all(_same(o, outs[0]) for o in outs[1:])


def test_without_a_compiler_the_torch_path_serves(tmp_path):
    """No compiler (a slim image): the kernels are not built, the quantizers still answer — the same numbers."""
    code = ("import torch; from fp8rl.fp8 import native, quant as Q\n"
            "assert not native.available()\n"
            "x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))\n"
            "torch.save(Q.fake_quantize_per_token_group(x), __import__('sys').argv[1])\n")
    env = {**os.environ, "CC": "/bin/false", "FP8RL_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "y.pt"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    assert _same(torch.load(out), Q.fake_quantize_per_token_group(x))


# --- the batch-invariant attention's softmax (softmax_cpu.c) against fp8rl.model.invariant's torch path -------------


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


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rounded", [False, True])
def test_the_fused_softmax_is_bitwise_the_torch_path(case, rounded):
    B, H, Hkv, T, past, chunk, pad = case
    q, k, v, mask = _inputs(B, H, Hkv, T, past, pad)
    layout = _layout(mask, past, T, chunk)
    rounding = QKVQuantizer(fp8_attention=True).round_probs if rounded else None
    got = _split_kv_forward(q, k, v, layout, rounding, 0.3)
    with native.disabled():
        ref = _split_kv_forward(q, k, v, layout, rounding, 0.3)
    for name, a, b in zip(("out", "p", "used"), got[:3], ref[:3], strict=True):
        assert _same(a, b), name


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
