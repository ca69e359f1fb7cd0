"""fp8_linear / Fp8Linear / Fp8InferenceLinear against FP32 and dequantize-then-matmul references."""

import pytest
import torch
import torch.nn.functional as F

from fp8rl.fp8 import (
    Fp8InferenceLinear,
    Fp8Linear,
    dequantize_blockwise,
    dequantize_per_token_group,
    fp8_linear,
    quantize_blockwise,
    quantize_per_token_group,
)

# vs an FP32 linear on Gaussian data: both operands carry ≤ 2**-4 relative rounding error.
RTOL_VS_FP32 = 0.06  # relative Frobenius error bound, forward and both gradients
# vs the explicit dequantize-then-matmul reference: same products, only summation order differs.
ATOL_VS_DEQUANT = 1e-4
RTOL_VS_DEQUANT = 1e-5


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("t,k,n", [(16, 256, 384), (7, 576, 200), (33, 100, 130)])
def test_forward_backward_vs_fp32(t, k, n):
    torch.manual_seed(0)
    x = torch.randn(t, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True)
    dy = torch.randn(t, n)
    y = fp8_linear(x, w, b)
    y.backward(dy)
    gx, gw, gb = x.grad.clone(), w.grad.clone(), b.grad.clone()
    x.grad = w.grad = b.grad = None
    y_ref = F.linear(x, w, b)
    y_ref.backward(dy)
    assert rel_err(y, y_ref) < RTOL_VS_FP32
    assert rel_err(gx, x.grad) < RTOL_VS_FP32
    assert rel_err(gw, w.grad) < RTOL_VS_FP32
    assert torch.allclose(gb, b.grad, rtol=1e-5, atol=1e-5)  # bias grad is not quantized


def test_forward_matches_explicit_dequantize_then_matmul():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 300)
    w = torch.randn(200, 300)
    xq, xs = quantize_per_token_group(x)
    wq, ws = quantize_blockwise(w)
    ref = dequantize_per_token_group(xq, xs) @ dequantize_blockwise(wq, ws).t()
    y = fp8_linear(x, w)
    assert y.shape == (3, 5, 200)
    torch.testing.assert_close(y, ref, atol=ATOL_VS_DEQUANT, rtol=RTOL_VS_DEQUANT)


def test_backward_matches_explicit_blockwise_recipe():
    torch.manual_seed(2)
    x = torch.randn(40, 256, requires_grad=True)
    w = torch.randn(130, 256, requires_grad=True)
    dy = torch.randn(40, 130)
    fp8_linear(x, w).backward(dy)
    gq, gs = quantize_per_token_group(dy)
    wq, ws = quantize_blockwise(w.detach())
    dx_ref = dequantize_per_token_group(gq, gs) @ dequantize_blockwise(wq, ws)
    gtq, gts = quantize_per_token_group(dy.t())
    xtq, xts = quantize_per_token_group(x.detach().t())
    dw_ref = dequantize_per_token_group(gtq, gts) @ dequantize_per_token_group(xtq, xts).t()
    torch.testing.assert_close(x.grad, dx_ref, atol=ATOL_VS_DEQUANT, rtol=RTOL_VS_DEQUANT)
    torch.testing.assert_close(w.grad, dw_ref, atol=ATOL_VS_DEQUANT, rtol=RTOL_VS_DEQUANT)


def test_wrong_weight_scale_is_caught_by_the_reference():
    """Negative case: a GEMM fed a mismatched scale fails the tight reference comparison."""
    torch.manual_seed(3)
    x = torch.randn(8, 256)
    w = torch.randn(128, 256)
    wq, ws = quantize_blockwise(w)
    layer = Fp8InferenceLinear(256, 128)
    layer.load_quantized(wq, ws * 1.01)
    ref = fp8_linear(x, w)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(layer(x), ref, atol=ATOL_VS_DEQUANT, rtol=RTOL_VS_DEQUANT)


