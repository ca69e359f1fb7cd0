"""The two small interfaces every engine implements, and the plain types that cross them.

Engines know tensors, never gRPC or Redis. A rollout engine (``engine: torch | vllm``) samples
and is refitted in place; a trainer backend (``backend: torch | megatron``) computes logprobs,
takes optimizer steps and exports its master weights under Hugging Face names for refit.

Logprob alignment used everywhere: for a row ``ids`` of length T, ``logprobs[t]`` is
``log p(ids[t] | ids[:t])`` for ``t >= 1`` and 0 at ``t = 0``; ``loss_mask[t] = 1`` exactly on
generated (response) tokens.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp8rl.fp8 import QKVScales, WeightLoadError  # the payload lifecycle's error (fp8rl.fp8.payload)
from fp8rl.limits import GREEDY_TEMPERATURE, MAX_TEMPERATURE

if TYPE_CHECKING:  # annotations only
    from fp8rl.model.vision import ImageBatch

__all__ = [
    "Cancelled",
    "ShouldStop",
    "check_stop",
    "SamplingParams",
    "Sample",
    "TrainBatch",
    "RolloutEngine",
    "TrainerBackend",
    "VersionMismatchError",
    "served_version",
    "WeightLoadError",
]


class VersionMismatchError(RuntimeError):
    """A request pinned to a weight version the engine does not hold (gRPC: FAILED_PRECONDITION)."""

    def __init__(self, requested: int, held: int | None):
        super().__init__(f"request pinned to weight version {requested}, but this engine holds version {held}")
        self.requested, self.held = requested, held


def served_version(requested: int | None, held: int | None) -> int:
    """The version a generate call runs at: ``held``, which ``requested`` (when given) must equal.

    Raises:
        VersionMismatchError: nothing is held yet, or the request is pinned to another version.
    """
    if held is None or (requested is not None and requested != held):
        raise VersionMismatchError(requested if requested is not None else -1, held)
    return held


ShouldStop = Callable[[], bool]
"""A cancellation check engines poll between units of work (decode steps, micro-batches): True means the caller
is gone (its RPC was cancelled or passed its deadline), so the engine stops and raises :class:`Cancelled`."""


class Cancelled(RuntimeError):
    """The work was abandoned because its ``should_stop`` check said so; no state was changed by it."""


def check_stop(should_stop: ShouldStop | None, what: str) -> None:
    """Raise :class:`Cancelled` (naming ``what`` was stopped) when ``should_stop`` is given and returns True."""
    if should_stop is not None and should_stop():
        raise Cancelled(f"{what} stopped: the caller cancelled or its deadline passed")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        temperature: softmax temperature, finite, in ``[0, MAX_TEMPERATURE]`` (``fp8rl.limits``); 0 means
            greedy, and so does any value below ``GREEDY_TEMPERATURE`` (stored as 0.0).
        top_p: nucleus sampling mass in (0, 1].
        max_tokens: most tokens generated per sample.
        n: samples per prompt (the GRPO group size).
        seed: makes sampling reproducible for a given batch; None draws from the engine's RNG.
        stop_token_ids: extra stop tokens besides the tokenizer's EOS.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be finite and in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # logits / T would overflow FP32: sample greedily
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass(frozen=True)
class Sample:
    """One generated response.

    Attributes:
        prompt_index: index of its prompt in the request.
        prompt_ids: the prompt tokens (as given, without padding).
        token_ids: generated tokens, including the stop token when one was sampled.
        logprobs: the engine's logprob of each generated token (``gen_logprobs``), same length.
        finish_reason: ``"stop"`` or ``"length"``.
        weight_version: the weight version that produced it.
        routes: mixture-of-experts models with routing replay: the experts every token the engine *fed* used
            in every mixture-of-experts layer, ``(len(prompt_ids) + len(token_ids) - 1, L, K)`` uint8 (int16 past
            256 experts) — the prompt's prefill, then each generated token but the last (never fed). None otherwise.
        token_mask: a multi-turn trajectory (:mod:`fp8rl.envs.trajectory`): per token of ``token_ids``, 1
            where the model sampled it (trained; its ``logprobs`` entry is the engine's) and 0 where the environment,
            a tool or the user wrote it (context only: loss mask 0, logprob 0). None: every token is the model's
            (the single-turn sample, a one-segment trajectory).
        images: a vision-language prompt's images (:class:`~fp8rl.model.vision.ImageBatch`, one object shared by
            the prompt's samples: the trainer encodes it once per step), None for a text prompt.
    """

    prompt_index: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    weight_version: int
    routes: torch.Tensor | None = None
    token_mask: tuple[int, ...] | None = None
    images: ImageBatch | None = None


@dataclass
class TrainBatch:
    """A right-padded batch of prompt+response rows for the trainer.

    Attributes:
        input_ids: ``(B, T)`` int64, prompt then response then padding.
        attention_mask: ``(B, T)`` 1 on real tokens, 0 on padding.
        loss_mask: ``(B, T)`` 1 on generated tokens (the ones the loss and metrics see).
        advantages: ``(B,)`` per-sequence GRPO advantages.
        gen_logprobs: ``(B, T)`` rollout-engine logprobs aligned as in the module docstring.
        prev_logprobs: ``(B, T)`` trainer logprobs at the weights it holds when the batch arrives — the
            proximal policy of decoupled PPO; in a synchronous step also the weights that generated the
            batch (filled by the trainer's ``compute_logprobs`` when None).
        ref_logprobs: ``(B, T)`` reference-policy logprobs for the KL term, or None.
        versions: ``(B,)`` int64 weight version that generated each row (the behaviour policy), or None
            (every row from the version the trainer holds).
        routes: ``(B, T, L, K)`` int16 experts the rollout used at each position and mixture-of-experts layer
            (-1 where it has none: padding, a row's last token), replayed by the trainer; or None.
        images: per row, its prompt's images (:class:`~fp8rl.model.vision.ImageBatch`; rows of one prompt share the
            object) or None; None for a batch without any.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    gen_logprobs: torch.Tensor
    prev_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    images: list[ImageBatch | None] | None = None

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        if self.images is not None and len(self.images) != b:
            raise ValueError(f"TrainBatch.images has {len(self.images)} entries for {b} rows")
        if self.routes is not None and (self.routes.dim() != 4 or tuple(self.routes.shape[:2]) != (b, t)):
            raise ValueError(f"TrainBatch.routes has shape {tuple(self.routes.shape)}, expected ({b}, {t}, L, K)")
        for name in ("attention_mask", "loss_mask", "gen_logprobs", "prev_logprobs", "ref_logprobs"):
            val = getattr(self, name)
            if val is not None and tuple(val.shape) != (b, t):
                raise ValueError(f"TrainBatch.{name} has shape {tuple(val.shape)}, expected {(b, t)}")
        for name in ("advantages", "versions"):
            val = getattr(self, name)
            if val is not None and tuple(val.shape) != (b,):
                raise ValueError(f"TrainBatch.{name} has shape {tuple(val.shape)}, expected {(b,)}")

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows ``[start, stop)`` (a micro-batch)."""

        def cut(t):
            return None if t is None else t[start:stop]

        return TrainBatch(
            self.input_ids[start:stop], self.attention_mask[start:stop], self.loss_mask[start:stop],
            self.advantages[start:stop], self.gen_logprobs[start:stop], cut(self.prev_logprobs),
            cut(self.ref_logprobs), cut(self.versions), cut(self.routes), cut(self.images),
        )


class RolloutEngine(abc.ABC):
    """Generates samples at one weight version and is refitted in place between batches."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int | None:
        """The version currently served (None before the first load)."""

    @property
    @abc.abstractmethod
    def scales_version(self) -> int | None:
        """The version whose QKV scales the FP8 KV cache holds (None: no FP8 KV cache, or none loaded yet)."""

    @abc.abstractmethod
    def load_scales(self, qkv_scales: QKVScales) -> None:
        """Install the QKV scales of the version already held (the first calibration, before any refit).

        Raises:
            WeightLoadError: the scales are of another version, or do not fit the model.
        """

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, weight_version: int | None = None,
        should_stop: ShouldStop | None = None,
    ) -> list[Sample]:
        """Sample ``params.n`` responses per prompt (prompt-major order: prompt 0's samples first).

        ``should_stop`` is polled between decode steps (as often as the engine can): once it returns
        True the engine drops the batch, frees itself for the next call and raises :class:`Cancelled`.

        Raises:
            VersionMismatchError: ``weight_version`` is given and differs from the served one.
            Cancelled: ``should_stop`` returned True.
        """

    @abc.abstractmethod
    def load_weights(
        self, version: int, tensors: Mapping[str, torch.Tensor], qkv_scales: QKVScales | None = None
    ) -> None:
        """Atomically replace weights (and QKV scales) with ``version``'s, in place.

        ``tensors`` use Hugging Face names; a linear the engine runs in FP8 accepts either its
        high-precision ``X.weight`` (quantized here, the same way the trainer does) or
        ``X.weight`` in E4M3 plus ``X.weight_scale``. Validates everything before touching the
        live weights; on any problem raises :class:`WeightLoadError` and keeps serving the old
        version. A version older than the held one is refused. Engines run the one payload
        lifecycle of :mod:`fp8rl.fp8.payload` (create → process after loading → apply).
        """


class TrainerBackend(abc.ABC):
    """Owns the policy's master weights and optimizer."""

    checkpoint_suffix = ".pt"  # what save_checkpoint writes: a file, or (".dcp") a directory of per-rank shards

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Weight version of the current parameters (0 = initial, +1 per train step)."""

    @abc.abstractmethod
    def compute_logprobs(self, batch: TrainBatch, *, should_stop: ShouldStop | None = None) -> torch.Tensor:
        """``(B, T)`` logprobs of ``batch.input_ids`` under the current weights (no grad).

        ``should_stop`` is polled between micro-batches (:class:`Cancelled` once it returns True).
        """

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, *, should_stop: ShouldStop | None = None) -> dict[str, float]:
        """One optimizer step on ``batch``; returns loss/metric floats and bumps ``version``.

        ``should_stop`` is polled between micro-batches; once it returns True the step is abandoned
        before the optimizer changes anything (weights, optimizer state and version as before) and
        :class:`Cancelled` is raised.
        """

    @abc.abstractmethod
    def state_dict(self, *, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """Master weights under Hugging Face names (what a refit publishes); ``adapters_only``: a LoRA trainer's
        adapters alone (a refit after the base; ValueError from a trainer without adapters)."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Everything needed to resume bit-identically (weights, optimizer, RNG, version)."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint`."""

    def relabel_version(self, version: int) -> None:
        """Give the current weights the (newer) version number ``version``; weights and optimizer are untouched.

        Used when a trainer resumes from a checkpoint older than the job's ``weights:latest``: the
        checkpoint's weights are republished under the next free version (versions only increase).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot relabel its weight version")
