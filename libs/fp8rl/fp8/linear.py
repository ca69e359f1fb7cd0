"""Block-scaled FP8 linear layers: the trainer's view (master weights) and the rollout's (frozen E4M3).

The recipe (DeepSeek-V3 / Transformer Engine "blockwise"):

* forward  ``y = x Wᵀ``: x quantized 1×128 (per token, 128 input channels), W 128×128 blocks.
* dgrad    ``dx = dy W``: dy quantized 1×128 along the output channels, W reuses its 128×128 tiles.
* wgrad    ``dW = dyᵀ x``: dy and the saved x are both quantized 1×128 *along the token dim*
  (the reduction dim of this GEMM), so every FP32 scale multiplies one contiguous 128-slice of
  the sum.

All three GEMMs accumulate in FP32. The saved activation is kept only in its column-wise E4M3
form (what wgrad needs), which is where the FP8 memory saving of the recipe comes from.

Weight quantization once per update: an :class:`Fp8Linear` keeps the E4M3 form of its master weight for as
long as the weight is the same tensor at the
same version counter — every in-place change (the optimizer's step, ``load_state_dict``'s ``copy_``) bumps
that counter — so the micro-batches and logprob passes between two optimizer updates quantize it once,
with bitwise the numbers of quantizing it per call. The cache costs 1 byte per weight element. On the
reference backend the GEMM multiplies by the FP32 dequantization. Where memory allows
(:func:`fp8rl.engines.footprint.keeps_dequantized_weights`: a small model's) the trainer has the cache keep it
(``WeightCache.keep_dequantized``): every pass of the version (logprobs, training forward and dgrad, calibration,
a shared rollout's decode steps) multiplies the one dequantization — on CPU the E4M3 -> FP32 conversion of a
weight costs more than a small micro-batch's GEMM with it (issue 53: 2x at 64 rows on SmolLM2's shapes). Otherwise
the trainer's passes dequantize per call (again in a training pass's backward) and release what the cache held, so
no pass of the trainer carries an FP32 copy of the FP8 weights (4 bytes per element more: issue 30's choice for
the larger models); a shared rollout keeps it (:meth:`WeightCache.dequantize_held`) while it generates,
where every decode step would dequantize again. The numbers are the same either way. It is off for weights
whose storage is swapped without a version bump (FSDP's unsharded parameters: :mod:`fp8rl.engines.parallel`
turns it off).

Precision budget (checked by tests): per element, each operand carries relative error ≤ 2**-4, so
a K-term dot product has error ≲ 2 · 2**-4 · Σ|x_k w_k|; against an FP32 linear the observed
relative Frobenius error is ~2–4 % on Gaussian data.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .backend import select_backend
from .formats import DEFAULT_SCALING, LinearFormat, linear_format
from .quant import (
    BLOCK,
    E4M3,
    dequantize_blockwise,
    dequantize_per_token_group,
    quantize_per_token_group,
)

__all__ = ["fp8_linear", "fp8_gemm", "tiled_mm", "pad_rows", "Fp8Linear", "Fp8InferenceLinear", "WeightCache",
           "weight_as_computed"]


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` ``(..., M, K)`` with zero rows appended up to a multiple of ``multiple``."""
    pad = -x.shape[-2] % multiple
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-2], pad, x.shape[-1])], dim=-2)


def tiled_mm(x: torch.Tensor, wt: torch.Tensor, row_tile: int) -> torch.Tensor:
    """``x @ wt`` for ``x`` ``(M, K)`` and ``wt`` ``(K, N)``, each row's result independent of ``M``.

    Batch-invariant numerics (:mod:`fp8rl.model.invariant`): ``x`` is zero-padded to a whole number of
    ``row_tile``-row tiles and multiplied by one plain GEMM. The BLAS's kernel choice, hence its summation
    order over ``K``, then never sees a small or ragged ``M`` (MKL sums rows of an ``M < 8`` product, and the
    ragged edge rows a thread gets, in another order); over whole tiles (8 rows by default) every row's numbers are
    the same for a decode step of 3 rows and a training forward of 3000 — checked for the model's shapes,
    1 to 4 threads and AVX2 / AVX-512 kernels by ``tests/unit/model/test_invariant.py``, which fails if a BLAS
    ever breaks it. The weight is packed once per GEMM, as in a plain linear (the earlier form, a batched
    GEMM of ``(row_tile, K)`` matrices, repacked it per tile: 2.5x a plain GEMM).
    """
    m = x.shape[0]
    if m % row_tile == 0:  # whole tiles already: the same GEMM, and no slice whose backward would zero-fill and copy
        return x @ wt  # an output-sized gradient (a 49k-vocabulary head's: 75 MB per micro-batch)
    return (pad_rows(x, row_tile) @ wt)[:m]