def test_fp8_linear_module_keeps_parameter_identity_and_trains():
    torch.manual_seed(4)
    lin = torch.nn.Linear(256, 128)
    w_id = id(lin.weight)
    fl = Fp8Linear.from_linear(lin)
    assert id(fl.weight) == w_id and fl.bias is lin.bias
    opt = torch.optim.SGD(fl.parameters(), lr=0.1)
    x = torch.randn(32, 256)
    target = torch.randn(32, 128)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = F.mse_loss(fl(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_inference_linear_matches_training_linear_and_refits_in_place():
    torch.manual_seed(5)
    lin = torch.nn.Linear(576, 200, bias=True)
    inf = Fp8InferenceLinear.from_linear(lin)
    x = torch.randn(4, 576)
    torch.testing.assert_close(inf(x), fp8_linear(x, lin.weight, lin.bias), atol=ATOL_VS_DEQUANT, rtol=RTOL_VS_DEQUANT)
    ptrs = (inf.weight.data_ptr(), inf.weight_scale.data_ptr())
    w2 = torch.randn(200, 576)
    inf.load_weight(w2)
    assert (inf.weight.data_ptr(), inf.weight_scale.data_ptr()) == ptrs
    torch.testing.assert_close(inf(x), fp8_linear(x, w2, lin.bias), atol=ATOL_VS_DEQUANT, rtol=RTOL_VS_DEQUANT)
    with pytest.raises(ValueError, match="shape"):
        inf.load_weight(torch.randn(10, 10))
    bad = w2.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        inf.load_weight(bad, name="layers.0.q_proj.weight")
    # the failed load left the previous weights serving
    torch.testing.assert_close(inf(x), fp8_linear(x, w2, lin.bias), atol=ATOL_VS_DEQUANT, rtol=RTOL_VS_DEQUANT)


def test_shape_mismatch_is_clear():
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.randn(2, 3), torch.randn(4, 5))


def test_the_weight_cache_quantizes_once_per_update_with_the_same_numbers():
    """Between two optimizer steps the FP8 weight is computed once; outputs and gradients are bitwise those of
    quantizing on every call, and an in-place update (optimizer step, load_state_dict) invalidates it."""
    import copy

    from fp8rl.fp8 import Fp8Linear

    torch.manual_seed(0)
    cached = Fp8Linear(256, 384, bias=True)
    plain = copy.deepcopy(cached)
    plain.weight_cache = None  # quantize per call
    assert cached.weight_cache is not None and plain.weight_cache is None
    opt_c, opt_p = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cached, plain))
    for step in range(3):
        for mb in range(3):  # micro-batches between two updates
            x = torch.randn(40, 256, generator=torch.Generator().manual_seed(10 * step + mb))
            ya, yb = cached(x), plain(x)
            assert torch.equal(ya, yb)
            ya.square().sum().backward()
            yb.square().sum().backward()
        assert torch.equal(cached.weight.grad, plain.weight.grad)
        for opt in (opt_c, opt_p):
            opt.step()
            opt.zero_grad()
        assert torch.equal(cached.weight, plain.weight)
    assert (cached.weight_cache.misses, cached.weight_cache.hits) == (3, 6)  # once per update, reused twice
    with torch.no_grad():
        cached.load_state_dict({k: v + 1 for k, v in cached.state_dict().items()})
    x = torch.randn(8, 256)
    fresh = copy.deepcopy(cached)
    fresh.weight_cache = None
    assert torch.equal(cached(x), fresh(x)) and cached.weight_cache.misses == 4  # the copy_ was seen


