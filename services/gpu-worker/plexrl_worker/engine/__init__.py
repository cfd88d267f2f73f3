"""The worker's model engines. TorchEngine runs Hugging Face models on CPU or one GPU."""

from plexrl_worker.engine.config import EngineConfig
from plexrl_worker.engine.errors import (
    EngineError,
    EngineInputError,
    JobExistsError,
    NotFoundError,
    UnknownJobError,
)
from plexrl_worker.engine.losses import LOSS_CONFIG_DEFAULTS, LOSS_INPUTS
from plexrl_worker.engine.state import JobTensors, state_from_bytes, state_to_bytes
from plexrl_worker.engine.torch_engine import BASE_PREFIX, TorchEngine

__all__ = [
    "BASE_PREFIX",
    "LOSS_CONFIG_DEFAULTS",
    "LOSS_INPUTS",
    "EngineConfig",
    "EngineError",
    "EngineInputError",
    "JobExistsError",
    "JobTensors",
    "NotFoundError",
    "TorchEngine",
    "UnknownJobError",
    "state_from_bytes",
    "state_to_bytes",
]
