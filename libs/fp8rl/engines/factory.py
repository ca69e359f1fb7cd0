"""The trainer backend a job asks for (``policy.training.backend: torch | megatron``), built in one place."""

from __future__ import annotations

import importlib.util

from fp8rl.model import CausalLM

from .base import TrainerBackend
from .torch_trainer import TorchTrainer

__all__ = ["make_trainer_backend", "TRAINER_BACKENDS"]

TRAINER_BACKENDS = ("torch", "megatron")


def make_trainer_backend(job, policy: CausalLM, *, ref_model: CausalLM | None = None) -> TrainerBackend:
    """The :class:`TrainerBackend` of ``job`` (a :class:`fp8rl.config.JobConfig`) on ``policy``'s weights.

    Raises:
        ValueError: an unknown backend, a missing ``megatron-core`` install, or settings the chosen
            backend cannot run (e.g. tensor/pipeline parallel sizes other than 1 for megatron);
            the message names the key.
    """
    backend = job.get("policy.training.backend")
    common = dict(ref_model=ref_model, seed=job.get("job.seed"))
    if backend == "torch":
        return TorchTrainer(policy, job.fp8_recipe("trainer"), job.trainer_config(), **common)
    if backend == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise ValueError("policy.training.backend: 'megatron' needs megatron-core, which is not installed: "
                             "pip install 'fp8rl[megatron]' (or `make test-megatron`, which installs it into .venv)")
        from .megatron.trainer import MegatronTrainer

        mc = job.get("policy.training.megatron_cfg")
        return MegatronTrainer(policy, job.fp8_recipe("trainer"), job.trainer_config(), **common,
                               tensor_model_parallel_size=mc["tensor_model_parallel_size"],
                               pipeline_model_parallel_size=mc["pipeline_model_parallel_size"])
    raise ValueError(f"policy.training.backend: {backend!r} is not one of {', '.join(TRAINER_BACKENDS)}")