def test_no_pass_of_the_trainer_holds_an_fp32_copy_of_the_fp8_weight():
    """The trainer's FP8 linear keeps the weight's E4M3 form between calls and dequantizes per call in every pass
    (no-grad logprob passes and training forwards and backwards alike), with bitwise the outputs and gradients of a
    layer that quantizes per call — so it holds 1 byte per FP8 weight element, not 5. A dequantization a shared
    rollout took for its generation (``dequantize_held``) is released by the next pass."""
    import copy

    from fp8rl.fp8 import Fp8Linear

    torch.manual_seed(0)
    layer = Fp8Linear(256, 384, bias=True)
    plain = copy.deepcopy(layer)
    plain.weight_cache = None  # quantized and dequantized per call, nothing kept
    x = torch.randn(40, 256)
    with torch.no_grad():
        y0 = layer(x)
    cache = layer.weight_cache
    assert cache.dequantized is None and cache.q is not None
    held = cache.dequantize_held()  # what a shared rollout takes while it generates
    assert held is not None and cache.dequantized is held
    y = layer(x)
    assert cache.dequantized is None and cache.q is not None  # released, the E4M3 form kept
    assert torch.equal(y, y0) and torch.equal(y, plain(x))
    y.square().sum().backward()
    plain(x).square().sum().backward()
    assert torch.equal(layer.weight.grad, plain.weight.grad) and torch.equal(layer.bias.grad, plain.bias.grad)
    assert cache.dequantized is None
    with torch.no_grad():
        assert torch.equal(layer(x), y0) and cache.dequantized is None
    assert (cache.misses, cache.hits) == (1, 2)  # quantized once: the E4M3 form outlived every pass


@pytest.mark.parametrize("scaling", ["blockwise", "tensorwise", "mxfp8"])
def test_a_kept_dequantization_serves_every_pass_of_the_version_with_the_same_numbers(scaling):
    """``WeightCache.keep_dequantized`` (the trainer's choice for a small model): one FP32 dequantization per weight
    version, multiplied by every forward and (formats whose dgrad reads the forward form) by dgrad — outputs and
    gradients bitwise those of dequantizing per call, over updates, and a new version dequantizes again — into the
    previous version's tensor (no new allocation), which is then the new weight's numbers."""
    import copy

    torch.manual_seed(0)
    kept = Fp8Linear(256, 200, bias=True, scaling=scaling)  # 200: a ragged block
    plain = copy.deepcopy(kept)
    kept.weight_cache.keep_dequantized = True
    opt_k, opt_p = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (kept, plain))
    held, numbers = [], []
    for step in range(2):
        for mb in range(2):
            x = torch.randn(24, 256, generator=torch.Generator().manual_seed(10 * step + mb))
            xk, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            yk, yp = kept(xk), plain(xp)
            assert torch.equal(yk, yp)
            yk.square().sum().backward()
            yp.square().sum().backward()
            assert torch.equal(xk.grad, xp.grad)
            held.append(kept.weight_cache.dequantized)
            assert held[-1] is not None and plain.weight_cache.dequantized is None
            c = kept.weight_cache
            numbers.append(held[-1].clone())
            assert torch.equal(numbers[-1], c.fmt.dequantize_weight(c.q, c.scale))
        assert torch.equal(kept.weight.grad, plain.weight.grad) and torch.equal(kept.bias.grad, plain.bias.grad)
        for opt in (opt_k, opt_p):
            opt.step()
            opt.zero_grad()
    assert held[0] is held[1] and held[2] is held[3]  # one per version
    assert held[1] is held[2] and not torch.equal(numbers[1], numbers[2])  # the next written into the previous


def test_every_format_whose_dgrad_reads_the_forward_form_dequantizes_it_as_the_forward_does():
    """The rule the kept dequantization relies on (``LinearFormat.dgrad_from_master`` False): ``weight_for_dgrad``
    is bitwise ``dequantize_weight`` of the forward form."""
    from fp8rl.fp8.formats import format_names, linear_format

    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    checked = 0
    for name in format_names():
        fmt = linear_format(name)
        if fmt.dgrad_from_master:
            continue
        q, s = fmt.quantize_weight(w)
        assert torch.equal(fmt.weight_for_dgrad(w, q, s, False), fmt.dequantize_weight(q, s)), name
        checked += 1
    assert checked >= 2  # blockwise and tensorwise at least


def test_the_trainer_keeps_the_dequantization_of_a_small_model_only():
    from fp8rl.engines.footprint import DEQUANTIZED_CACHE_MAX_BYTES, keeps_dequantized_weights

    small = 100_000_000  # SmolLM2-135M's linears: 0.4 GB in FP32
    assert keeps_dequantized_weights(small, available=16 << 30)
    assert not keeps_dequantized_weights(small, available=2 << 30)  # more than an eighth of what is left
    assert not keeps_dequantized_weights(DEQUANTIZED_CACHE_MAX_BYTES // 4 + 1, available=1 << 40)
