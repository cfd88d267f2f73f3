"""More than one dispatch in flight per worker: a job's next calls follow its dispatch.

The policy sends a worker one dispatch at a time and decides again when it ends, so
between two dispatches of one job the worker idles for a whole round trip (its
completions to the scheduler, a pass, the next dispatch back). When the job running
there has more calls queued and no other job homed on the worker waits, there is no
choice to make: those calls are sent at once, behind the running dispatch on the
worker's topic (the worker's intake takes them as soon as it is done), numbered and
fenced as any dispatch, as far as the policy's own rules for a Run allow
(`plexrl.policy.follow_up`: never behind or of a sample batch, within the quantum on a
shared worker). The worker counts as running that job until all are answered.
Calls of a job holding a direct lease never reach the scheduler's queue; this is for
the others (a job whose lease was revoked, or leases off).
"""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.policy import PolicyConfig, follow_up
from plexrl_scheduler.actuator import Actuator
from plexrl_scheduler.state import ClusterState


@dataclass(frozen=True)
class PipelineConfig:
    """How far a worker's dispatches run ahead of the scheduler."""

    depth: int = 2
    """Dispatches in flight per worker at most (1: one at a time, decided each time)."""

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(
                f"depth is {self.depth}; it must be at least 1 (1 sends one dispatch at a time)"
            )


class FollowUps:
    def __init__(
        self,
        state: ClusterState,
        actuator: Actuator,
        config: PipelineConfig,
        policy: PolicyConfig,
    ) -> None:
        self._state = state
        self._actuator = actuator
        self._config = config
        self.policy = policy
        """What the follow-ups are decided by (its costs move as the workers measure them)."""
        self._refused: dict[str, tuple[str, int]] = {}
        """By worker: the dispatch and its job's queue length when nothing could follow
        it; not asked again until either changes (a follow-up missed is decided when the
        dispatch ends)."""

    async def step(self) -> None:
        if self._config.depth < 2:
            return
        state, refused = self._state, self._refused
        for worker_id, run in list(state.inflight.items()):
            if run.dispatches >= self._config.depth:
                continue
            asked = (run.dispatch_id, state.queued_count(run.job_id))
            if refused.get(worker_id) == asked:
                continue
            calls = self.calls(worker_id)
            if calls:
                refused.pop(worker_id, None)
                await self._actuator.follow_up(worker_id, list(calls))
            else:
                refused[worker_id] = asked

    def calls(self, worker_id: str) -> tuple[str, ...]:
        """The calls that may follow the worker's dispatch in flight now: none where its
        state rules them out (`ClusterState.follow_up_running`), else as the policy says
        from the worker's group alone (`plexrl.policy.follow_up`)."""
        running = self._state.follow_up_running(worker_id)
        if running is None:
            return ()
        snapshot = self._state.snapshot((worker_id,))
        return follow_up(snapshot, self.policy, worker_id, running)
