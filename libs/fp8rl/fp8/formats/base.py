"""What every FP8 scaling format answers (:class:`LinearFormat`): its weight's forward form and scale, each training
GEMM operand as an FP32 dequantization, and what it refuses.

Each orientation is quantized from the high-precision tensor, never from another quantized copy. The weight's
forward form is what a rollout holds and what a refit ships (``X.weight`` E4M3 + ``X.weight_scale``); its scale
tensor has :meth:`LinearFormat.scale_shape` and :attr:`LinearFormat.scale_dtype`.

On the reference backend every quantized operand enters its GEMM as its FP32 dequantization (the ``fake_*``
methods: the same numbers as quantizing and dequantizing).
"""

from __future__ import annotations

import torch

from ..quant import check_finite

__all__ = ["LinearFormat", "VLLM_BLOCKWISE_ONLY"]

# why fp8rl's vLLM rollout runs one format only (the formats it cannot load say it)
VLLM_BLOCKWISE_ONLY = ("fp8rl's vLLM rollout loads block-scaled FP8 checkpoints only (E4M3 weights with 128x128 FP32 "
                       "weight_scale_inv, vLLM's weight_block_size)")


class LinearFormat:
    """One scaling format (the table of :mod:`fp8rl.fp8.formats`). Stateless; :func:`linear_format` returns the
    registered instance."""

    name: str = ""
    scale_dtype: torch.dtype = torch.float32
    label: str = ""  # what the observatory and the benches print for it (short)
    summary: str = ""  # one phrase for the job file's documentation of fp8_recipe
    # dgrad multiplies the forward form's transpose, so a frozen (LoRA base) layer needs only its FP8 weight
    freezes_to_fp8: bool = True
    # dgrad quantizes the weight along N from the high-precision master (the forward saves a reference to it); False:
    # dgrad multiplies the forward form's dequantization (weight_for_dgrad is dequantize_weight of it, so the FP32
    # form a trainer's weight cache keeps serves both GEMMs)
    dgrad_from_master: bool = False
    # a Hopper fast path (fp8rl.fp8.linear.fp8_gemm) exists; without one every device runs the reference GEMMs
    has_fast_gemm: bool = False
    # a layer's experts can share one grouped GEMM (fp8rl.fp8.grouped): the forward and dgrad scale groups are per
    # row and wgrad's along T divide 128 rows. False (one scale per tensor): each expert's own call, per-expert scales
    groups_experts: bool = True
    # engine -> why it cannot run this format (one not listed runs it)
    refusals: dict[str, str] = {}

    def refusal(self, engine: str, *, tensor_parallel: int = 1) -> str | None:
        """Why ``engine`` (``"torch"``, ``"vllm"``, ``"megatron"``) cannot run FP8 linears of this format with
        ``tensor_parallel`` ranks per layer, or None when it can."""
        return self.refusals.get(engine)

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """Shape of the scale of an ``(n, k)`` weight in its forward form."""
        raise NotImplementedError

    def block_size(self, n: int, k: int) -> tuple[int, int]:
        """The ``(rows, cols)`` of weight elements one scale covers (the refit manifest records it)."""
        raise NotImplementedError

    def quantize_weight(self, w: torch.Tensor, *, pow2: bool = False, name: str | None = None,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E4M3 (n, k), scale)`` of a 2-D high-precision weight in its forward form; ValueError on NaN/Inf.
        ``out`` (blockwise only) writes into given tensors."""
        raise NotImplementedError

    def dequantize_weight(self, q: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 ``(n, k)`` of a weight's forward form; written into ``out`` (a contiguous FP32 ``(n, k)`` tensor, e.g.
        the previous version's, whose pages are already the process's) when given."""
        raise NotImplementedError

    @staticmethod
    def _into(r: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``r``, copied into ``out`` when one is given (a format with no direct-write path)."""
        return r if out is None else out.copy_(r)

    def check_scale(self, name: str, s: torch.Tensor, weight_shape: tuple[int, int]) -> None:
        """ValueError naming ``name`` unless ``s`` is a valid scale of an ``weight_shape`` weight (shape, dtype,
        value range)."""
        want = self.scale_shape(*weight_shape)
        if tuple(s.shape) != want:
            raise ValueError(f"{name}: shape {tuple(s.shape)} != expected {want} ({self.name} scales)")
        if s.dtype != self.scale_dtype:
            raise ValueError(f"{name}: dtype {s.dtype} != {self.scale_dtype} ({self.name} scales)")
        check_finite(s, name)
        if not bool((s > 0).all()):
            raise ValueError(f"{name}: scales must be > 0")

    # the training GEMMs' operands, as FP32 dequantizations
    def fake_act(self, x: torch.Tensor, pow2: bool, invariant: bool) -> torch.Tensor:
        """The forward activation ``(T, K)`` quantized along K; ``invariant``: batch-invariant numerics."""
        raise NotImplementedError

    def save_act(self, x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, ...]:
        """What the forward keeps of ``x`` for wgrad: its E4M3 form along T, and scales."""
        raise NotImplementedError

    def load_act(self, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """FP32 ``(T, K)`` of :meth:`save_act`'s tensors."""
        raise NotImplementedError

    def fake_grad_dgrad(self, g: torch.Tensor, pow2: bool) -> torch.Tensor:
        """The output gradient ``(T, N)`` quantized along N (dgrad's reduction)."""
        raise NotImplementedError

    def fake_grad_wgrad(self, g: torch.Tensor, pow2: bool) -> torch.Tensor:
        """The output gradient ``(T, N)`` quantized along T (wgrad's reduction)."""
        raise NotImplementedError

    def weight_for_dgrad(self, weight: torch.Tensor, q: torch.Tensor, s: torch.Tensor, pow2: bool) -> torch.Tensor:
        """FP32 ``(N, K)`` weight as dgrad multiplies it (quantized along N)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"LinearFormat({self.name})"
