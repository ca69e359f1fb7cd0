"""The embedded trainer backend (``backend: torch``): GRPO steps on a :class:`CausalLM`.

FP8 recipes swap the transformer layers' linears for :class:`fp8rl.fp8.Fp8Linear` (master weights
kept; forward and both backward GEMMs in block-scaled FP8); ``bf16`` and ``fp8_gen_only`` train
in high precision. Loss aggregation is token-level over the global batch: micro-batch losses are
divided by the *global* number of generated tokens, so gradient accumulation sums to exactly the
full-batch gradient. Checkpoints hold weights, optimizer state, RNG state and the version, and
resume bit-identically; they also record their model (config, preset or directory, recipe) for
:mod:`fp8rl.export`. A ``should_stop`` check runs before every micro-batch; a step it stops leaves
weights, optimizer and version as they were.

With a :class:`~fp8rl.engines.parallel.DataParallel` group (``policy.training.dp_size`` > 1, under torchrun)
the same trainer runs on every rank over FSDP2: the rows, the numbers and the agreement rules are in
:mod:`fp8rl.engines.parallel`. Its checkpoints are ``torch.distributed.checkpoint`` directories
(``*.dcp``: each rank writes its own shards, and loading reshards to any world size, one rank included);
a single-rank trainer still writes one ``.pt`` file, and both kinds load at any world size.

Size (~750 lines): the GRPO update and its checkpoints are one state machine (weights, optimizer, RNG, version,
FP8 caches, LoRA adapters) whose hooks (``_build_policy``, ``_distribute``, ``_backward``, ``_clip_grads``,
``_checkpoint_state``, ...) are what :class:`~fp8rl.engines.megatron.trainer.MegatronTrainer` replaces; the model
passes live in :mod:`.logprob_pass`, the memory model in :mod:`.footprint`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fp8rl.fp8 import Fp8Linear, Fp8Recipe, QKVScales, convert_model
from fp8rl.fp8.payload import is_adapter
from fp8rl.memory import release_free_memory
from fp8rl.model import CausalLM, routing
from fp8rl.model.lora import LoraSettings, apply_lora, base_checksum, lora_computed_state_dict, lora_state_dict
from fp8rl.model.shared_prefix import shared_prefix_length
from fp8rl.rl import MAX_ABS_LOGPROB_DIFF, LossConfig, LossNorm, mismatch_metrics, policy_loss

from .base import Cancelled, ShouldStop, TrainBatch, TrainerBackend, check_stop
from .footprint import check_fits, keeps_dequantized_weights, recompute_by_default
from .logprob_pass import sequence_logprobs, sequence_logprobs_and_entropy
from .parallel import DataParallel, full_tensor
from .resume_checks import check_resumable
from .routing_stats import RouteStats, plan_for
from .step_images import StepImages

__all__ = ["MIN_SHARED_PREFIX", "TrainerConfig", "TorchTrainer"]

# fewer shared leading tokens than this run as part of every row (a second forward costs more than it saves)
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class TrainerConfig:
    """Optimisation settings of the trainer.

    Attributes:
        lr: AdamW learning rate.
        betas: AdamW betas.
        weight_decay: AdamW decoupled weight decay.
        grad_clip: max global grad norm (``<= 0`` disables clipping).
        micro_batch_size: rows per forward/backward (gradient accumulation within a mini-batch).
        num_minibatches: optimizer updates per train step (PPO-style): the batch is split into this
            many contiguous mini-batches of rows (advantages are per row, so a split group is
            fine), each normalised over its own tokens; ``prev_logprobs`` stay those of the
            weights that generated the batch, so the
            clipped ratio bounds how far later updates move. The weight version still advances by
            one per train step (one publish per step).
        temperature: sampling temperature of the rollout; logprobs use ``logits / temperature``
            (0 means greedy sampling, whose logprobs are temperature-1).
        loss: policy-loss settings (clipping, KL, importance-sampling correction).
        router_replay: mixture-of-experts models: the policy's passes use the experts the rollout recorded
            (``TrainBatch.routes``) instead of routing again; gates come from this trainer's router scores.
        router_aux_loss_coef: weight of the load-balancing loss added to the policy loss (0: reported only).
        measure_unreplayed: with ``router_replay``, the logprob pass also runs once without replay and reports
            that mismatch (``moe/unreplayed/*``: what replay removed). One extra no-grad forward per step: off
            unless asked.
        activation_checkpointing: the training passes keep each layer's input only and recompute the layer in the
            backward (:meth:`fp8rl.model.CausalLM.set_activation_checkpointing`; dense models). None ("auto"):
            per micro-batch, as :func:`fp8rl.engines.footprint.recompute_by_default` decides from its shape.
        lora: train LoRA adapters on the frozen base (``policy.lora``), or None: every weight trains.
        train_vision_encoder: a vision-language policy's encoder trains too (its features then come from each
            training forward, with gradient); False: frozen, each prompt's images encoded once per step.
        share_prefix: a micro-batch's rows that open with the same tokens (a GRPO group's prompt, the system
            prompt and tools block of every trajectory) run them once, batch 1, and only their suffixes as a
            batch (:mod:`fp8rl.model.shared_prefix`): bitwise the same logprobs under batch invariance, the same
            gradient up to rounding (FP8: the E4M3 rounding of other gradient tensors). Used from
            :data:`MIN_SHARED_PREFIX` shared tokens, on dense non-MLA models, on one rank (a data-parallel group
            runs every row whole). Off by default here, so two trainers built alike compute alike whatever their
            rank count; a job turns it on (``policy.training.share_prefix``, default true).
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 16
    num_minibatches: int = 1
    temperature: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
    router_replay: bool = False
    router_aux_loss_coef: float = 0.0
    measure_unreplayed: bool = False
    activation_checkpointing: bool | None = None
    lora: LoraSettings | None = None
    share_prefix: bool = False
    train_vision_encoder: bool = False

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"TrainerConfig.lr must be > 0, got {self.lr}")
        if self.micro_batch_size < 1:
            raise ValueError(f"TrainerConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.num_minibatches < 1:
            raise ValueError(f"TrainerConfig.num_minibatches must be >= 1, got {self.num_minibatches}")
        if self.temperature < 0:
            raise ValueError(f"TrainerConfig.temperature must be >= 0, got {self.temperature}")


class TorchTrainer(TrainerBackend):
    """Embedded trainer.

    Args:
        model: the policy (its own deep copy is converted per ``recipe`` and trained).
        recipe: the trainer's :class:`Fp8Recipe` (``recipe_for_role(job_recipe, "trainer")``).
        config: optimisation settings.
        ref_model: frozen reference policy for the KL term (kept in high precision), or None.
        initial_version: version of ``model``'s weights.
        seed: seeds the trainer's RNG (dropout-free models only use it for bookkeeping).
        parallel: the data-parallel group to shard over (every rank builds the same trainer), or None.
    """

    CHECKPOINT_FORMAT = "fp8rl-torch-trainer/1"
    supports_lora = True  # computes LoRA adapters on its linears (policy.lora)
    DCP_META = "fp8rl.json"  # beside a .dcp checkpoint's shards: format, version, recipe, world size

    def __init__(
        self,
        model: CausalLM,
        recipe: Fp8Recipe,
        config: TrainerConfig = TrainerConfig(),
        *,
        ref_model: CausalLM | None = None,
        initial_version: int = 0,
        seed: int = 0,
        parallel: DataParallel | None = None,
    ) -> None:
        self.recipe = recipe
        self.config = config
        self.parallel = parallel
        self._moe_layers = model.num_moe_layers  # 0: dense (no routing plans, no moe/* metrics)
        self._route_metrics: dict[str, float] = {}
        self.lora = config.lora
        if self.lora is not None and not self.supports_lora:
            raise ValueError(f"policy.lora.enabled=true: the {type(self).__name__} backend does not compute LoRA "
                             "adapters; use policy.training.backend: torch")
        # LoRA: the base's identity (checkpoints record it; resuming on another base is refused)
        self._lora_base = base_checksum(model.state_dict()) if self.lora is not None else None
        self.model = self._build_policy(model, recipe).train()
        if getattr(self.model, "visual", None) is not None:  # a vision-language model: its encoder frozen, unless
            if parallel is not None:
                raise ValueError("a vision-language policy trains on one trainer rank (its encoder runs outside the "
                                 "sharded forward)")
            self.model.visual.requires_grad_(config.train_vision_encoder)
        elif config.train_vision_encoder:
            raise ValueError("policy.training.train_vision_encoder: the policy has no vision encoder")
        self._step_images = StepImages()  # a step's prompts' images, encoded once
        if self.lora is not None:  # after FP8 conversion, which swaps the linears the adapters hang on
            apply_lora(self.model, self.lora, seed=seed)
            # the frozen base's FP8 linears keep their FP8 form only (E4M3 + scales; mxfp8 keeps its master for dgrad)
            for m in self.model.modules():
                if isinstance(m, Fp8Linear):
                    m.freeze()
        if config.activation_checkpointing:
            self.model.set_activation_checkpointing(True)
        # the FP8 weights' FP32 dequantization kept per version where memory allows (footprint's rule; the same numbers)
        cached = [m for m in self.model.modules() if isinstance(m, Fp8Linear) and m.weight_cache is not None]
        if cached and keeps_dequantized_weights(sum(m.weight.numel() for m in cached)):
            for m in cached:
                m.weight_cache.keep_dequantized = True
        self._trained_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        # Trainer-side FP8 KV (batch-invariant recipes): the quantizers stay off the model except during this
        # trainer's own passes, which need the QKV scales the rollout used for the version they recompute; a
        # calibrator reading the same model object (the in-process loop) keeps its high-precision forward.
        self._kv_quants = list(self.model.kv_quantizers) if recipe.fp8_kv else []
        if self._kv_quants:
            self.model.disable_fp8_kv()
        if parallel is not None:
            self.model = self._distribute(self.model, trained=True)
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = self._build_reference(ref_model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
            if parallel is not None:
                self.ref_model = self._distribute(self.ref_model, trained=False)
        # On CPU, one parameter at a time (foreach=False): the multi-tensor path computes sqrt(v) for every parameter
        # at once, a transient as large as the weights (2.5 GB on a 630M model: the train phase's peak), and on CPU
        # its foreach kernels loop over the same per-tensor ops anyway — the same numbers, bitwise (tested)
        on_cpu = all(p.device.type == "cpu" for p in self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            self._trained(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
            foreach=False if on_cpu else None,
        )
        self._version = initial_version
        # which model a checkpoint belongs to (fp8rl.export reads it): its config, the preset or directory
        # load_policy loaded it from (None for a model built in memory), the whole recipe
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self._model_record = {"model_config": model.config.to_hf_dict(torch_dtype=dtype),
                              "model_source": getattr(model, "name_or_path", None), "recipe": asdict(recipe)}
        if self.lora is not None:  # the adapters' settings and the base they belong to
            self._model_record["lora"] = {**asdict(self.lora), "target_modules": list(self.lora.target_modules),
                                          "base_checksum": self._lora_base}
        torch.manual_seed(seed)

    def _trained(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (a LoRA trainer's adapters; else every weight but a vision-language
        model's frozen encoder), in model order."""
        return [p for p in self.model.parameters() if p.requires_grad]  # a frozen vision encoder's are not

    def _build_policy(self, model: CausalLM, recipe: Fp8Recipe) -> torch.nn.Module:
        """The trained module: a deep copy of ``model`` with its linears converted per ``recipe``."""
        return convert_model(copy.deepcopy(model), recipe, mode="train")

    def _build_reference(self, ref_model: CausalLM) -> torch.nn.Module:
        """The frozen KL reference, kept in high precision."""
        return copy.deepcopy(ref_model)

    def _distribute(self, model: torch.nn.Module, trained: bool) -> torch.nn.Module:
        """``model`` spread over the data-parallel group: here FSDP2 (:meth:`DataParallel.shard`), the policy
        and the frozen reference (``trained=False``) alike."""
        return self.parallel.shard(model)

    def _zero_grads(self) -> None:
        """Clear the gradients before an update's first backward."""
        self.optimizer.zero_grad(set_to_none=True)

    def _reduce_grads(self) -> None:
        """Make every parameter's ``.grad`` the group's sum, after an update's last backward (FSDP2 already
        reduce-scattered them inside the backward: nothing left to do here)."""

    @property
    def version(self) -> int:
        return self._version

    @property
    def checkpoint_suffix(self) -> str:  # type: ignore[override]
        """What :meth:`save_checkpoint` writes: one ``.pt`` file, or a ``.dcp`` directory of per-rank shards."""
        return ".dcp" if self._sharded_state else ".pt"

    @property
    def _sharded_state(self) -> bool:
        """Whether each rank holds only shards of the weights and AdamW state (FSDP2 over a group): checkpoints
        are then ``.dcp`` directories every rank writes its part of; otherwise one ``.pt`` file rank 0 writes."""
        return self.parallel is not None

    def _spans(self, rows: int) -> list[tuple[int, int]]:
        """The micro-batches of ``rows`` rows, as on one rank: ``[start, stop)`` of ``micro_batch_size``."""
        mb = self.config.micro_batch_size
        return [(a, min(a + mb, rows)) for a in range(0, rows, mb)]

    def _micro_batches(self, batch: TrainBatch, should_stop: ShouldStop | None = None):
        """``(round, micro-batch)`` this rank runs: every one on a single rank; with a group, micro-batch ``j``
        on rank ``j % N`` in round ``j // N`` (a zero-token filler where ``j`` is past the last), the stop
        decision agreed before each."""
        spans = self._spans(batch.input_ids.shape[0])
        p = self.parallel
        if p is None:
            for j, (a, b) in enumerate(spans):
                check_stop(should_stop, "training step")
                yield j, batch.slice(a, b)
            return
        for i in range(p.rounds(len(spans))):
            if p.any(should_stop is not None and should_stop()):  # rank 0 decides; all raise together
                raise Cancelled("training step stopped: the caller cancelled or its deadline passed")
            j = i * p.world + p.rank
            yield i, (batch.slice(*spans[j]) if j < len(spans) else _filler(batch))

    @property
    def needs_qkv_scales(self) -> bool:
        """Whether :meth:`load_qkv_scales` must give the held version's scales before logprobs or a step."""
        return bool(self._kv_quants)

    def load_qkv_scales(self, scales: QKVScales) -> None:
        """The QKV scales the rollout used for ``scales.version`` (FP8 KV on the trainer: batch-invariant recipes).

        Raises:
            ValueError: this trainer has no FP8 KV, or the scales do not cover every layer.
        """
        if not self._kv_quants:
            raise ValueError("this trainer computes attention in high precision (no FP8 KV): it takes no QKV scales")
        if scales.num_layers != len(self._kv_quants):
            raise ValueError(f"QKV scales cover {scales.num_layers} layers, the model has {len(self._kv_quants)}")
        for i, qz in enumerate(self._kv_quants):
            qz.set_scales(scales.q[i], scales.k[i], scales.v[i], scales.version)

    @contextlib.contextmanager
    def _fp8_kv(self):
        """The FP8 KV quantizers installed for one pass, with the held version's scales (else RuntimeError)."""
        if not self._kv_quants:
            yield
            return
        for qz in self._kv_quants:
            qz.require_version(self._version)
        layers = self.model.model.layers
        for layer, qz in zip(layers, self._kv_quants, strict=True):
            layer.self_attn.kv_quant = qz
        try:
            yield
        finally:
            for layer in layers:
                layer.self_attn.kv_quant = None

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, should_stop: ShouldStop | None = None) -> torch.Tensor:
        """The policy's logprobs (routes replayed with ``router_replay``); a mixture-of-experts model's routing
        metrics of this pass are kept for :meth:`routing_metrics`. With a shared prefix
        (``TrainerConfig.share_prefix``) the logprobs of a micro-batch's tokens before its first trained one (its
        shared prompt) are 0: never read (the loss and the metrics take trained tokens only)."""
        replay = self.config.router_replay and batch.routes is not None  # rows without routes: its own routing
        stats = RouteStats(self._moe_layers)
        with self._fp8_kv():
            out = self._logprobs_of(self.model, batch, should_stop, replay=replay, stats=stats)
            unreplayed = None
            if replay and self._moe_layers and self.config.measure_unreplayed:
                unreplayed = self._logprobs_of(self.model, batch, should_stop, replay=False)
        self._route_metrics = stats.metrics(self.parallel.sum if self.parallel is not None else None) \
            if self._moe_layers else {}
        if unreplayed is not None:
            m = mismatch_metrics(unreplayed, batch.gen_logprobs, batch.loss_mask)
            self._route_metrics.update({f"moe/unreplayed/{k}": m[k]
                                        for k in ("token_mult_prob_error", "gen_kl_k3", MAX_ABS_LOGPROB_DIFF)})
        return out

    def routing_metrics(self) -> dict[str, float]:
        """The ``moe/*`` metrics of the last :meth:`compute_logprobs` (:mod:`fp8rl.engines.routing_stats`); empty
        for a dense model."""
        return dict(self._route_metrics)

    @torch.no_grad()
    def _logprobs_of(self, model: CausalLM, batch: TrainBatch, should_stop: ShouldStop | None = None, *,
                     replay: bool = False, stats: RouteStats | None = None) -> torch.Tensor:
        p, t = self.parallel, self.config.temperature

        def logprobs(mb: TrainBatch) -> torch.Tensor:
            plan = plan_for(self._moe_layers, mb, replay=replay, record=stats is not None, aux=stats is not None)
            if plan is None:
                return sequence_logprobs_and_entropy(model, mb.input_ids, mb.attention_mask, t,
                                                     prefix_len=self._prefix_len(mb),
                                                     images=self._step_images.of(model, mb.images))[0]
            with routing(model, plan):
                out = sequence_logprobs(model, mb.input_ids, mb.attention_mask, t,
                                        images=self._step_images.of(model, mb.images))
            if stats is not None:
                stats.add(plan)
            return out

        if p is None:
            return torch.cat([logprobs(mb) for _, mb in self._micro_batches(batch, should_stop)], dim=0)
        return self._rows_of(batch, ((i, logprobs(mb)) for i, mb in self._micro_batches(batch, should_stop)))

    def _prefix_len(self, mb: TrainBatch) -> int:
        """The leading tokens micro-batch ``mb``'s rows share and run once (``TrainerConfig.share_prefix``), up to
        the token before its first trained one; 0 where none is shared or sharing does not apply (images)."""
        if (not self.config.share_prefix or self.parallel is not None or self._moe_layers or mb.images is not None
                or not getattr(self.model, "takes_shared_prefix", False)):
            return 0
        trained = mb.loss_mask.bool().any(0).nonzero()
        if not trained.numel():
            return 0
        n = shared_prefix_length(mb.input_ids, mb.attention_mask, int(trained[0]))
        return n if n >= MIN_SHARED_PREFIX else 0

    def _rows_of(self, batch: TrainBatch, rounds) -> torch.Tensor:
        """The ``(B, T)`` logprobs of ``batch`` on every rank of the group, from ``rounds``: ``(round, (rows, T)
        logprobs of this rank's micro-batch in it)``, gathered round by round."""
        p = self.parallel
        spans, mb_rows = self._spans(batch.input_ids.shape[0]), self.config.micro_batch_size
        outs: list[torch.Tensor | None] = [None] * len(spans)
        for i, lp in rounds:
            padded = lp.new_zeros(mb_rows, lp.shape[1])
            padded[:lp.shape[0]] = lp
            for r, got in enumerate(p.gather_rows(padded)):  # every rank gets every row
                j = i * p.world + r
                if j < len(spans):
                    outs[j] = got[:spans[j][1] - spans[j][0]]
        return torch.cat(outs, dim=0)

    def check_memory(self, rows: int, seq_len: int, *, where: str = "the trainer"):
        """Refuse (:class:`~fp8rl.engines.footprint.MemoryBudgetError`, naming ``policy.training.micro_batch_size``
        and the largest that fits) a step of ``rows`` rows of ``seq_len`` tokens whose largest micro-batch, with the
        gradients, AdamW moments and FP8 weight caches not allocated yet, passes the memory left
        (:mod:`fp8rl.engines.footprint`); the footprint. A group's shards are not estimated (None)."""
        if self.parallel is not None:
            return None
        trained = [p for p in self.model.parameters() if p.requires_grad]
        to_come = sum(4 * p.numel() for p in trained if p.grad is None)
        if not self.optimizer.state:
            to_come += 8 * sum(p.numel() for p in trained)
        for m in self.model.modules():  # E4M3 (1 byte), and its FP32 dequantization where the cache keeps it (4)
            c = m.weight_cache if isinstance(m, Fp8Linear) else None
            if c is not None:
                to_come += m.weight.numel() * ((c.q is None) + 4 * (c.keep_dequantized and c.dequantized is None))
        return check_fits(self.model.config, micro_batch_size=self.config.micro_batch_size, rows=rows,
                          seq_len=seq_len, batch_invariant=self.recipe.batch_invariant, state_to_come=to_come,
                          checkpointing=self.recomputes(min(rows, self.config.micro_batch_size), seq_len),
                          activation_bytes=self._activation_bytes, where=where)

    @property
    def _activation_bytes(self) -> int:
        return self.model.model.embed_tokens.weight.element_size()

    reports_recompute = True  # train/recomputed in the step's metrics (a backend that never recomputes: False)

    def recomputes(self, rows: int, seq_len: int, shared: int = 0) -> bool:
        """Whether a training micro-batch of ``rows`` rows of ``seq_len`` tokens (the first ``shared`` run once:
        :meth:`_prefix_len`) runs with activation checkpointing:
        the configured value, or left unset (None), :func:`~fp8rl.engines.footprint.recompute_by_default` of its
        shape — on one process only: a group's FSDP2 layers would gather their shards again in the recomputed
        forward, which nothing here has measured, so a group recomputes only when told to."""
        chosen = self.config.activation_checkpointing
        if chosen is not None:
            return chosen
        if self.parallel is not None:
            return False
        return recompute_by_default(self.model.config, rows, seq_len, trained_params=self._trained_params,
                                    batch_invariant=self.recipe.batch_invariant,
                                    activation_bytes=self._activation_bytes, shared=shared)

    # train_step may compute a batch's prev logprobs in its own forward (fuses_logprob_pass); a subclass whose
    # _backward is another's (the Megatron backend's) says False
    fuses_logprobs = True

    def fuses_logprob_pass(self, batch: TrainBatch, *, recording: bool = False) -> bool:
        """Whether :meth:`train_step` of ``batch`` (``prev_logprobs`` None) takes them from its own forward instead of a
        logprob pass of their own: one optimizer update per step (its first micro-batches' forwards are then at the
        weights a logprob pass would run, over the same micro-batches: bitwise the same logprobs, so the same loss,
        gradient and metrics — ``tests/unit/engines/test_fused_logprobs.py``), one rank, a dense model (a mixture of
        experts' logprob pass also measures its routing). ``recording``: a calibrator records the pass's Q/K/V
        (``calibration.site logprobs``), which needs each layer to run forward once per micro-batch: no micro-batch
        of ``batch`` may recompute its layers (activation checkpointing) or skip its forward (no trained token in it:
        the logprob pass records every sequence, the train pass only those it trains)."""
        if not self.fuses_logprobs or self.parallel is not None or self._moe_layers:
            return False
        rows = batch.input_ids.shape[0]
        if min(self.config.num_minibatches, rows) != 1:
            return False
        if recording:
            return not any(mb.num_tokens == 0 or self.recomputes(*mb.input_ids.shape, shared=self._prefix_len(mb))
                           for mb in (batch.slice(a, b) for a, b in self._spans(rows)))
        return True

    def train_step(self, batch: TrainBatch, *, should_stop: ShouldStop | None = None) -> dict[str, float]:
        fused = batch.prev_logprobs is None and self.fuses_logprob_pass(batch)
        if batch.prev_logprobs is None and not fused:
            batch.prev_logprobs = self.compute_logprobs(batch, should_stop=should_stop)
        if self.config.loss.kl_coef > 0 and batch.ref_logprobs is None:
            if self.ref_model is None:
                raise ValueError("loss.kl_coef > 0 needs a reference model (ref_model) or batch.ref_logprobs")
            batch.ref_logprobs = self._logprobs_of(self.ref_model, batch, should_stop)
        rows = batch.input_ids.shape[0]
        k = min(self.config.num_minibatches, rows)
        bounds = [(i * rows) // k for i in range(k + 1)]
        totals: dict[str, float] = {}
        # With several updates per step, a failure in a later one must not leave the earlier ones
        # applied at an unchanged version: snapshot, and roll back on any error.
        snapshot = None
        if k > 1:
            snapshot = ({n: t.detach().clone() for n, t in self.model.state_dict().items()},
                        copy.deepcopy(self.optimizer.state_dict()))
        try:
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                with self._fp8_kv():
                    m = self._update(batch if fused else batch.slice(lo, hi), should_stop, fill_prev=fused)
                for key, val in m.items():
                    totals[key] = totals.get(key, 0.0) + val / k
        except Exception:
            if snapshot is not None:
                self.model.load_state_dict(snapshot[0])
                self.optimizer.load_state_dict(snapshot[1])
            raise
        finally:
            self._step_images.clear()
        self._version += 1
        totals["lr"] = self.config.lr
        return totals

    def _update(self, batch: TrainBatch, should_stop: ShouldStop | None = None, *, fill_prev: bool = False
                ) -> dict[str, float]:
        """One optimizer update on ``batch`` (token-level mean over its generated tokens); ``fill_prev``: ``batch``'s
        prev logprobs are its forwards' own (:meth:`fuses_logprob_pass`), set on ``batch`` before the step."""
        self._zero_grads()
        norm = LossNorm.of(batch.loss_mask)
        totals, weights = self._backward(batch, LossNorm(max(norm.tokens, 1), max(norm.sequences, 1)), should_stop,
                                         fill_prev=fill_prev)
        if self.parallel is not None:  # sums over ranks; every rank ran >= 1 micro-batch, so all hold the same keys
            self._reduce_grads()
            keys, wkeys = sorted(totals), sorted(weights)
            summed = self.parallel.sum(torch.tensor([totals[k] for k in keys] + [weights[k] for k in wkeys],
                                                    dtype=torch.float64)).tolist()
            totals = dict(zip(keys, summed[:len(keys)], strict=True))
            weights = dict(zip(wkeys, summed[len(keys):], strict=True))
        for k, w in weights.items():
            totals[k] /= max(w, 1.0)
        gn = self._clip_grads()
        if not torch.isfinite(gn):
            self._zero_grads()
            raise FloatingPointError(f"non-finite gradient norm {float(gn)} at version {self._version}; step skipped")
        self.optimizer.step()
        # this version's FP8 weights belong to the step that made them (the next pass, whichever it is, reuses them)
        for m in self.model.modules():
            if isinstance(m, Fp8Linear):
                m.refresh_weight_cache()
        totals["grad_norm"] = float(gn)
        return totals

    def _backward(self, batch: TrainBatch, norm: LossNorm, should_stop: ShouldStop | None = None, *,
                  fill_prev: bool = False) -> tuple[dict[str, float], dict[str, float]]:
        """Forward and backward over this rank's micro-batches of ``batch`` (losses over ``norm``, the update's
        global token and sequence counts), gradients accumulated; this rank's metric sums and their token
        weights. ``fill_prev`` (one rank): each micro-batch's prev logprobs are its forward's own, detached, and
        ``batch.prev_logprobs`` is set to them all (0 in a micro-batch without trained tokens: never read)."""
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        grouped = self.parallel is not None
        recomputed = runs = 0
        prev = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device) \
            if fill_prev else None
        spans = self._spans(batch.input_ids.shape[0])  # one rank (fill_prev): micro-batch j is rows spans[j]
        for j, mb in self._micro_batches(batch, should_stop):  # Cancelled here: no optimizer step taken
            if mb.num_tokens == 0 and not grouped:  # in a group every rank runs every round (FSDP's collectives)
                continue
            coef = self.config.router_aux_loss_coef
            plan = plan_for(self._moe_layers, mb, replay=self.config.router_replay, aux=coef > 0)
            shared = self._prefix_len(mb) if plan is None else 0
            # forward-only passes ignore it
            self.model.activation_checkpointing = self.recomputes(*mb.input_ids.shape, shared=shared)
            recomputed, runs = recomputed + self.model.activation_checkpointing, runs + 1
            # a frozen encoder's features are the step's; a trained one's come with gradient, per micro-batch
            images = self._step_images.of(self.model, mb.images, grad=self.config.train_vision_encoder)
            with routing(self.model, plan) if plan is not None else contextlib.nullcontext():
                curr, ent = sequence_logprobs_and_entropy(self.model, mb.input_ids, mb.attention_mask,
                                                          self.config.temperature, entropy=True, prefix_len=shared,
                                                          images=images)
            if prev is not None:  # the weights a logprob pass would have run: ratio exactly 1, as that pass gives
                prev[slice(*spans[j])] = mb.prev_logprobs = curr.detach()
            loss, m = self._loss(curr, mb, norm, ent)
            if plan is not None and plan.aux_loss is not None:  # its token mean, weighted like the policy loss
                loss = loss + coef * plan.aux_loss * (mb.num_tokens / norm.tokens)
            loss.backward()
            _add_metrics(totals, weights, float(loss.detach()), m, mb.num_tokens)
            del curr, ent, loss, m
            release_free_memory()  # the micro-batch's activations, freed: back to the kernel (tune_allocator)
        if runs and self.reports_recompute:  # the share of this rank's micro-batches that recomputed their layers
            totals["recomputed"], weights["recomputed"] = float(recomputed), float(runs)
        if prev is not None:
            batch.prev_logprobs = prev
        return totals, weights

    def _loss(self, curr: torch.Tensor, mb: TrainBatch, norm: LossNorm, entropy: torch.Tensor | None = None):
        """The policy loss of micro-batch ``mb`` at current logprobs ``curr`` (over ``norm``, the update's global
        counts) and its metrics (with the policy's token-mean ``entropy`` when given)."""
        return policy_loss(curr, mb.prev_logprobs, mb.gen_logprobs, mb.advantages, mb.loss_mask, self.config.loss,
                           ref_logprobs=mb.ref_logprobs, num_tokens=norm.tokens, num_sequences=norm.sequences,
                           entropy=entropy)

    def _clip_grads(self) -> torch.Tensor:
        """Clip the gradients to ``grad_clip`` by their global norm (0: no clipping); the norm."""
        if self.parallel is not None:  # the global norm of the sharded gradients (DTensor reduction); inf clips nothing
            return full_tensor(torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.config.grad_clip if self.config.grad_clip > 0 else float("inf")))
        if self.config.grad_clip > 0:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        return torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in self.model.parameters() if p.grad is not None]))

    def state_dict(self, *, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        """Full master weights under HF names (a LoRA trainer's adapters included, under PEFT's names, as the forward
        computes with them: rounded to ``policy.lora.dtype``); with a group, each gathered from its shards (every
        rank must call this, in the same order: rank 0 publishes, the others drop theirs). ``adapters_only``: a LoRA
        trainer's adapters alone (what a refit after the base ships)."""
        if adapters_only:
            if self.lora is None:
                raise ValueError("adapters_only: this trainer trains every weight (policy.lora is off)")
            return {k: full_tensor(v) for k, v in lora_computed_state_dict(self.model).items()}
        sd = {k: full_tensor(v.detach()) for k, v in self.model.state_dict().items()}
        if self.lora is not None:  # the adapters once each (shared experts' under expert 0's names alone)
            sd = {k: v for k, v in sd.items() if not is_adapter(k)}
            sd.update({k: full_tensor(v) for k, v in lora_computed_state_dict(self.model).items()})
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the master weights in place (e.g. to start from a published version); with a group, every
        rank passes the same full tensors and keeps its shard. A LoRA trainer takes its adapters alone (its base is
        frozen, in FP8 where the recipe computes in FP8).

        Raises:
            ValueError: a LoRA trainer given base tensors.
        """
        if self.lora is not None:
            base = sorted(n for n in tensors if not is_adapter(n))
            if base:
                raise ValueError(f"a LoRA trainer's base is frozen: load_state_dict takes its adapters alone, got "
                                 f"{len(base)} base tensor(s), e.g. {base[:3]}")
            tensors = {n: t.to(torch.float32) for n, t in tensors.items()}  # into the FP32 masters
            if self.parallel is None:
                missing = set(lora_state_dict(self.model)) - set(tensors)
                if missing:
                    raise ValueError(f"load_state_dict: {len(missing)} adapter(s) missing, e.g. {sorted(missing)[:3]}")
                self.model.load_state_dict(tensors, strict=False)
                return
        if self.parallel is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, tensors, options=StateDictOptions(
                full_state_dict=True, strict=not self.model.config.tie_word_embeddings and self.lora is None))
            return
        self.model.load_state_dict(tensors, strict=not self.model.config.tie_word_embeddings)

    def save_checkpoint(self, path: str) -> None:
        """One ``.pt`` file on a single rank; a ``.dcp`` directory (every rank its shards) with a group, or
        when ``path`` ends in ``.dcp``. Either appears whole or not at all."""
        if self._sharded_state or path.endswith(".dcp"):
            self._save_dcp(path)
            return
        state = self._checkpoint_state()  # on every rank (it may gather)
        if self._leads():  # whole on every rank (or one rank): the leader writes it
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
            self._write_file(path, state)
        self._barrier()

    def _checkpoint_state(self) -> dict:
        """What a ``.pt`` checkpoint holds (every rank computes it; the leader writes it)."""
        return {
            "format": self.CHECKPOINT_FORMAT,
            "version": self._version,
            # a LoRA trainer's checkpoint holds the adapters; its record names the base (lora.base_checksum)
            "model": self.model.state_dict() if self.lora is None else lora_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "recipe_linear": self.recipe.linear,
            **self._model_record,
        }

    def _restore_checkpoint_state(self, state: dict) -> None:
        """Load a ``.pt`` checkpoint's weights and optimizer state (held whole by this trainer)."""
        if self.lora is None:
            self.model.load_state_dict(state["model"])
        else:  # the adapters alone, every one of them
            want = set(lora_state_dict(self.model))
            got = set(state["model"])
            if got != want:
                raise ValueError(f"the checkpoint's adapters do not fit this model's (policy.lora): missing "
                                 f"{sorted(want - got)[:3]}, unknown {sorted(got - want)[:3]}")
            self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])

    @staticmethod
    def _write_file(path: str, state: dict) -> None:
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint behind

    def relabel_version(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < self._version:
            raise ValueError(f"can only move the weight version forward (from {self._version}), got {version!r}")
        self._version = version

    def load_checkpoint(self, path: str) -> None:
        """A ``.pt`` file or a ``.dcp`` directory, written at any world size (resharded to this one)."""
        if os.path.isdir(path):
            self._load_dcp(path)
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("format") != self.CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a {self.CHECKPOINT_FORMAT} checkpoint (format={state.get('format')!r})")
        self._check_resumable(path, state["recipe_linear"], state.get("lora"))
        if not self._sharded_state:
            self._restore_checkpoint_state(state)
        else:  # a single rank's file, every rank reading it: keep this rank's shards of weights and AdamW state
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, state["model"],  # a LoRA checkpoint: the adapters (checked above)
                                 options=StateDictOptions(full_state_dict=True, strict=self.lora is None))
            set_optimizer_state_dict(self.model, self.optimizer, _by_name(self.model, state["optimizer"]),
                                     options=full)
        torch.set_rng_state(state["rng"])
        self._version = int(state["version"])

    def _check_resumable(self, path: str, linear: str | None, lora: dict | None) -> None:
        """:func:`~.resume_checks.check_resumable` of a checkpoint's record against this trainer's."""
        check_resumable(path, linear, lora, recipe_linear=self.recipe.linear, model_record=self._model_record)

    def _leads(self) -> bool:
        return self.parallel is None or self.parallel.leader

    def _barrier(self) -> None:
        if self.parallel is not None:
            self.parallel.barrier()

    def _save_dcp(self, path: str) -> None:
        """Every rank writes its shards into ``path.tmp``; rank 0 adds the metadata and renames it to ``path``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        target = Path(path).absolute()
        tmp = target.with_name(target.name + ".tmp")
        if self._leads():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way
        self._barrier()
        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd, "rng": torch.get_rng_state()}, checkpoint_id=str(tmp))
        if self._leads():
            meta = {"format": self.CHECKPOINT_FORMAT, "version": self._version, "recipe_linear": self.recipe.linear,
                    "world_size": 1 if self.parallel is None else self.parallel.world, **self._model_record}
            (tmp / self.DCP_META).write_text(json.dumps(meta))
            old = target.with_name(target.name + ".old")
            if target.exists():  # a named checkpoint saved again
                target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        self._barrier()

    def _load_dcp(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        meta_file = Path(path) / self.DCP_META
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a {self.CHECKPOINT_FORMAT} checkpoint: {meta_file}: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != self.CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a {self.CHECKPOINT_FORMAT} checkpoint ({self.DCP_META}: {meta!r:.200})")
        self._check_resumable(path, meta.get("recipe_linear"), meta.get("lora"))
        msd, osd = get_state_dict(self.model, self.optimizer)  # this world's layout; DCP reshards into it
        state = {"model": msd, "optim": osd, "rng": torch.get_rng_state()}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.set_rng_state(state["rng"])
        self._version = int(meta["version"])


def _add_metrics(totals: dict[str, float], weights: dict[str, float], loss: float, m: dict, n_mb: int) -> None:
    """Add one micro-batch's loss and metrics ``m`` (over ``n_mb`` tokens) to the running sums: sums for the
    globally-normalised values, token-weighted sums (and their weights) for the rest."""
    totals["loss"] = totals.get("loss", 0.0) + loss
    for k, v in m.items():
        if k in ("pg_loss", "kl", "num_tokens"):
            totals[k] = totals.get(k, 0.0) + float(v)
        else:  # a zero-token micro-batch adds nothing (and its key exists on every rank)
            totals[k] = totals.get(k, 0.0) + (float(v) * n_mb if n_mb else 0.0)
            weights[k] = weights.get(k, 0.0) + n_mb


def _filler(batch: TrainBatch) -> TrainBatch:
    """A one-row, zero-token micro-batch: its loss and gradient are exactly 0 (a rank with no rows left in a
    round runs it, since FSDP's forward and backward are collectives)."""
    f = batch.slice(0, 1)
    f.loss_mask = torch.zeros_like(f.loss_mask)
    f.advantages = torch.zeros_like(f.advantages)
    return f


def _by_name(model: torch.nn.Module, osd: dict) -> dict:
    """``torch.optim`` state (keyed by parameter position) keyed by parameter name instead, as
    ``set_optimizer_state_dict`` takes it; positions follow the trained parameters, in model order, which built the
    optimizer."""
    named = list(model.named_parameters())
    if any(not p.requires_grad for _, p in named):  # a LoRA trainer's optimizer holds its adapters alone
        named = [(n, p) for n, p in named if p.requires_grad]
    names = [n for n, _ in named]
    return {"state": {names[i]: st for i, st in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
