"""Batch-invariant numerics: the rollout's logprobs are bitwise the trainer's (issue 18).

The claim is exact equality, so every comparison here is ``torch.equal`` — no tolerance. The cases vary
what used to change the numbers: rows decoded together (rollout ``max_batch_size``), rows per trainer
micro-batch, prompt lengths (left padding in the rollout, right padding in the trainer), sequences that
cross KV-chunk boundaries, recipe (bf16, fp8_e2e) and KV cache (model dtype, FP8 with calibrated scales).
The negative control runs the same comparison with the flag off and must see differences.
"""

import numpy as np
import pytest
import torch

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import recipe_for_role
from fp8rl.fp8.kv import straight_through
from fp8rl.fp8.linear import tiled_mm
from fp8rl.model.invariant import BatchInvariance, KeyLayout, split_kv_attention

INV = BatchInvariance()


@pytest.fixture(scope="module")
def mixed_prompts():
    g = torch.Generator().manual_seed(1)
    # 2..40 tokens: with 20 new tokens rows end on both sides of the 32-key chunk boundary
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 19, 7, 40, 11, 3, 31)]


def _compare(model, prompts, recipe, kv, *, invariant, rollout_rows, trainer_rows, temperature=1.0,
             scaling="blockwise"):
    """(trainer logprobs, rollout logprobs) on the generated tokens, and the batch."""
    rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=invariant, scaling=scaling)
    tr = recipe_for_role(recipe, "trainer", kv_cache_dtype=kv, batch_invariant=invariant, scaling=scaling)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=rollout_rows)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=trainer_rows))
    if kv == "fp8":
        scales = QKVCalibrator(model, pad_token_id=0).calibrate(0, prompts)
        engine.load_scales(scales)
        if trainer.needs_qkv_scales:
            trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=temperature, max_tokens=20, n=2, seed=3))
    batch = build_train_batch(samples, torch.zeros(len(samples)), 2, 0)
    mask = batch.loss_mask.bool()
    return trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask], trainer, batch


@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("rollout_rows,trainer_rows", [(1, 14), (3, 5), (16, 1)])
def test_rollout_logprobs_are_bitwise_the_trainers(awkward, mixed_prompts, recipe, kv, rollout_rows, trainer_rows):
    trainer_lp, rollout_lp, _, _ = _compare(awkward, mixed_prompts, recipe, kv, invariant=True,
                                            rollout_rows=rollout_rows, trainer_rows=trainer_rows)
    assert trainer_lp.numel() > 100
    diff = (trainer_lp - rollout_lp).abs()
    assert torch.equal(trainer_lp, rollout_lp), (
        f"{int((diff > 0).sum())} of {diff.numel()} logprobs differ (max {float(diff.max()):.3g})")


