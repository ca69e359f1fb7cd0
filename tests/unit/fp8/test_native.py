"""The fused CPU quantizers (``fp8rl.fp8.native``) against the torch path they replace: bitwise, on inputs built to
reach every branch of the E4M3 rounding (normal and subnormal results, ties, values past 448, -0, NaN, Inf, FP32
subnormals, all-zero and ragged groups) and a sweep over the FP32 bit patterns. The torch path is itself checked
against independent references in ``test_quant.py`` (which runs on both paths); a kernel that rounded one value
differently, read a scale off by one group, or wrote past a ragged edge fails here."""

import os
import subprocess
import sys

import pytest
import torch

from fp8rl.fp8 import native
from fp8rl.fp8 import quant as Q

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the fused quantizers are not built")


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
