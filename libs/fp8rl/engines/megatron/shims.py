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

5. ``pipeline_parallel.p2p_communication.P2PCommunicator._communicate`` / ``_communicate_shapes`` (the pipeline
   stages' send / receive) allocate their receive buffers on ``torch.cuda.current_device()`` and call
   ``torch.cuda.synchronize()`` after ``batch_isend_irecv`` (a guard against a NCCL race). Shim: while each runs,
   the current device is the CPU and ``synchronize`` is a no-op (gloo's ``wait()`` has already completed the
   transfer). The sends and receives are plain ``torch.distributed`` point-to-point calls, which gloo runs.
6. ``pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving`` (the 1F1B schedule) counts
   tokens in ``torch.zeros([], dtype=torch.int, device="cuda")``. Shim: while it runs, ``torch.zeros`` given
   ``device="cuda"`` allocates on the CPU (any other call passes through unchanged; on this machine that
   device string could only have raised). :func:`~megatron.core.pipeline_parallel.get_forward_backward_func`
   looks the schedule up by module global name, so it hands out the shimmed one.

7. ``models.common.language_module.LanguageModule.setup_embeddings_and_output_layer`` (pipeline stages with tied
   embeddings: the last stage's copy of the embedding is summed with the first stage's over the embedding group)
   moves the weight with ``weight.data.cuda()`` first. Shim: while that method runs, ``Tensor.cuda`` returns the
   tensor itself. (The trainer loads both copies from the same weights right after.)

Mixture-of-experts layers (``transformer/moe``) need two more:

8. ``router.Router.gating`` moves the router's weight (and bias) to ``torch.cuda.current_device()`` whenever it is on
   the CPU, on every call. Shim: while it runs, the current device is the CPU (the move is then to where it is).
9. ``moe_utils.RouterGatingLinearFunction`` calls ``te_general_gemm`` when it is not None, but without Transformer
   Engine the module never defines the name, so the router's logits raise ``NameError``. Shim: define it as None;
   the function then computes the logits with ``torch.mm`` in the router's dtype (FP32), which is its own fallback.

Expert parallelism (``expert_model_parallel_size`` > 1) and the ``alltoall`` dispatcher need three more:

10. ``token_dispatcher.MoEAlltoAllTokenDispatcher`` creates a ``torch.cuda.Stream`` in ``__init__`` (a class-level
    side stream for its device-to-host copies) and ``_maybe_dtoh_and_synchronize`` copies the split sizes to the host
    on it, then waits on a CUDA event. On CPU the tensors are already on the host but stay *tensors*, which
    ``all_to_all_single`` rejects as split sizes. Shim: no side stream (the class attribute is set to a placeholder
    so ``__init__`` skips creating one), and the method, at the same point, turns the split sizes into NumPy arrays
    as its CUDA branch does (``maybe_move_tensor_to_cpu(..., as_numpy=True)``); there is nothing to wait for.
11. ``tensor_parallel.mappings._AllToAll.forward`` (the dispatcher's all-to-all, forward and backward) allocates its
    uneven output on ``torch.cuda.current_device()``. Shim: the scoped current-device swap of shims 3-5.
12. ``tensor_parallel.mappings._gather_along_first_dim`` with uneven ``output_split_sizes`` calls
    ``torch.distributed.all_gather`` with tensors of different sizes, which gloo refuses ("invalid tensor size").
    Shim: on a gloo group, every rank's part padded to the largest, gathered, and cut back to its size — the
    same rows in the same order. (The uneven ``reduce_scatter`` it is paired with in backward runs on gloo.)

DeepSeek-V3 models (multi-latent attention, a router with an expert bias) need two more:

13. ``multi_latent_attention.MultiLatentAttention.__init__`` builds its ``RotaryEmbedding`` without passing
    ``use_cpu_initialization``, so its ``inv_freq`` goes to ``torch.cuda.current_device()``. Shim: the scoped
    current-device swap while the constructor runs. (The trainer then replaces that module with
    :class:`~fp8rl.engines.megatron.model.RowPositionRotary`, as for every other model.)
14. ``router.TopKRouter.__init__`` with ``moe_router_enable_expert_bias`` allocates ``expert_bias`` and
    ``local_tokens_per_expert`` on ``torch.cuda.current_device()``. Shim: the same scoped swap while it runs.
15. ``multi_latent_attention`` imports ``TELinear`` and ``TEColumnParallelLinear`` from Megatron's TE extension, which
    without Transformer Engine hands out ``MagicMock`` placeholders, and its constructor asks
    ``isinstance(self.linear_proj, TELinear)`` — a ``TypeError`` for a mock. Shim: when ``transformer_engine`` is not
    importable, the two module names are a class nothing is an instance of (every check then takes its no-TE branch,
    as with TE absent it should).

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
import importlib.util
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
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


@contextlib.contextmanager
def _cuda_zeros_on_cpu():
    saved = torch.zeros

    def zeros(*args, device=None, **kwargs):
        return saved(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.zeros = zeros
    try:
        yield
    finally:
        torch.zeros = saved


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = saved


def _within(context):
    """A decorator: the function run inside ``context()`` (a scoped swap, restored on exit)."""

    def wrap(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with context():
                return fn(*args, **kwargs)

        return wrapped

    return wrap


_on_cpu = _within(_current_device_is_cpu)  # the CPU as current device, a no-op synchronize (shims 3, 4, 5)
_schedule_on_cpu = _within(_cuda_zeros_on_cpu)  # torch.zeros(device="cuda") on the CPU (shim 6)
_stays_on_cpu = _within(_tensor_cuda_is_identity)  # Tensor.cuda the identity (shim 7)


class _NoTransformerEngine:
    """Stands for a Transformer Engine class where TE is absent: no object is an instance of it (shim 15)."""


_NO_STREAM = object()  # MoEAlltoAllTokenDispatcher's side stream on CPU: a placeholder, never used (shim 10)


def _splits_on_host(self, point: str, tokens_per_expert=None):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on CPU (shim 10): at the dispatcher's
    device-to-host point the split sizes become NumPy arrays, as the CUDA branch makes them; no stream, no event."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _uneven_gather_on_gloo(gather):
    """``mappings._gather_along_first_dim`` with uneven splits on a gloo group (shim 12): pad, gather, cut."""

    @functools.wraps(gather)
    def wrapped(input_, group, output_split_sizes=None, use_global_buffer=False):
        import torch.distributed as dist

        if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        most = max(sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)], dim=0)

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
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    comm = p2p_communication.P2PCommunicator
    comm._communicate = _on_cpu(comm._communicate)
    comm._communicate_shapes = _on_cpu(comm._communicate_shapes)
    schedules.forward_backward_pipelining_without_interleaving = _schedule_on_cpu(
        schedules.forward_backward_pipelining_without_interleaving)
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _stays_on_cpu(LanguageModule.setup_embeddings_and_output_layer)
    from megatron.core.transformer.moe import moe_utils, router

    router.Router.gating = _on_cpu(router.Router.gating)
    router.TopKRouter.__init__ = _on_cpu(router.TopKRouter.__init__)
    from megatron.core.transformer import multi_latent_attention

    mla = multi_latent_attention.MultiLatentAttention
    mla.__init__ = _on_cpu(mla.__init__)
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.TELinear = multi_latent_attention.TEColumnParallelLinear = _NoTransformerEngine
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer.moe import token_dispatcher

    a2a = token_dispatcher.MoEAlltoAllTokenDispatcher
    a2a.cuda_dtoh_stream = _NO_STREAM
    a2a._maybe_dtoh_and_synchronize = _splits_on_host
    mappings._AllToAll.forward = staticmethod(_on_cpu(mappings._AllToAll.forward))
    mappings._gather_along_first_dim = _uneven_gather_on_gloo(mappings._gather_along_first_dim)
    _APPLIED = True
    return True
