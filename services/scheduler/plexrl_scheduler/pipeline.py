"""More than one dispatch in flight per worker: a job's next calls follow its dispatch.

The policy sends a worker one dispatch at a time and decides again when it ends, so
between two dispatches of one job the worker idles for a whole round trip (its
completions to the scheduler, a pass, the next dispatch back). When the job running
there has more calls queued and no other job homed on the worker waits, there is no
choice to make: those calls are sent at once, behind the running dispatch on the
worker's topic (the worker's intake takes them as soon as it is done), numbered and
fenced as any dispatch. The worker counts as running that job until all are answered.
Calls of a job holding a direct lease never reach the scheduler's queue; this is for
the others (a job whose lease was revoked, or leases off).
"""

from __future__ import annotations

from dataclasses import dataclass

from plexrl_scheduler.actuator import Actuator
from plexrl_scheduler.state import ClusterState


@dataclass(frozen=True)
class PipelineConfig:
    """How far a worker's dispatches run ahead of the scheduler."""

    depth: int = 2
    """Dispatches in flight per worker at most (1: one at a time, decided each time)."""
    max_calls: int = 8
    """Calls in one follow-up at most (the policy's `max_calls_per_run`)."""

    def __post_init__(self) -> None:
        if self.depth < 1 or self.max_calls < 1:
            raise ValueError(
                f"depth is {self.depth} and max_calls {self.max_calls}; both must be at "
                "least 1 (depth 1 sends one dispatch at a time)"
            )


class FollowUps:
    def __init__(self, state: ClusterState, actuator: Actuator, config: PipelineConfig) -> None:
        self._state = state
        self._actuator = actuator
        self._config = config

    async def step(self) -> None:
        if self._config.depth < 2:
            return
        for worker_id, run in list(self._state.inflight.items()):
            if run.dispatches >= self._config.depth:
                continue
            calls = self._state.follow_up_calls(worker_id, self._config.max_calls)
            if calls:
                await self._actuator.follow_up(worker_id, calls)