@pytest.mark.parametrize("scaling", ["mxfp8", "tensorwise"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("rollout_rows,trainer_rows", [(1, 14), (3, 5)])
def test_every_fp8_recipe_variant_keeps_the_rollout_bitwise_the_trainer(awkward, mixed_prompts, scaling, kv,
                                                                        rollout_rows, trainer_rows):
    """Issue 32: MXFP8 (1x32 blocks along K, per token) and tensorwise (per-token forward activations under batch
    invariance: a tensor-wide amax would depend on the batch) on both sides, the same bits."""
    trainer_lp, rollout_lp, trainer, _ = _compare(awkward, mixed_prompts, "fp8_e2e", kv, invariant=True,
                                                  rollout_rows=rollout_rows, trainer_rows=trainer_rows,
                                                  scaling=scaling)
    assert {m.scaling for m in trainer.model.modules() if hasattr(m, "scaling")} == {scaling}
    assert trainer_lp.numel() > 100
    diff = (trainer_lp - rollout_lp).abs()
    assert torch.equal(trainer_lp, rollout_lp), (
        f"{int((diff > 0).sum())} of {diff.numel()} logprobs differ (max {float(diff.max()):.3g})")


def test_tensorwise_without_batch_invariance_differs(awkward, mixed_prompts):
    """Negative control for the variant above: per-tensor activation scales over each call's tokens (a decode step's
    rows vs the trainer's micro-batch) and the untiled GEMMs give other logprobs."""
    t, r, _, _ = _compare(awkward, mixed_prompts, "fp8_e2e", "auto", invariant=False, rollout_rows=3,
                          trainer_rows=14, scaling="tensorwise")
    assert not torch.equal(t, r)


def test_greedy_sampling_is_invariant_too(awkward, mixed_prompts):
    """Greedy decoding reports temperature-1 logprobs on both sides."""
    t, r, _, _ = _compare(awkward, mixed_prompts, "fp8_e2e", "auto", invariant=True, rollout_rows=5,
                          trainer_rows=3, temperature=0.0)
    assert torch.equal(t, r)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_negative_control_without_the_flag_logprobs_differ(awkward, mixed_prompts, recipe):
    """The same comparison with batch invariance off: decode GEMMs of a few rows and attention over the cache
    sum in another order than the trainer's full forward, so some logprobs differ — the check above can fail."""
    t, r, _, _ = _compare(awkward, mixed_prompts, recipe, "auto", invariant=False, rollout_rows=3, trainer_rows=14)
    assert not torch.equal(t, r)


def test_a_trainer_with_fp8_kv_refuses_to_run_without_the_versions_scales(awkward, mixed_prompts):
    _, _, trainer, batch = _compare(awkward, mixed_prompts, "fp8_e2e", "fp8", invariant=True, rollout_rows=16,
                                    trainer_rows=16)
    trainer.train_step(batch)  # version 0 -> 1 with version 0's scales
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    with pytest.raises(RuntimeError, match="QKV scales of weight version 1"):
        trainer.compute_logprobs(batch)
    assert trainer.model.kv_quantizers == []  # installed only during a pass: calibrators see high precision


def test_trainer_without_fp8_kv_takes_no_scales(awkward):
    trainer = TorchTrainer(awkward, recipe_for_role("fp8_e2e", "trainer", kv_cache_dtype="fp8"))
    assert not trainer.needs_qkv_scales  # without batch invariance the trainer's attention stays high precision
    with pytest.raises(ValueError, match="takes no QKV scales"):
        trainer.load_qkv_scales(QKVCalibrator(awkward, pad_token_id=0).calibrate(0, [[3, 4, 5]]))


# ------------------------------------------------------------------------------------------------------
# the primitives
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(192, 320), (320, 192), (32, 20)])
def test_tiled_mm_gives_a_row_the_same_bits_whatever_the_rows_around_it(k, n):
    """The property the design rests on: a row's product does not depend on how many rows are multiplied with it
    nor on its place in a tile. Fails on a BLAS whose kernel order depends on a row's position in the tile."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, k, generator=g), torch.randn(n, k, generator=g)
    full = tiled_mm(x, w.t(), INV.row_tile)
    for m in (1, 2, 5, 8, 17, 33):
        for start in (0, 3, 70 - m):
            assert torch.equal(tiled_mm(x[start:start + m], w.t(), INV.row_tile), full[start:start + m]), (m, start)
    # and it is the same product: within FP32 summation error of the plain GEMM (|err| <= k * 2**-24 * sum|x w|)
    ref = x.double() @ w.double().t()
    bound = k * 2.0**-24 * (x.abs().double() @ w.abs().double().t())
    assert bool(((full.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_tiled_mm_rows_are_invariant_over_every_tile_count_of_the_real_models_shapes(threads):
    """The padded plain GEMM's property over what the engines multiply: SmolLM2-135M's and tiny-arith's (K, N),
    every whole-tile row count from one decode tile to a training forward's 150 tiles, several thread counts
    (MKL splits rows between threads). Fails on a BLAS whose summation order over K depends on M."""
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, n in ((576, 1536), (1536, 576), (576, 192), (256, 768), (768, 256), (64, 64)):
            x, w = torch.randn(1200, k, generator=g), torch.randn(n, k, generator=g)
            full = tiled_mm(x, w.t(), INV.row_tile)
            for m in [*range(1, 3 * INV.row_tile + 1), *range(INV.row_tile * 4, 1200, INV.row_tile * 7), 1199]:
                assert torch.equal(tiled_mm(x[:m], w.t(), INV.row_tile), full[:m]), (k, n, m)
    finally:
        torch.set_num_threads(before)


def test_row_aligned_cache_holds_each_row_from_its_first_key_and_matches_slot_order():
    """align_rows: a left-padded row's keys start at position 0 (no gather in decode); the views read the same K/V
    a slot-ordered cache holds, shifted; FP8 storage too (scatter of the bytes)."""
    from fp8rl.model import KVCache

    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 3, 5])
    for dtype in (torch.float32, torch.float8_e4m3fn):
        plain, aligned = (KVCache(1, 3, 2, 12, 4, dtype=dtype) for _ in range(2))
        aligned.align_rows(offsets)
        for t in (6, 1, 1):  # a prefill of 6 slots, then two decode steps
            k, v = (torch.randn(3, 2, t, 4, generator=g).to(dtype) for _ in range(2))
            kp, _ = plain.update(0, k, v)
            ka, va = aligned.update(0, k, v, reach=10)
            assert ka.shape[2] == 10  # reaches the chunk the attention reads: a view, not a padded copy
            for b, off in enumerate(offsets.tolist()):
                n = kp.shape[2] - off
                assert torch.equal(ka[b, :, :n].float(), kp[b, :, off:].float())
            plain.advance(t)
            aligned.advance(t)
        with pytest.raises(RuntimeError, match="align_rows before the first write"):
            aligned.align_rows(torch.tensor([1, 1, 1]))
        aligned.align_rows(offsets)  # the same offsets again: fine
    with pytest.raises(ValueError, match="non-negative offsets"):
        KVCache(1, 3, 2, 12, 4).align_rows(torch.tensor([0, -1, 2]))


def test_row_aligned_fp8_reads_dequantize_what_each_row_wrote():
    """The dequantized reads of a row-aligned E4M3 cache: every position a row wrote (the prefill's, each decode
    step's — after the first read, only the entries written since are dequantized) equals dequantizing the
    storage; a reused session's bytes copied into the empty cache before the first read are dequantized too."""
    from fp8rl.model import KVCache

    def deq(kq, vq, dtype):
        return kq.to(dtype) * 0.5, vq.to(dtype) * 0.25

    g = torch.Generator().manual_seed(1)
    offsets = torch.tensor([0, 3, 5])
    cache = KVCache(1, 3, 2, 12, 4, dtype=torch.float8_e4m3fn)
    cache.align_rows(offsets)
    # a reused session's bytes: row 1's slots 3 and 4 (positions 0, 1), copied in as seed_cache does; the prefill
    # then starts at slot 5
    for store in (cache.k[0], cache.v[0]):
        store[1, :, :2] = torch.randn(2, 2, 4, generator=g).to(torch.float8_e4m3fn)
    cache.advance(5)
    for t in (3, 1, 1, 1):
        k, v = (torch.randn(3, 2, t, 4, generator=g).to(torch.float8_e4m3fn) for _ in range(2))
        kq, vq = cache.update(0, k, v)
        kd, vd = cache.read_dequantized(0, kq.shape[2], deq, torch.float32)
        cache.advance(t)
        for b, off in enumerate(offsets.tolist()):
            n = cache.length - off  # the positions row b holds
            want_k, want_v = deq(cache.k[0][b, :, :n], cache.v[0][b, :, :n], torch.float32)
            assert torch.equal(kd[b, :, :n], want_k) and torch.equal(vd[b, :, :n], want_v)
    assert kd[1, :, :2].abs().sum() > 0  # the seeded positions hold the session's numbers


def test_plain_gemm_rows_are_not_invariant_here_negative_control():
    """Why the tiles exist: a plain (M, K) GEMM of a few rows sums in another order than a big one (MKL's
    small-M path). Skipped on a BLAS where that does not happen — then the tiles cost little and change nothing."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(384, 256, generator=g)
    if all(torch.equal(x[:m] @ w.t(), (x @ w.t())[:m]) for m in (1, 2, 3)):
        pytest.skip("this BLAS gives small-M GEMM rows the same bits as large-M ones")
    assert torch.equal(tiled_mm(x[:2], w.t(), INV.row_tile), tiled_mm(x, w.t(), INV.row_tile)[:2])


@pytest.mark.usefixtures("native_path")  # the softmax's fused CPU kernels and the torch ops that define them
def test_split_kv_attention_is_softmax_attention_and_decode_equals_full():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 3, 6, 2, 45, 32
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hkv, Hkv))
    keys = torch.ones(B, T, dtype=torch.long)
    full = split_kv_attention(q, k, v, KeyLayout.build(keys, 0, T, INV))
    # reference: plain causal softmax attention in float64, within FP32 error
    rep = H // Hkv
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ kk.transpose(-1, -2) / D**0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref = s.softmax(-1) @ vv
    assert float((full.double() - ref).abs().max()) < 1e-5  # FP32 softmax + sums of <= 45 terms of |v| ~ 3
    # one query at a time over its prefix only (decode), with the row's keys behind left padding
    for t in (0, 31, 32, 44):
        pad = 5
        kp = torch.cat([torch.randn(B, Hkv, pad, D, generator=g), k[:, :, :t + 1]], 2)
        vp = torch.cat([torch.randn(B, Hkv, pad, D, generator=g), v[:, :, :t + 1]], 2)
        mask = torch.cat([torch.zeros(B, pad, dtype=torch.long), torch.ones(B, t + 1, dtype=torch.long)], 1)
        one = split_kv_attention(q[:, :, t:t + 1], kp, vp, KeyLayout.build(mask, pad + t, 1, INV))
        assert torch.equal(one, full[:, :, t:t + 1]), t


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
    from fp8rl.model.invariant import _softmax_normalise

    p = _softmax_normalise(e.clone(), visible, chunk)
    for idx in np.ndindex(2, 4):
        row = e[idx[0], 0, 0, idx[1]].numpy() * visible[idx[0], 0, 0, idx[1]].numpy()
        denom = np.float32(0)
        for c in range(n_c):
            part = _pairwise_f32(row[c * chunk:(c + 1) * chunk])
            denom = part if c == 0 else np.float32(denom + part)
        want = (row / denom).astype(np.float32)
        assert np.array_equal(p[idx[0], 0, 0, idx[1]].numpy(), want), idx


# The backward's error against a float64 reference: FP32 products summed over at most 2**7 terms (keys of a chunked
# row, query rows of a kv head) in another order than the reference's, each term's rounding 2**-24 of a magnitude
# within 2**3 of the largest gradient: 2**7 * 2**-24 * 2**3 = 2**-14 of the largest.
GRAD_ATOL = 2.0**-14


def _attention_grads(fn, q, k, v, g):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(g)
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("left_pad", [False, True])
def test_split_kv_attention_backward_is_softmax_attentions(left_pad):
    """The hand-written backward (``_SplitKVAttentionFn``) against autograd through float64 causal softmax attention
    over each row's own keys: right padding (a slice of the keys) and left padding (a gather), GQA, values wider
    than keys (MLA), a given score scale."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, T, D, Dv = 3, 6, 2, 40, 16, 24
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    v = torch.randn(B, Hkv, T, Dv, generator=g)
    lengths = torch.tensor([40, 27, 33])
    slots = torch.arange(T)[None, :]
    mask = (slots >= T - lengths[:, None]) if left_pad else (slots < lengths[:, None])
    layout = KeyLayout.build(mask.long(), 0, T, INV)
    go = torch.randn(B, H, T, Dv, generator=g)
    scale = 0.3

    def reference(q, k, v):
        rep = H // Hkv
        kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
        s = (q.double() @ kk.transpose(-1, -2)) * scale
        first = (T - lengths) if left_pad else torch.zeros(B, dtype=torch.long)
        seen = (slots[None, :, :] <= slots.T[None]) & mask[:, None, :]  # (B, T, T): causal, real keys
        s = s.masked_fill(~seen[:, None], float("-inf"))
        out = torch.nan_to_num(s.softmax(-1)) @ vv
        real = (slots[0][None, :] >= first[:, None]) & mask  # queries at real tokens
        return out * real[:, None, :, None]

    def ours(q, k, v):
        real = mask[:, None, :, None]
        return split_kv_attention(q, k, v, layout, scale=scale) * real

    got = _attention_grads(ours, q, k, v, go)
    ref = _attention_grads(reference, q, k, v, go.double())
    for name, a, b in zip("qkv", got, ref, strict=True):
        assert a.dtype == torch.float32
        err = float((a.double() - b).abs().max())
        assert err <= GRAD_ATOL * float(b.abs().max()), (name, err)


def test_split_kv_attention_backward_with_rounded_probs_is_autograds():
    """With FP8 probabilities (straight-through rounding) the backward equals autograd through the forward's own
    FP32 operations — the identity's gradient through the rounding, ``P'`` (the rounded) in ``dV``."""
    from fp8rl.fp8.kv import QKVQuantizer
    from fp8rl.model.invariant import _split_kv_forward

    g = torch.Generator().manual_seed(2)
    B, H, Hkv, T, D = 2, 4, 2, 37, 16
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hkv, Hkv))
    layout = KeyLayout.build(torch.ones(B, T, dtype=torch.long), 0, T, INV)
    go = torch.randn(B, H, T, D, generator=g)
    rounding = QKVQuantizer(fp8_attention=True).round_probs
    got = _attention_grads(lambda q, k, v: split_kv_attention(q, k, v, layout, rounding), q, k, v, go)
    ref = _attention_grads(lambda q, k, v: _split_kv_forward(q, k, v, layout, rounding, None)[0], q, k, v, go)
    for name, a, b in zip("qkv", got, ref, strict=True):
        err = float((a - b).abs().max())
        assert err <= GRAD_ATOL * float(b.abs().max()), (name, err)
    with torch.no_grad():  # and the forward is the same numbers whether autograd records or not
        plain = split_kv_attention(q, k, v, layout, rounding)
    assert torch.equal(plain, split_kv_attention(q.requires_grad_(), k, v, layout, rounding).detach())


def test_straight_through_keeps_forward_bits_and_passes_gradients():
    x = torch.randn(5, 7, requires_grad=True)
    y = straight_through(x, lambda t: t.to(torch.float8_e4m3fn).float())
    assert torch.equal(y, x.detach().to(torch.float8_e4m3fn).float())
    y.backward(torch.arange(35.0).view(5, 7))
    assert torch.equal(x.grad, torch.arange(35.0).view(5, 7))


def test_batch_invariance_settings_are_checked():
    with pytest.raises(ValueError, match="row_tile must be >= 8"):
        BatchInvariance(row_tile=4)
    with pytest.raises(ValueError, match="kv_chunk"):
        BatchInvariance(kv_chunk=0)
