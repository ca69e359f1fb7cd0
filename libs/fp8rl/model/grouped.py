"""Grouped expert GEMMs: a mixture-of-experts layer's routed rows through every expert in one call, no host sync.

The per-expert loop (:class:`~fp8rl.model.moe.SparseMoeBlock` with ``grouped=False``) reads the expert counts on the
host (``.tolist()``) to slice each expert's rows, and runs one GEMM per expert and linear. Here the counts stay a
tensor and each of the three SwiGLU linears is one ``torch.nn.functional.grouped_mm`` over the expert-sorted rows
with the experts' weights stacked ``(E, N, K)`` (the CPU kernel multiplies each group by its expert; CUDA's is a real
grouped GEMM). Shapes: R routed rows, E experts, P rows of the grouped buffer.

**Layout** (:func:`group_layout`): each expert's rows are contiguous and in token order, its group padded with zero
rows to a multiple of ``multiple`` rows, and the last group takes the buffer's tail, so every buffer row belongs to a
group and the buffer's size ``P = ⌈(R + E·(multiple − 1)) / multiple⌉·multiple`` is known without reading the counts.

* ``multiple = 1`` (plain numerics): no padding, ``P = R``.
* batch-invariant numerics: ``multiple = row_tile``. A group of whole row tiles is the GEMM
  :func:`~fp8rl.fp8.linear.tiled_mm` runs for one expert's rows, so a row's expert output is bitwise the per-expert
  loop's and independent of the other rows in its group (``tests/unit/model/test_grouped_experts.py`` checks it on
  every recipe; it fails if a kernel ever breaks it).
* a trainable FP8 expert's wgrad (:mod:`fp8rl.fp8.grouped`): a second layout of ``multiple = 128``, the column-wise
  scale groups of wgrad (128 rows blockwise; 32 MXFP8 divides it), so no scale group straddles two experts and
  wgrad's operands are quantized exactly as the per-expert loop quantizes them; the GEMM then multiplies the routed
  rows taken back out of it (:func:`wgrad_layout`), not the up to ``E·127`` zero rows of its padding.

The backward (:class:`_GroupedLinearFn`, or the FP8 recipe's three GEMMs) keeps the experts' weights themselves, not
their stack. Every expert's weight takes part in every call, so an expert no row chose gets an exact zero gradient
(data-parallel gradient collectives see every parameter) with no special case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp8rl.fp8.grouped import StackedWeights

__all__ = ["GroupLayout", "group_layout", "grouped_linear", "wgrad_layout", "StackedWeights"]


@dataclass(frozen=True)
class GroupLayout:
    """Where each expert-sorted routed row sits in the grouped buffer (module docstring).

    Attributes:
        dst: ``(R,)`` int64, the buffer row of each expert-sorted row.
        offs: ``(E,)`` int32, the end of each expert's group (``grouped_mm``'s ``offs``); the last is ``rows``.
        rows: ``P``, the buffer's rows.
        counts: ``(E,)`` int64, each expert's routed rows.
    """

    dst: torch.Tensor
    offs: torch.Tensor
    rows: int
    counts: torch.Tensor

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``(R, C)`` expert-sorted rows -> the ``(P, C)`` buffer (zero rows in the padding); differentiable."""
        if self.rows == x.shape[0]:
            return x
        return x.new_zeros(self.rows, x.shape[1]).index_copy(0, self.dst, x)

    def gather(self, buf: torch.Tensor) -> torch.Tensor:
        """The ``(P, N)`` buffer's rows that hold routed rows, in expert-sorted order ``(R, N)``."""
        if self.rows == self.dst.shape[0]:
            return buf
        return buf.index_select(0, self.dst)


def wgrad_layout(layout: GroupLayout, experts_sorted: torch.Tensor, num_experts: int, multiple: int):
    """A trainable FP8 expert's wgrad plan (:func:`fp8rl.fp8.grouped.fp8_grouped_linear`'s ``wgrad``) over ``layout``'s
    buffer: ``(regroup, ungroup, offs)`` — move the buffer's rows into a layout of ``multiple``-row groups (where
    wgrad's operands are quantized along T, no scale group straddling two experts), take the routed rows back out of
    it (the GEMM multiplies them alone, not the padding's zero rows), and those rows' group ends."""
    w = group_layout(experts_sorted, num_experts, multiple, layout.counts)
    return (lambda t: w.scatter(layout.gather(t))), w.gather, layout.counts.cumsum(0).to(torch.int32)


def group_layout(experts_sorted: torch.Tensor, num_experts: int, multiple: int,
                 counts: torch.Tensor | None = None) -> GroupLayout:
    """The layout of routed rows sorted by expert (``experts_sorted``: ``(R,)`` expert ids, non-decreasing), each
    group padded to ``multiple`` rows; ``counts``: their histogram when another layout of the same rows has it. Only
    tensor ops of fixed shapes: nothing is read back to the host."""
    r = experts_sorted.numel()
    if counts is None:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=experts_sorted.device)
        counts.scatter_add_(0, experts_sorted, torch.ones_like(experts_sorted))  # a histogram of fixed length E
    if multiple == 1:
        ends = counts.cumsum(0)
        return GroupLayout(torch.arange(r, device=counts.device), ends.to(torch.int32), r, counts)
    padded = (counts + (multiple - 1)) // multiple * multiple
    ends = padded.cumsum(0)
    rows = -(-(r + num_experts * (multiple - 1)) // multiple) * multiple
    starts = counts.cumsum(0) - counts
    dst = (ends - padded)[experts_sorted] + torch.arange(r, device=counts.device) - starts[experts_sorted]
    offs = torch.cat([ends[:-1], ends.new_full((1,), rows)]).to(torch.int32)  # the last group takes the tail
    return GroupLayout(dst, offs, rows, counts)


class _GroupedLinearFn(torch.autograd.Function):
    """``grouped_mm`` of the buffer with the stacked expert weights whose backward keeps the weights themselves (the
    trainer holds them anyway), not the stack: autograd's own would save a copy of every expert's weight per layer
    as an activation. The backward stacks them again."""

    @staticmethod
    def forward(ctx, buf, offs, *weights):
        ctx.save_for_backward(buf, offs, *weights)
        return F.grouped_mm(buf, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad_out):
        buf, offs, *weights = ctx.saved_tensors
        g = grad_out.contiguous()
        grad_buf = F.grouped_mm(g, torch.stack(weights), offs=offs) if ctx.needs_input_grad[0] else None
        grads = (None,) * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grads = tuple(F.grouped_mm(g.t(), buf, offs=offs).unbind(0))  # (E, N, K): each group's rows summed
        return (grad_buf, None, *grads)


def grouped_linear(buf: torch.Tensor, weights, offs: torch.Tensor) -> torch.Tensor:
    """``(P, K)`` rows times each group's expert weight (``nn.Linear`` layout) -> ``(P, N)``. ``weights``: the
    per-expert ``(N, K)`` tensors (differentiable; the backward keeps them, not a stack), or one ``(E, N, K)`` stack a
    pass without gradients keeps (:class:`StackedWeights`)."""
    if isinstance(weights, torch.Tensor):
        return F.grouped_mm(buf, weights.transpose(1, 2), offs=offs)
    return _GroupedLinearFn.apply(buf, offs, *weights)
