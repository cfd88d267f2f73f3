"""Policy tunables: one small dataclass, passed to the policy and nothing else."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "fifo"
    """Which policy `plan` runs; one of `plexrl.policy.POLICIES`."""
    max_calls_per_run: int = 8
    """Most consecutive calls of one job sent in one Run (one dispatch)."""

    def __post_init__(self) -> None:
        if self.max_calls_per_run < 1:
            raise ValueError(
                f"max_calls_per_run is {self.max_calls_per_run}; it must be at least 1"
            )
