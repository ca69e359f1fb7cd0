"""FP8 grouped expert GEMMs: one linear of every expert over the grouped rows (:mod:`fp8rl.model.grouped`'s buffer).

The numbers are those of each expert's own FP8 linear (:class:`~fp8rl.fp8.linear.Fp8Linear` in the trainer,
:class:`~fp8rl.fp8.linear.Fp8InferenceLinear` in the rollout) on its rows, with the work done once per layer:

* forward: the buffer's activations quantized once (their scale groups are per row, so the grouping changes no
  code or scale), times each expert's weight in its FP8 form (the weight caches of the per-expert linears: one
  quantization per version, as before);
* dgrad: the output gradient quantized along N per row, times each expert's dgrad weight;
* wgrad: the gradient and the activation moved into a second layout whose every group starts on a multiple of
  128 rows (:func:`fp8rl.model.grouped.group_layout` with ``multiple=128``: the caller's ``regroup``) and quantized
  along T there, so no scale group straddles two experts and each expert's codes and scales are its own linear's;
  the routed rows taken back out (``ungroup``: the layout's zero rows would only add FLOPs), one K-grouped GEMM
  gives every expert's ``(N, K)`` gradient. The forward and dgrad GEMMs keep the compact layout
  (a 128-row padding per expert would double a small micro-batch's expert GEMMs). The forward keeps the compact
  activation in its own dtype for wgrad (one copy for gate and up, which read the same rows) and the backward
  quantizes it: an E4M3 copy in the 128-row layout would carry ``E·127`` padding rows per linear, more than the
  per-expert loop's activations on small micro-batches.

Formats: those whose ``groups_experts`` holds — blockwise and MXFP8 (per-row forward groups, T-grouped wgrad groups
that divide 128). Tensorwise scales one tensor per expert — a per-group amax — and stays on the per-expert loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import linear_format
from .linear import Fp8InferenceLinear, Fp8Linear, _reads_dequantized

__all__ = ["groups", "fp8_grouped_linear", "inference_weight", "StackedWeights"]


def groups(linears) -> bool:
    """Whether these per-expert FP8 linears (one projection of every expert) run as one grouped GEMM: all of one
    class and of one format that groups (:attr:`~fp8rl.fp8.formats.LinearFormat.groups_experts`), none frozen to FP8,
    on a device whose GEMM multiplies the dequantization (the reference backend; a fast-path grouped kernel is a GPU
    issue)."""
    first = linears[0]
    if type(first) not in (Fp8Linear, Fp8InferenceLinear) or not linear_format(first.scaling).groups_experts:
        return False
    if isinstance(first, Fp8Linear) and first.weight_cache is None:
        return False
    same = all(type(m) is type(first) and m.scaling == first.scaling and m.bias is None
               and m.pow2_activation_scale == first.pow2_activation_scale
               and getattr(m, "pow2_weight_scale", None) == getattr(first, "pow2_weight_scale", None)
               for m in linears)
    frozen = isinstance(first, Fp8Linear) and any(m.frozen_fp8 for m in linears)
    return same and not frozen and _reads_dequantized(linear_format(first.scaling), first.weight.device)


def inference_weight(m: Fp8InferenceLinear) -> torch.Tensor:
    """The rollout linear's FP32 dequantized weight: its per-version cache, else made now."""
    return m._w_dequant if m._w_dequant is not None else m.fmt.dequantize_weight(m.weight, m.weight_scale)


