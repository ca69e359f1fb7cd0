"""swiglu: bitwise plain autograd's numbers, forward and backward, with one F-wide tensor fewer kept."""

import torch
import torch.nn.functional as F

from fp8rl import memory
from fp8rl.model.swiglu import swiglu


def _run(fn, g0, u0, w):
    g, u = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    with memory.saved_for_backward(exclude=[g, u]) as saved:
        out = fn(g, u)
    (out * w).sum().backward()
    return out.detach(), g.grad, u.grad, sum(saved.values())


def test_forward_and_gradients_are_plain_autograds_bitwise_with_one_tensor_fewer():
    torch.manual_seed(0)
    g0, u0 = torch.randn(3, 50, 640) * 4, torch.randn(3, 50, 640)  # wide range: silu's tails included
    w = torch.randn(3, 50, 640)
    ref, got = _run(lambda g, u: F.silu(g) * u, g0, u0, w), _run(swiglu, g0, u0, w)
    for a, b in zip(ref[:3], got[:3], strict=True):
        assert torch.equal(a, b)
    width = g0.numel() * 4
    assert (ref[3], got[3]) == (width, 0)  # plain keeps silu(g) beyond g and u; swiglu keeps only g and u


def test_one_operand_without_grad_and_no_grad_mode():
    g0, u0 = torch.randn(8, 256), torch.randn(8, 256)
    g = g0.clone().requires_grad_()
    swiglu(g, u0).sum().backward()
    g_ref = g0.clone().requires_grad_()
    (F.silu(g_ref) * u0).sum().backward()
    assert torch.equal(g.grad, g_ref.grad)
    with torch.no_grad():
        assert torch.equal(swiglu(g0, u0), F.silu(g0) * u0)
