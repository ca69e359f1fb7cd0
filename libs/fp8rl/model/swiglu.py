"""SwiGLU's gating, ``silu(g) * u``, keeping two tensors for its backward instead of three.

Plain autograd keeps ``g`` (for silu's backward), ``silu(g)`` and ``u`` (for the product's): three F-wide FP32
tensors per token. :func:`swiglu` keeps ``g`` and ``u`` and recomputes ``silu(g)`` in the backward — one
elementwise op, next to nothing beside the MLP's GEMMs — the selective recompute Megatron-Core calls
"activation function recompute". Its forward and both gradients are the ops autograd would run, in the same
order (``silu``; the product's gradients ``grad * other``; ``aten.silu_backward``), so every number is bitwise
what ``F.silu(g) * u`` gives, forward and backward (``tests/unit/model/test_swiglu.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu"]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u = ctx.saved_tensors
        grad_g = grad_u = None
        if ctx.needs_input_grad[1]:
            grad_u = grad * F.silu(g)
        if ctx.needs_input_grad[0]:
            grad_g = torch.ops.aten.silu_backward(grad * u, g)
        return grad_g, grad_u


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u``; when autograd records, ``silu(g)`` is recomputed in the backward instead of kept."""
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _SwiGLU.apply(g, u)
    return F.silu(g) * u