class StackedWeights:
    """One ``(E, N, K)`` stack of per-expert tensors, built again only when one of them changed (its identity or its
    version counter: a refit's ``copy_``, an optimizer step's new FP8 form). The stack is a copy: it costs the
    experts' weights once more, for as long as its owner keeps it — unless the owner replaces the tensors by the
    stack's rows (:meth:`rows`), which :meth:`get` then recognises."""

    __slots__ = ("_key", "stack")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self.stack: torch.Tensor | None = None

    def get(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if self.stack is not None and len(tensors) == self.stack.shape[0] and self._key == self.stack._version \
                and all(t._base is self.stack for t in tensors):
            return self.stack  # the tensors are the stack's own rows
        key = tuple((id(t), t._version, t.data_ptr()) for t in tensors)
        if key != self._key or self.stack is None:
            self.stack = torch.stack([t.detach() for t in tensors])
            self._key = key
        return self.stack

    def rows(self) -> list[torch.Tensor]:
        """The stack's rows as views (for the owner to hold instead of the tensors it stacked); :meth:`get` of them
        returns the stack while it is unchanged."""
        self._key = self.stack._version
        return list(self.stack.unbind(0))


class _Fp8GroupedFn(torch.autograd.Function):
    """The recipe's three GEMMs for one projection of every expert (module docstring)."""

    @staticmethod
    def forward(ctx, buf, offs, fmt, pow2_w, pow2_a, invariant, linears, wgrad, stacks, *weights):
        qs = [m.weight_cache.get(w, pow2_w, fmt) for m, w in zip(linears, weights, strict=True)]
        held = [m.weight_cache.dequantize_held() if m.weight_cache.keep_dequantized else None for m in linears]
        if stacks is not None and all(h is not None for h in held):  # the version's, stacked once
            w = stacks.get(held)
            for m, row in zip(linears, stacks.rows(), strict=True):  # the caches hold its rows: one FP32 copy
                m.weight_cache.dequantized = row
        else:
            w = torch.stack([h if h is not None else fmt.dequantize_weight(q, s)
                             for h, (q, s) in zip(held, qs, strict=True)])
        x = fmt.fake_act(buf, pow2_a, invariant)  # (P, K) FP32, per row: the grouping changes nothing
        out = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
        regroup, ungroup, offs_w = wgrad
        flat = [t for q, s in qs for t in (q, s)]
        # dgrad multiplies the forward's stack where the format allows (the held dequantizations: no second one)
        reuse = w if not fmt.dgrad_from_master and all(h is not None for h in held) else None
        # wgrad's operand: the compact buffer itself (gate and up share it), quantized along T in the 128-row layout
        # by the backward — its E4M3 form there would hold E·127 padding rows per linear
        ctx.save_for_backward(buf, offs, offs_w, reuse, *flat, *(weights if fmt.dgrad_from_master else ()))
        ctx.regroup, ctx.ungroup = regroup, ungroup
        ctx.n = len(linears)
        ctx.fmt, ctx.pow2_w, ctx.pow2_a = fmt, pow2_w, pow2_a
        ctx.dtypes = (buf.dtype, weights[0].dtype)
        return out.to(buf.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        buf, offs, offs_w, reuse = saved[:4]
        rest = saved[4:]
        qs = [(rest[2 * i], rest[2 * i + 1]) for i in range(ctx.n)]
        masters = rest[2 * ctx.n:] or (None,) * ctx.n
        fmt = ctx.fmt
        x_dtype, w_dtype = ctx.dtypes
        g = grad_out.contiguous()  # (P, N)
        grad_buf = grads_w = None
        if ctx.needs_input_grad[0]:
            w = reuse if reuse is not None else torch.stack(
                [fmt.weight_for_dgrad(m, q, s, ctx.pow2_w) for m, (q, s) in zip(masters, qs, strict=True)])
            grad_buf = F.grouped_mm(fmt.fake_grad_dgrad(g, ctx.pow2_a), w, offs=offs).to(x_dtype)  # (P, K)
        if any(ctx.needs_input_grad[9:]):
            g_cw = fmt.fake_grad_wgrad(ctx.regroup(g), ctx.pow2_a)  # (P', N) along T, the 128-row layout
            x_cw = fmt.load_act(fmt.save_act(ctx.regroup(buf), ctx.pow2_a))  # (P', K) along T, the same layout
            # (E, N, K): each group's routed rows summed (the layout's zero rows left out of the GEMM)
            gw = F.grouped_mm(ctx.ungroup(g_cw).t(), ctx.ungroup(x_cw), offs=offs_w)
            grads_w = tuple(gw.to(w_dtype).unbind(0))
        return (grad_buf, *(None,) * 8, *(grads_w or (None,) * ctx.n))


def fp8_grouped_linear(buf: torch.Tensor, offs: torch.Tensor, linears, *, invariant: bool,
                       stack: torch.Tensor | None = None, wgrad=None,
                       stacks: StackedWeights | None = None) -> torch.Tensor:
    """``(P, K)`` grouped rows through each group's expert linear (``linears``: one projection of every expert, of
    which :func:`groups` holds) -> ``(P, N)``. ``stack``: the rollout's stacked FP32 weights, when the caller keeps
    them per version (:class:`StackedWeights`). ``wgrad``: the trainer's ``(regroup, ungroup, offs)``
    (:func:`fp8rl.model.grouped.wgrad_layout`) — a function moving ``(P, ·)`` buffer rows into the 128-row layout
    (module docstring), one taking the routed rows back out of it, and those rows' group ends. ``stacks``: where the
    trainer keeps the stack of its version's held dequantizations
    (:attr:`fp8rl.fp8.linear.WeightCache.keep_dequantized`), so a version's passes stack them once."""
    first = linears[0]
    fmt = linear_format(first.scaling)
    if isinstance(first, Fp8Linear):
        if wgrad is None:
            raise ValueError("a trainable grouped FP8 linear needs its wgrad layout (regroup, offs)")
        return _Fp8GroupedFn.apply(buf, offs, fmt, first.pow2_weight_scale, first.pow2_activation_scale, invariant,
                                   list(linears), wgrad, stacks, *(m.weight for m in linears))
    w = stack if stack is not None else torch.stack([inference_weight(m) for m in linears])
    x = fmt.fake_act(buf, first.pow2_activation_scale, invariant)  # Fp8InferenceLinear.forward's reference GEMM
    return F.grouped_mm(x, w.transpose(1, 2), offs=offs).to(buf.dtype)