def fp8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    w_dequantized: torch.Tensor | None = None,
    row_tile: int | None = None,
) -> torch.Tensor:
    """``x Wᵀ`` for x ``(T, K)`` quantized 1×128 and W ``(N, K)`` quantized 128×128; FP32 accumulation.

    ``w_dequantized`` lets a frozen layer pass its cached FP32 ``dequantize_blockwise(w_q, w_scale)``
    to the reference path (same numbers, computed once per weight version instead of per call).
    ``row_tile`` (batch-invariant numerics) runs the reference GEMM as :func:`tiled_mm` on every backend (the fast
    path's kernels choose their tiling by shape).
    """
    backend = select_backend(x_q.device)
    if backend == "scaled_mm" and row_tile is None:  # batch-invariant numerics take the reference (fixed order)
        return _gemm_scaled_mm(x_q, x_scale, w_q, w_scale, out_dtype)
    x = dequantize_per_token_group(x_q, x_scale)
    w = w_dequantized if w_dequantized is not None else dequantize_blockwise(w_q, w_scale)
    out = x @ w.t() if row_tile is None else tiled_mm(x, w.t(), row_tile)
    return out.to(out_dtype)


def _gemm_scaled_mm(x_q, x_scale, w_q, w_scale, out_dtype):  # pragma: no cover - needs sm90
    """Hopper fast path. Checked against the reference by the ``gpu`` test tier."""
    t, k = x_q.shape
    n = w_q.shape[0]
    kp = -(-k // BLOCK) * BLOCK
    if kp != k:  # the kernel wants whole 128-wide K groups; zero padding adds exact zeros
        x_q = F.pad(x_q.view(torch.uint8), (0, kp - k)).view(E4M3)
        w_q = F.pad(w_q.view(torch.uint8), (0, kp - k)).view(E4M3)
    out = F.scaled_mm(
        x_q,
        w_q.t(),
        x_scale.float().t().contiguous().t(),  # 1x128 scales must be M-major
        F.ScalingType.BlockWise1x128,
        w_scale.float(),
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16 if out_dtype == torch.float32 else out_dtype,
    )
    return out[:t, :n].to(out_dtype)


_DEFAULT = linear_format(DEFAULT_SCALING)


def _reads_dequantized(fmt: LinearFormat, device: torch.device) -> bool:
    """Whether a GEMM under ``fmt`` on ``device`` multiplies the FP32 dequantization (every format but blockwise on a
    fast-path device)."""
    return not fmt.has_fast_gemm or select_backend(device) == "reference"


class WeightCache:
    """The FP8 form of one master weight at one version (see the module docstring)."""

    __slots__ = ("_ref", "_key", "q", "scale", "fmt", "dequantized", "hits", "misses", "frozen", "keep_dequantized",
                 "_spare")

    def __init__(self) -> None:
        self._ref, self._key = None, None
        self.q = self.scale = self.dequantized = None
        self.fmt: LinearFormat = _DEFAULT
        self.hits = self.misses = 0
        self.frozen = False  # holds a frozen weight's only form (Fp8Linear.freeze): never quantized again
        # keep the FP32 dequantization for the version's passes (the trainer's choice where memory allows:
        # fp8rl.engines.footprint.keeps_dequantized_weights) instead of releasing it on every get
        self.keep_dequantized = False
        # the previous version's FP32 dequantization, which the next one is written into (its pages are resident:
        # a fresh 4 bytes per weight element costs a page fault per 4 KiB, 5x the dequantization itself here)
        self._spare: torch.Tensor | None = None

    @classmethod
    def holding(cls, q: torch.Tensor, scale: torch.Tensor, fmt: LinearFormat) -> WeightCache:
        """A cache that is the frozen weight's FP8 form itself (``get`` returns it, whatever it is given)."""
        c = cls()
        c.q, c.scale, c.fmt, c.frozen = q, scale, fmt, True
        return c

    def get(self, weight: torch.Tensor, pow2: bool, fmt: LinearFormat | None = None) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        """``(w_q, w_scale)`` of ``weight`` in ``fmt``'s forward form (default blockwise) now, quantized only when
        it changed. Releases any FP32 dequantization held (:meth:`dequantize_held`) unless ``keep_dequantized``:
        then the trainer's passes multiply the one held for this version (4 bytes per weight element more), else
        they dequantize per call and the cache holds 1 byte per weight element."""
        fmt = fmt or _DEFAULT
        if self.frozen:
            if fmt.name != self.fmt.name:
                raise ValueError(f"a frozen {self.fmt.name} FP8 weight cannot be used as {fmt.name}")
            self.hits += 1
            if not self.keep_dequantized:
                self.dequantized = None
            return self.q, self.scale
        key = (weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape), pow2, fmt.name)
        if self._ref is not None and self._ref() is weight and self._key == key:
            self.hits += 1
        else:
            self.misses += 1
            self.q, self.scale = fmt.quantize_weight(weight.detach(), pow2=pow2)  # blockwise: (N, K), (N/128, K/128)
            self.fmt = fmt
            if self.keep_dequantized and self.dequantized is not None:
                self._spare = self.dequantized
            self.dequantized = None
            self._ref, self._key = weakref.ref(weight), key
        if not self.keep_dequantized:
            self.dequantized = self._spare = None
        return self.q, self.scale

    def dequantize_held(self) -> torch.Tensor | None:
        """The FP32 dequantization of the held E4M3 form (kept; built now if released), without looking at the
        weight again — None on backends whose GEMM reads E4M3 directly, or with nothing held."""
        if self.dequantized is None and self.q is not None and _reads_dequantized(self.fmt, self.q.device):
            spare, self._spare = self._spare, None
            usable = (spare is not None and spare.shape == self.q.shape and spare.dtype == torch.float32
                      and spare.is_contiguous())
            # a spare's old numbers: anything still holding them for autograd sees its version move (and refuses)
            self.dequantized = self.fmt.dequantize_weight(self.q, self.scale, out=spare if usable else None)
        return self.dequantized

    def __deepcopy__(self, memo) -> WeightCache:  # a copied module starts empty: its weight is another tensor
        if self.frozen:  # the copy holds the copied module's buffers (the same objects, through memo)
            return WeightCache.holding(copy.deepcopy(self.q, memo), copy.deepcopy(self.scale, memo), self.fmt)
        return WeightCache()


