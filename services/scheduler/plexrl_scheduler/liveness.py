"""Notices dead workers and lost dispatches, and puts their calls back in the queue.

A worker whose heartbeats stopped for `worker_timeout_s` is dead: its jobs lose their
home (admission gives each a healthy one at its next call, where the job is restored
from its snapshot and log) and their epoch is bumped at once, so the dead worker, if
it comes back late, can commit none of their calls. A dispatch whose worker is alive
but reports idle well after it was sent was lost on the way (dead-lettered, say): its
lease expires and its unanswered calls go back to the head of the queue.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from plexrl.ledger import Ledger
from plexrl_scheduler.direct import DirectPath
from plexrl_scheduler.state import ClusterState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LivenessConfig:
    """How long silence lasts before the scheduler acts on it."""

    lease_grace_s: float = 5.0
    """A dispatch is lost once its worker has reported idle for this long after it was
    sent; above the worst Kafka delivery lag, or calls are run twice (harmlessly: a
    numbered call is answered from its job's ledger the second time)."""


class Liveness:
    def __init__(
        self,
        state: ClusterState,
        ledger: Ledger,
        config: LivenessConfig,
        direct: DirectPath | None = None,
    ) -> None:
        self._state = state
        self._direct = direct
        self._ledger = ledger
        self._config = config
        self.rehomed = 0
        self.requeued = 0

    async def reap(self) -> None:
        """Re-home the jobs of dead workers; requeue the calls of expired leases."""
        for worker_id in self._state.lost_workers():
            jobs = self._state.on_worker_lost(worker_id)
            for job_id in jobs:
                try:
                    await self._ledger.bump_epoch(job_id, "")
                except Exception:  # admission bumps it again before any new dispatch
                    log.exception("could not fence %s off %s yet", job_id, worker_id)
            if self._direct is not None:  # its direct calls back to the queue, in order
                await self._direct.worker_lost(worker_id)
            self.rehomed += len(jobs)
            log.warning("worker %s is dead: re-homing %d jobs %s", worker_id, len(jobs), jobs)
        for worker_id in self._state.expired_leases(self._config.lease_grace_s):
            calls = self._state.requeue(worker_id)
            self.requeued += len(calls)
            log.warning("dispatch lease on %s expired: requeued %s", worker_id, calls)
