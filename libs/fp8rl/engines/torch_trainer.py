"""The embedded trainer backend (``backend: torch``): GRPO steps on a :class:`CausalLM`.

FP8 recipes swap the transformer layers' linears for :class:`fp8rl.fp8.Fp8Linear` (master weights
kept; forward and both backward GEMMs in block-scaled FP8); ``bf16`` and ``fp8_gen_only`` train
in high precision. Loss aggregation is token-level over the global batch: micro-batch losses are
divided by the *global* number of generated tokens, so gradient accumulation sums to exactly the
full-batch gradient. Checkpoints hold weights, optimizer state, RNG state and the version, and
resume bit-identically. A ``should_stop`` check runs before every micro-batch; a step it stops leaves
weights, optimizer and version as they were.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fp8rl.fp8 import Fp8Recipe, convert_model
from fp8rl.model import CausalLM
from fp8rl.rl import LossConfig, policy_loss

from .base import ShouldStop, TrainBatch, TrainerBackend, check_stop

__all__ = ["TrainerConfig", "TorchTrainer", "sequence_logprobs"]


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
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 16
    num_minibatches: int = 1
    temperature: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"TrainerConfig.lr must be > 0, got {self.lr}")
        if self.micro_batch_size < 1:
            raise ValueError(f"TrainerConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.num_minibatches < 1:
            raise ValueError(f"TrainerConfig.num_minibatches must be >= 1, got {self.num_minibatches}")
        if self.temperature < 0:
            raise ValueError(f"TrainerConfig.temperature must be >= 0, got {self.temperature}")


def sequence_logprobs(
    model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``(B, T)`` logprob of each token given its prefix (0 at t = 0), under ``logits / temperature``."""
    logits = model(input_ids, attention_mask=attention_mask)  # (B, T, V) FP32
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1)  # predicts tokens 1..T-1
    tok = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return F.pad(tok, (1, 0))  # (B, T)


class TorchTrainer(TrainerBackend):
    """Embedded trainer.

    Args:
        model: the policy (its own deep copy is converted per ``recipe`` and trained).
        recipe: the trainer's :class:`Fp8Recipe` (``recipe_for_role(job_recipe, "trainer")``).
        config: optimisation settings.
        ref_model: frozen reference policy for the KL term (kept in high precision), or None.
        initial_version: version of ``model``'s weights.
        seed: seeds the trainer's RNG (dropout-free models only use it for bookkeeping).
    """

    CHECKPOINT_FORMAT = "fp8rl-torch-trainer/1"

    def __init__(
        self,
        model: CausalLM,
        recipe: Fp8Recipe,
        config: TrainerConfig = TrainerConfig(),
        *,
        ref_model: CausalLM | None = None,
        initial_version: int = 0,
        seed: int = 0,
    ) -> None:
        self.recipe = recipe
        self.config = config
        self.model = self._build_policy(model, recipe).train()
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = self._build_reference(ref_model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self._version = initial_version
        torch.manual_seed(seed)

    def _build_policy(self, model: CausalLM, recipe: Fp8Recipe) -> torch.nn.Module:
        """The trained module: a deep copy of ``model`` with its linears converted per ``recipe``."""
        return convert_model(copy.deepcopy(model), recipe, mode="train")

    def _build_reference(self, ref_model: CausalLM) -> torch.nn.Module:
        """The frozen KL reference, kept in high precision."""
        return copy.deepcopy(ref_model)

    @property
    def version(self) -> int:
        return self._version

    def _micro_batches(self, batch: TrainBatch, should_stop: ShouldStop | None = None):
        mb = self.config.micro_batch_size
        for start in range(0, batch.input_ids.shape[0], mb):
            check_stop(should_stop, "training step")
            yield batch.slice(start, start + mb)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, should_stop: ShouldStop | None = None) -> torch.Tensor:
        return self._logprobs_of(self.model, batch, should_stop)

    @torch.no_grad()
    def _logprobs_of(self, model: CausalLM, batch: TrainBatch, should_stop: ShouldStop | None = None) -> torch.Tensor:
        outs = [
            sequence_logprobs(model, mb.input_ids, mb.attention_mask, self.config.temperature)
            for mb in self._micro_batches(batch, should_stop)
        ]
        return torch.cat(outs, dim=0)

    def train_step(self, batch: TrainBatch, *, should_stop: ShouldStop | None = None) -> dict[str, float]:
        if batch.prev_logprobs is None:
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
                m = self._update(batch.slice(lo, hi), should_stop)
                for key, val in m.items():
                    totals[key] = totals.get(key, 0.0) + val / k
        except Exception:
            if snapshot is not None:
                self.model.load_state_dict(snapshot[0])
                self.optimizer.load_state_dict(snapshot[1])
            raise
        self._version += 1
        totals["lr"] = self.config.lr
        return totals

    def _update(self, batch: TrainBatch, should_stop: ShouldStop | None = None) -> dict[str, float]:
        """One optimizer update on ``batch`` (token-level mean over its generated tokens)."""
        num_tokens = max(batch.num_tokens, 1)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        for mb in self._micro_batches(batch, should_stop):  # Cancelled here: no optimizer step taken
            n_mb = mb.num_tokens
            if n_mb == 0:
                continue
            curr = sequence_logprobs(self.model, mb.input_ids, mb.attention_mask, self.config.temperature)
            loss, m = policy_loss(
                curr, mb.prev_logprobs, mb.gen_logprobs, mb.advantages, mb.loss_mask, self.config.loss,
                ref_logprobs=mb.ref_logprobs, num_tokens=num_tokens,
            )
            loss.backward()
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for k, v in m.items():  # sums for globally-normalised values, token-weighted means otherwise
                if k in ("pg_loss", "kl", "num_tokens"):
                    totals[k] = totals.get(k, 0.0) + float(v)
                else:
                    totals[k] = totals.get(k, 0.0) + float(v) * n_mb
                    weights[k] = weights.get(k, 0.0) + n_mb
        for k, w in weights.items():
            totals[k] /= max(w, 1.0)
        if self.config.grad_clip > 0:
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        else:
            gn = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.model.parameters() if p.grad is not None])
            )
        if not torch.isfinite(gn):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {float(gn)} at version {self._version}; step skipped")
        self.optimizer.step()
        totals["grad_norm"] = float(gn)
        return totals

    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the master weights in place (e.g. to start from a published version)."""
        self.model.load_state_dict(tensors, strict=not self.model.config.tie_word_embeddings)

    def save_checkpoint(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        state = {
            "format": self.CHECKPOINT_FORMAT,
            "version": self._version,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "recipe_linear": self.recipe.linear,
        }
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint behind

    def relabel_version(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < self._version:
            raise ValueError(f"can only move the weight version forward (from {self._version}), got {version!r}")
        self._version = version

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("format") != self.CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not a {self.CHECKPOINT_FORMAT} checkpoint (format={state.get('format')!r})")
        if state["recipe_linear"] != self.recipe.linear:
            raise ValueError(
                f"{path} was trained with {state['recipe_linear']} linears, this trainer uses {self.recipe.linear}"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self._version = int(state["version"])