class _Fp8LinearFn(torch.autograd.Function):
    """The recipe's three GEMMs. On the reference backend each E4M3 operand goes straight to its FP32
    dequantization (:func:`fake_quantize_per_token_group`: the same numbers as quantizing and dequantizing,
    in one pass), and wgrad's operands, quantized 1x128 along T, stay token-major
    (:func:`quantize_columnwise`: the same codes and scales as quantizing the transpose, no transpose copy)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, pow2_w, pow2_a, cache=None, row_tile=None, fmt=None):
        fmt = fmt or _DEFAULT
        if cache is not None:
            w_q, w_s = cache.get(weight, pow2_w, fmt)
        else:
            w_q, w_s = fmt.quantize_weight(weight, pow2=pow2_w)  # blockwise: (N, K), (N/128, K/128)
        held = None  # the version's FP32 dequantization, where the cache keeps it
        if _reads_dequantized(fmt, x2d.device):
            x = fmt.fake_act(x2d, pow2_a, row_tile is not None)  # (T, K) FP32, E4M3 values x scales
            if cache is not None and cache.keep_dequantized:
                w = held = cache.dequantize_held()
            else:
                w = fmt.dequantize_weight(w_q, w_s)
            out = x @ w.t() if row_tile is None else tiled_mm(x, w.t(), row_tile)
        else:
            x_q, x_s = quantize_per_token_group(x2d, pow2_scale=pow2_a)  # (T, K), (T, K/128)
            out = fp8_gemm(x_q, x_s, w_q, w_s, torch.float32, row_tile=row_tile)
        if bias is not None:
            out = out + bias.float()
        # wgrad reduces over tokens: keep x only in its E4M3 form along T (blockwise: 1x128, token-major)
        saved_x = fmt.save_act(x2d, pow2_a)
        # a format whose dgrad quantizes the weight along N from the high-precision weight keeps it (a reference);
        # any other multiplies the forward form's dequantization in dgrad too: the held one, when there is one
        ctx.save_for_backward(*saved_x, w_q, w_s, weight if fmt.dgrad_from_master else None,
                              None if fmt.dgrad_from_master else held)
        ctx.n_saved_x = len(saved_x)
        ctx.fmt, ctx.pow2_w, ctx.pow2_a = fmt, pow2_w, pow2_a
        ctx.has_bias = bias is not None
        ctx.dtypes = (x2d.dtype, weight.dtype)
        return out.to(x2d.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        saved_x, (w_q, w_s, weight, held) = saved[:ctx.n_saved_x], saved[ctx.n_saved_x:]
        fmt = ctx.fmt
        x_dtype, w_dtype = ctx.dtypes
        g = grad_out.contiguous()  # (T, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # (N, K), quantized along N; the held forward dequantization is that (LinearFormat.dgrad_from_master)
            w = held if held is not None else fmt.weight_for_dgrad(weight, w_q, w_s, ctx.pow2_w)
            g_deq = fmt.fake_grad_dgrad(g, ctx.pow2_a)  # along N
            grad_x = (g_deq @ w).to(x_dtype)  # (T, K)
        if ctx.needs_input_grad[1]:
            g_cw = fmt.fake_grad_wgrad(g, ctx.pow2_a)  # (T, N): along T
            grad_w = (g_cw.t() @ fmt.load_act(saved_x)).to(w_dtype)  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0).to(w_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pow2_scale: bool = False,
    pow2_activation_scale: bool | None = None,
    weight_cache: WeightCache | None = None,
    row_tile: int | None = None,
    scaling: str = "blockwise",
) -> torch.Tensor:
    """Autograd-capable scaled FP8 ``F.linear`` (block-scaled by default).

    Args:
        x: ``(..., K)`` activations (any float dtype; the output has the same dtype).
        weight: ``(N, K)`` high-precision master weight; quantized 128×128 on every call.
        bias: optional ``(N,)``, added in FP32 after the FP8 GEMM.
        pow2_scale: power-of-two weight scales.
        pow2_activation_scale: power-of-two activation/gradient scales (defaults to ``pow2_scale``).
        weight_cache: keeps ``weight``'s FP8 form between calls while the weight is unchanged (None: quantize
            on every call).
        row_tile: batch-invariant forward GEMM (:func:`tiled_mm`), or None.
        scaling: the format of every operand (:mod:`fp8rl.fp8.formats`): ``blockwise``, ``mxfp8`` or
            ``tensorwise``.
    """
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: input has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    pow2_a = pow2_scale if pow2_activation_scale is None else pow2_activation_scale
    lead = x.shape[:-1]
    # the weight's FP32 dequantization: the one its cache keeps for the version (weight_cache.keep_dequantized), or
    # made per call (and again in a training pass's backward) — the same numbers (module docstring)
    out = _Fp8LinearFn.apply(x.reshape(-1, x.shape[-1]), weight, bias, pow2_scale, pow2_a, weight_cache, row_tile,
                             linear_format(scaling))
    return out.reshape(*lead, weight.shape[0])


class Fp8Linear(nn.Linear):
    """``nn.Linear`` drop-in that keeps high-precision master weights and computes in FP8.

    The trainer's view: the optimizer updates ``weight`` (BF16/FP32); every forward quantizes it
    128×128 and the input 1×128. :meth:`from_linear` reuses the original parameters, so parameter
    identity (and any optimizer state) survives conversion.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
                 pow2_weight_scale: bool = False, pow2_activation_scale: bool = False, scaling: str = "blockwise"):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.scaling = linear_format(scaling).name
        self.pow2_weight_scale = pow2_weight_scale
        self.pow2_activation_scale = pow2_activation_scale
        self.weight_cache: WeightCache | None = WeightCache()
        self.row_tile: int | None = None  # batch-invariant numerics (CausalLM.set_batch_invariance)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, pow2_weight_scale=False, pow2_activation_scale=False,
                    scaling: str = "blockwise") -> Fp8Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.scaling = linear_format(scaling).name
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.pow2_weight_scale = pow2_weight_scale
        new.pow2_activation_scale = pow2_activation_scale
        new.weight_cache = WeightCache()
        new.row_tile = None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(
            x, self.weight, self.bias,
            pow2_scale=self.pow2_weight_scale, pow2_activation_scale=self.pow2_activation_scale,
            weight_cache=self.weight_cache, row_tile=self.row_tile, scaling=self.scaling,
        )

    @property
    def frozen_fp8(self) -> bool:
        """Whether this layer holds its weight only in FP8 (:meth:`freeze`)."""
        return self.weight_cache is not None and self.weight_cache.frozen

    @torch.no_grad()
    def freeze(self) -> bool:
        """A frozen base layer (LoRA: its weight never trains) keeps only its weight's FP8 forward form: the
        ``weight`` parameter becomes an E4M3 buffer and ``weight_scale`` the format's scales (the layout a refit
        ships), the high-precision master is released. Forward and dgrad are the numbers they were (the same FP8
        form; blockwise and tensorwise dgrad multiply it). Returns False, keeping the master, for a format whose
        dgrad needs it (mxfp8).

        Raises:
            ValueError: the weight still trains.
        """
        if self.frozen_fp8:
            return True
        if self.weight.requires_grad:
            raise ValueError("freeze: the weight still trains (requires_grad); freeze only a frozen base")
        fmt = linear_format(self.scaling)
        if not fmt.freezes_to_fp8:  # its dgrad quantizes the weight along N from the master: kept
            return False
        q, s = fmt.quantize_weight(self.weight.detach(), pow2=self.pow2_weight_scale)
        del self.weight
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", s)
        self.weight_cache = WeightCache.holding(q, s, fmt)
        return True

    def refresh_weight_cache(self) -> None:
        """Quantize the weight now (after an optimizer step) rather than in the next forward: the same numbers,
        computed once per version either way (no-op without a cache). The FP32 dequantization is left to the
        next forward-only pass that needs it."""
        if self.weight_cache is not None:
            with torch.no_grad():
                self.weight_cache.get(self.weight, self.pow2_weight_scale, linear_format(self.scaling))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={self.scaling}, pow2_w={self.pow2_weight_scale}"


