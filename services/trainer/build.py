"""The trainer backend of one rank, built the same way on every rank (rank 0's server and the followers of
:mod:`services.trainer.ranks` both call :func:`build_trainer`; neither imports the other for it)."""

from __future__ import annotations

from fp8rl.engines import make_trainer_backend
from fp8rl.presets import load_policy

__all__ = ["build_trainer"]


def build_trainer(job, policy=None):
    """``(trainer, parallel)``: the job's trainer backend on this rank, over the group of ``policy.training.dp_size``
    ranks (joined here; ``parallel`` None for one). Every rank builds it the same way.

    Raises:
        ValueError: dp_size disagrees with torchrun's world, or the backend cannot run these settings.
    """
    from fp8rl.engines.parallel import group_for

    parallel = group_for(job.policy.training.dp_size, job.trainer_model_parallel)
    if policy is None:
        policy, _, _ = load_policy(job.policy.model, language_model_only=job.policy.language_model_only)
    trainer = make_trainer_backend(job, policy, ref_model=policy if job.loss.kl_coef > 0 else None, parallel=parallel)
    return trainer, parallel
