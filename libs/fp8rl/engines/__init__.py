"""Rollout engines and trainer backends behind two small interfaces (see ``base``).

Engines know tensors, never gRPC or Redis. ``engine: torch`` / ``backend: torch`` are the
embedded defaults that run on any CPU; ``backend: megatron`` (subpackage ``megatron``, optional
extra) is built by :func:`make_trainer_backend`.

Invariant: an engine serves or trains at exactly the version it holds (a request pinned to another is
:class:`VersionMismatchError`), and a refit applies weights and QKV scales of one version together or not at all.
"""

from fp8rl.model.lora import LoraSettings  # policy.lora's settings, as the engines take them

from .base import (
    Cancelled,
    RolloutEngine,
    Sample,
    SamplingParams,
    ShouldStop,
    TrainBatch,
    TrainerBackend,
    VersionMismatchError,
    WeightLoadError,
)
from .batch import StaleSampleError, TrainOutcome, build_train_batch, train_on_batch
from .calibration_model import CalibrationModel
from .calibrator import QKVCalibrator
from .factory import make_calibrator, make_rollout_engine, make_trainer_backend, replay_route_shape
from .footprint import MemoryBudgetError
from .logprob_pass import sequence_logprobs
from .torch_rollout import TorchRolloutEngine
from .torch_trainer import TorchTrainer, TrainerConfig

__all__ = [
    "RolloutEngine", "TrainerBackend", "Sample", "SamplingParams", "TrainBatch",
    "VersionMismatchError", "WeightLoadError", "Cancelled", "ShouldStop",
    "TorchRolloutEngine", "TorchTrainer", "TrainerConfig", "LoraSettings", "QKVCalibrator", "CalibrationModel",
    "sequence_logprobs",
    "make_calibrator", "make_trainer_backend", "make_rollout_engine", "replay_route_shape", "TrainOutcome",
    "build_train_batch",
    "train_on_batch",
    "StaleSampleError", "MemoryBudgetError",
]
