"""The engine's tunables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How a TorchEngine runs; one per worker."""

    device: str = "cpu"
    """Torch device for base models and job states: `cpu`, `cuda`, `cuda:1`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of model weights. LoRA adapters and logits are float32 either way; only
    float32 is bit-deterministic across swaps on CPU (the tested path)."""
    max_batch_tokens: int = 16384
    """Padded tokens in one forward pass; larger calls run as micro-batches (gradients add up
    across them, so results depend on this value, never on what else runs)."""
    max_samplers: int = 64
    """Sampler weight sets (`install_sampler`) kept installed. An RL loop saves new
    sampler weights every step, so without a bound they would pile up for the worker's
    lifetime; beyond it the least recently sampled sets that no running call reads are
    dropped, and a later call on one is installed again from the state-store. Keep it at
    least the scheduler's `max_cosampled_calls` (32), so one co-batched run never drops
    a set it is about to read."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel of the Hugging Face models."""
    num_threads: int | None = None
    """CPU threads torch may use, process-wide (None: torch's default, one per core). Set it
    when several workers share a host: oversubscribed cores make small models several times
    slower (measured 4x on 2 busy cores)."""

    def __post_init__(self) -> None:
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(
                f"device {self.device!r} is not a torch device; use 'cpu' or 'cuda[:N]'"
            ) from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device {self.device!r} asked for, but CUDA is not available; use 'cpu'"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(_DTYPES)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads is {self.num_threads}; use 1 or more, or None")
        if self.max_samplers < 1:
            raise ValueError(f"max_samplers is {self.max_samplers}; it must be at least 1")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens is {self.max_batch_tokens}; it must be at least 1")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
