"""The CPU shims megatron-core 0.16 needs to run a GPTModel (local layer spec) without CUDA.

Megatron-Core assumes a GPU in a few places that are not about the math. Each shim below replaces
exactly one of them with the same behaviour on the tensor's own device; none changes a number.
They are applied by an explicit, idempotent :func:`apply` (the Megatron trainer calls it when CUDA
is unavailable) — importing this module patches nothing. On a CUDA machine :func:`apply` is a
no-op, so the production path runs Megatron unmodified.

Why each exists (file paths are in ``megatron/core``):

1. ``utils.GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer with
   ``device=torch.cuda.current_device()``. The local ``DotProductAttention`` takes its ``baddbmm``
   input buffer from it (``beta=0``, so only the buffer's device and dtype matter). Shim: allocate
   on CPU, same caching by ``(name, dtype)``.
2. ``tensor_parallel.random.CudaRNGStatesTracker.fork`` saves/restores the *CUDA* RNG state around
   attention dropout (``DotProductAttention.forward`` forks on every call, even at dropout 0).
   Shim: on CPU the fork is a plain context; dropout then draws from the CPU generator, which the
   trainer checkpoints.
3. ``distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__`` (the gradient buffers of
   Megatron's ``DistributedDataParallel``) allocates them with ``device=torch.cuda.current_device()``.
   Shim: while *that constructor* runs, the current device is the CPU (a scoped swap of
   ``torch.cuda.current_device``, restored on exit; nothing else sees it). The buckets' all-reduce /
   reduce-scatter are plain ``torch.distributed`` calls, which gloo runs on CPU tensors.

4. ``tensor_parallel.mappings``'s gather / reduce-scatter helpers (``_gather_along_last_dim``,
   ``_gather_along_first_dim``, ``_reduce_scatter_along_last_dim``, ``_reduce_scatter_along_first_dim``: the
   tensor-parallel regions' collectives) allocate their output on ``torch.cuda.current_device()``. Shim: the
   same scoped swap while each runs (the autograd functions look the helpers up by module global name).

Two more CUDA-only spots are avoided rather than shimmed: the default causal mask
(``transformer.utils.get_default_causal_mask``, the trainer always passes an explicit mask) and
``RotaryEmbedding.get_emb`` (which moves ``inv_freq`` to CUDA; the trainer replaces that module
with :class:`~fp8rl.engines.megatron.model.RowPositionRotary`, which never calls it).

Never install bare ``transformer-engine`` on a CPU machine: its import fails and takes
``megatron.core`` down with it (the local spec needs no TE at all).
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch

__all__ = ["apply", "applied"]

_APPLIED = False


def applied() -> bool:
    """Whether :func:`apply` has patched Megatron in this process."""
    return _APPLIED


def _get_tensor_on_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """``GlobalMemoryBuffer.get_tensor`` with the buffer on CPU (shim 1)."""
    required = functools.reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        with (mem_alloc_context or contextlib.nullcontext)():
            buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, requires_grad=False)
    return buf[:required].view(*tensor_shape)


def _fork_on_cpu(self, name=None):
    """``CudaRNGStatesTracker.fork`` without a CUDA generator (shim 2)."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def _current_device_is_cpu():
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _on_cpu(fn):
    """``fn`` run with the CPU as the current device (shims 3 and 4)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _current_device_is_cpu():
            return fn(*args, **kwargs)

    return wrapped


_MAPPINGS_ALLOCATING = ("_gather_along_last_dim", "_gather_along_first_dim", "_reduce_scatter_along_last_dim",
                        "_reduce_scatter_along_first_dim")


def apply() -> bool:
    """Patch Megatron-Core for CPU execution, once per process.

    Returns:
        True when the shims are in place (now or from an earlier call), False on a CUDA machine
        where none is needed.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    from megatron.core import utils as mcore_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_utils.GlobalMemoryBuffer.get_tensor = _get_tensor_on_cpu
    mcore_random.CudaRNGStatesTracker.fork = _fork_on_cpu
    from megatron.core.tensor_parallel import mappings

    buffer = param_and_grad_buffer._ParamAndGradBuffer
    buffer.__init__ = _on_cpu(buffer.__init__)
    for name in _MAPPINGS_ALLOCATING:
        setattr(mappings, name, _on_cpu(getattr(mappings, name)))
    _APPLIED = True
    return True