class Fp8InferenceLinear(nn.Module):
    """Frozen FP8 linear: E4M3 ``weight`` + ``weight_scale`` in its format's forward form (blockwise: FP32 per
    128×128 block; mxfp8: uint8 E8M0 per 1×32 along K; tensorwise: one FP32, shape ``(1, 1)``), W8A8 at run time.

    The rollout engine's view. The buffers are allocated once; :meth:`load_weight` and
    :meth:`load_quantized` write into them in place, so a refit never changes tensor identity
    (rebinding per step fragmented GPU memory in the reference implementation).

    On the reference backend the dequantized FP32 weight is cached per version (``_w_dequant``) so
    decode steps do not re-dequantize it; the numbers are identical to dequantizing per call.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 pow2_weight_scale: bool = False, pow2_activation_scale: bool = False, scaling: str = "blockwise",
                 device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.pow2_weight_scale = pow2_weight_scale
        self.pow2_activation_scale = pow2_activation_scale
        self.fmt = linear_format(scaling)
        self.scaling = self.fmt.name
        one = self.fmt.quantize_weight(torch.zeros(1, 1))[1].reshape(()).item()  # the scale of an all-zero block
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=E4M3, device=device))
        self.register_buffer("weight_scale", torch.full(self.scale_shape, one, dtype=self.fmt.scale_dtype,
                                                        device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.register_buffer("_w_dequant", None, persistent=False)
        self.row_tile: int | None = None  # batch-invariant numerics (CausalLM.set_batch_invariance)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, name: str | None = None, **kw) -> Fp8InferenceLinear:
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=linear.weight.device, **kw)
        if new.bias is not None:
            new.bias = new.bias.to(linear.bias.dtype)
        new.load_weight(linear.weight.detach(), linear.bias.detach() if linear.bias is not None else None, name=name)
        return new

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, name: str | None = None):
        """Quantize a high-precision ``(N, K)`` weight into the existing E4M3 buffers."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"{name or 'weight'}: shape {tuple(weight.shape)} != expected {(self.out_features, self.in_features)}"
            )
        q, s = self.fmt.quantize_weight(weight, pow2=self.pow2_weight_scale, name=name)
        self.load_quantized(q, s, bias, name=name)

    @property
    def scale_shape(self) -> tuple[int, int]:
        return self.fmt.scale_shape(self.out_features, self.in_features)

    @torch.no_grad()
    def load_quantized(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       *, name: str | None = None):
        """Copy an already-quantized weight (E4M3 + its format's scales) into the buffers."""
        label = name or "weight"
        shape, scale_shape = (self.out_features, self.in_features), self.scale_shape
        if q.dtype != E4M3 or tuple(q.shape) != shape:
            raise ValueError(f"{label}: expected E4M3 {shape}, got {q.dtype} {tuple(q.shape)}")
        self.fmt.check_scale(f"{label} weight_scale", scale, shape)  # shape, dtype, finite > 0 / no E8M0 NaN
        if self.weight.shape != shape:  # released (release_weight): the buffers again
            self.weight = torch.empty(shape, dtype=E4M3, device=self.weight.device)
            self.weight_scale = torch.empty(scale_shape, dtype=self.fmt.scale_dtype, device=self.weight_scale.device)
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"{label}: layer has no bias but one was given")
            self.bias.copy_(bias)
        self._refresh_cache()

    def release_weight(self) -> None:
        """Give up the E4M3 weight, its scales and the dequantization (zero-size buffers) until the next
        :meth:`load_weight` / :meth:`load_quantized` allocates them again (a shared rollout engine between its
        generations: :class:`fp8rl.engines.TorchRolloutEngine`)."""
        self.weight = self.weight.new_empty(0)
        self.weight_scale = self.weight_scale.new_empty(0)
        self._w_dequant = None

    @property
    def holds_weight(self) -> bool:
        return self.weight.numel() > 0

    def _refresh_cache(self) -> None:
        if _reads_dequantized(self.fmt, self.weight.device):
            held = self._w_dequant
            into = held if held is not None and held.shape == self.weight.shape and held.is_contiguous() else None
            self._w_dequant = self.fmt.dequantize_weight(self.weight, self.weight_scale, out=into)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if not _reads_dequantized(self.fmt, x2d.device):  # a fast-path device: the GEMM reads E4M3
            x_q, x_s = quantize_per_token_group(x2d, pow2_scale=self.pow2_activation_scale)
            out = fp8_gemm(x_q, x_s, self.weight, self.weight_scale, torch.float32, w_dequantized=self._w_dequant,
                           row_tile=self.row_tile)
        else:  # the trainer's reference GEMM exactly (_Fp8LinearFn.forward): the activation's FP32 fake quantization
            # in one pass (bitwise fp8_gemm's dequantize(quantize(x)), fewer ops per decode step)
            xd = self.fmt.fake_act(x2d, self.pow2_activation_scale, self.row_tile is not None)
            w = self._w_dequant if self._w_dequant is not None else self.fmt.dequantize_weight(self.weight,
                                                                                              self.weight_scale)
            out = xd @ w.t() if self.row_tile is None else tiled_mm(xd, w.t(), self.row_tile)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=w8a8 {self.scaling}"


