"""The engines a job asks for, each built in one place: the trainer backend (``policy.training.backend:
torch | megatron``) and the rollout engine (``policy.generation.backend: torch | vllm``)."""

from __future__ import annotations

import importlib.util

import torch

from fp8rl.model import CausalLM

from .base import RolloutEngine, TrainerBackend
from .calibrator import QKVCalibrator
from .parallel import DataParallel
from .torch_rollout import TorchRolloutEngine
from .torch_trainer import TorchTrainer

__all__ = ["make_calibrator", "make_trainer_backend", "make_rollout_engine", "replay_route_shape", "TRAINER_BACKENDS",
           "ROLLOUT_BACKENDS"]

TRAINER_BACKENDS = ("torch", "megatron")


def make_trainer_backend(job, policy: CausalLM, *, ref_model: CausalLM | None = None,
                         parallel: DataParallel | None = None) -> TrainerBackend:
    """The :class:`TrainerBackend` of ``job`` (a :class:`fp8rl.config.JobConfig`) on ``policy``'s weights;
    ``parallel``: the data-parallel group of ``policy.training.dp_size`` ranks (:func:`~.parallel.group_for`).

    Raises:
        ValueError: an unknown backend, a missing ``megatron-core`` install, or settings the chosen
            backend cannot run (e.g. tensor/pipeline parallel sizes other than 1 for megatron);
            the message names the key.
    """
    backend = job.policy.training.backend
    ranks, world = job.trainer_ranks, 1 if parallel is None else parallel.world
    if ranks != world:
        raise ValueError(f"policy.training.dp_size: {job.policy.training.dp_size} (x {job.trainer_model_parallel} "
                         f"model-parallel) needs a group of {ranks} ranks, but this trainer is given {world} "
                         f"(parallel.group_for joins the group torchrun started)")
    common = dict(ref_model=ref_model, seed=job.job.seed)
    if backend == "torch":
        return TorchTrainer(policy, job.fp8_recipe("trainer"), job.trainer_config(), **common, parallel=parallel)
    if backend == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise ValueError("policy.training.backend: 'megatron' needs megatron-core, which is not installed: "
                             "pip install 'fp8rl[megatron]' (or `make test-megatron`, which installs it into .venv)")
        from .megatron.trainer import MegatronTrainer

        mc = job.policy.training.megatron_cfg
        return MegatronTrainer(policy, job.fp8_recipe("trainer"), job.trainer_config(), **common,
                               tensor_model_parallel_size=mc.tensor_model_parallel_size,
                               pipeline_model_parallel_size=mc.pipeline_model_parallel_size,
                               expert_model_parallel_size=mc.expert_model_parallel_size,
                               moe_token_dispatcher_type=mc.moe_token_dispatcher_type, parallel=parallel)
    raise ValueError(f"policy.training.backend: {backend!r} is not one of {', '.join(TRAINER_BACKENDS)}")


ROLLOUT_BACKENDS = ("torch", "vllm")


def make_calibrator(job, model: torch.nn.Module, pad_token_id: int) -> QKVCalibrator:
    """The :class:`QKVCalibrator` of ``job``'s ``calibration`` section on ``model`` (the trainer's, or a calibrator's
    own copy): the one construction the loop, the trainer and calibrator services and ``fp8rl.eval`` share."""
    cal = job.calibration
    return QKVCalibrator(model, pad_token_id=pad_token_id, percentile=cal.percentile, margin=cal.margin,
                         max_sequences=cal.max_sequences)


def replay_route_shape(job, config) -> tuple[int, int, int] | None:
    """``(L, K, E)`` when the rollout's routes go to the trainer (``policy.router_replay.enabled`` on a
    mixture-of-experts model ``config``), else None: the one rule the loop and the trainer service share."""
    return config.route_shape if job.policy.router_replay.enabled else None


def make_rollout_engine(job, policy: CausalLM | None, path, *, eos_token_ids: list[int], pad_token_id: int,
                        max_batch_size: int = 64, take_model: bool = False, initial_version: int | None = None,
                        shared_with: torch.nn.Module | None = None) -> RolloutEngine:
    """The :class:`RolloutEngine` of ``job``'s ``policy.generation.backend``: the embedded torch engine on
    ``policy`` (``take_model``: converted in place, not copied — the caller hands it over; ``shared_with``: the
    trainer's module whose tensors it computes with, the in-process loop's one copy), or vLLM on the checkpoint at
    ``path`` (the same weights, resolved by the caller; vLLM loads them itself, so ``policy`` may be None). The
    engine holds ``initial_version`` (None: no version until its first refit).

    Raises:
        ValueError: an unknown backend (the message names the key).
        fp8rl.engines.vllm.launch.VllmUnavailableError / Fp8UnsupportedError: vLLM missing, or no FP8 here.
    """
    backend = job.policy.generation.backend
    if backend == "torch":
        if policy is None:
            raise ValueError("policy.generation.backend: 'torch' runs on the loaded policy; none was given")
        return TorchRolloutEngine(policy, job.fp8_recipe("rollout"), eos_token_ids=eos_token_ids,
                                  pad_token_id=pad_token_id, initial_version=initial_version,
                                  max_batch_size=max_batch_size, seed=job.job.seed,
                                  record_routes=job.policy.router_replay.enabled, take_model=take_model,
                                  shared_with=shared_with, lora=job.lora_settings())
    if shared_with is not None:
        raise ValueError(f"policy.generation.backend: {backend!r} holds its own weights; only the torch engine "
                         "computes with the trainer's")
    if backend == "vllm":  # imported here: vLLM is an optional install
        if job.policy.language_model_only:
            raise ValueError("policy.language_model_only runs on the embedded rollout (policy.generation.backend: "
                             "torch): vLLM would load the whole vision-language model from the checkpoint")
        from .vllm.rollout import VllmRolloutEngine

        return VllmRolloutEngine.from_job(job, path, max_batch_size=max_batch_size)
    raise ValueError(f"policy.generation.backend: unknown rollout engine {backend!r} "
                     f"(expected one of {', '.join(ROLLOUT_BACKENDS)})")