class _ForwardFormFn(torch.autograd.Function):
    """An FP8 linear's weight as its forward multiplies it (the FP32 dequantization of its E4M3 form); the
    gradient goes straight through to the master weight, as the linear's own wgrad does."""

    @staticmethod
    def forward(ctx, weight, cache, pow2, fmt):
        q, s = cache.get(weight, pow2, fmt) if cache is not None else fmt.quantize_weight(weight.detach(), pow2=pow2)
        ctx.dtype = weight.dtype
        return fmt.dequantize_weight(q, s)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None, None, None


def weight_as_computed(linear: nn.Module) -> torch.Tensor | None:
    """The ``(N, K)`` FP32 matrix ``linear``'s forward multiplies its input by — its weight in a high-precision
    linear, the dequantization of its E4M3 form in an FP8 one (the trainer's :class:`Fp8Linear`, gradient straight
    through to the master; the rollout's :class:`Fp8InferenceLinear`: the same numbers from the same codes) — for a
    computation that uses the weight otherwise than as ``x Wᵀ`` (MLA's absorbed form: :mod:`fp8rl.model.mla`).

    None when the forward is not ``x Wᵀ`` with one such matrix: a layer with a LoRA adapter (its low-rank update
    is a separate product, dropout in training) or of another kind. The activation's 1×128 rounding in an FP8 linear
    is not part of it: a caller multiplies high-precision operands.
    """
    if hasattr(linear, "lora_A"):
        return None
    if isinstance(linear, Fp8Linear):
        fmt = linear_format(linear.scaling)
        return _ForwardFormFn.apply(linear.weight, linear.weight_cache, linear.pow2_weight_scale, fmt)
    if isinstance(linear, Fp8InferenceLinear):
        held = linear._w_dequant
        return held if held is not None else linear.fmt.dequantize_weight(linear.weight, linear.weight_scale)
    if isinstance(linear, nn.Linear):
        return linear.weight.float()
    return None
