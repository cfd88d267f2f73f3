"""A new training model no worker group could ever hold is refused when it is created.

The scheduler admits a job only onto a group whose ranks each hold their share of its
state (`plexrl.policy.common.can_ever_hold`); asked here first, over the groups that
heartbeat now, the same rule answers a job that fits none with a 400 naming its size,
the groups' sizes and what to change, instead of a future that fails later. With no
live group at all the job is accepted and waits for one, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from plexrl.messages import JobSpec, MessageError, WorkerHeartbeat, decode
from plexrl.policy import JobView, WorkerView
from plexrl.policy.common import unplaceable
from plexrl.stores import WorkerStore
from plexrl_gateway.errors import bad_request


class Placement:
    def __init__(
        self, workers: WorkerStore, timeout_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self._workers = workers
        # A group silent for longer counts as gone, as the scheduler counts it.
        self._timeout_s = timeout_s
        self._clock = clock

    async def check(self, model_id: str, spec: JobSpec) -> None:
        """400 if no live worker group can hold the job `spec` describes."""
        why = unplaceable(await self.groups(), _job(model_id, spec))
        if why is not None:
            raise bad_request(why)

    async def groups(self) -> list[WorkerView]:
        """The worker groups heartbeating now, as the policy sees them."""
        now = self._clock()
        views = []
        for worker_id, raw in (await self._workers.workers()).items():
            try:
                beat: WorkerHeartbeat = decode(raw, WorkerHeartbeat)
            except MessageError:
                continue
            views.append(
                WorkerView(
                    worker_id=worker_id,
                    device_bytes=beat.device_bytes,
                    host_bytes=beat.host_bytes,
                    devices=beat.devices,
                    base_models=frozenset(beat.base_models),
                    healthy=now - beat.sent_at < self._timeout_s,
                )
            )
        return views


def _job(model_id: str, spec: JobSpec) -> JobView:
    return JobView(
        job_id=model_id,
        state_bytes=spec.state_bytes,
        # A LoRA adapter (and its moments) is whole on every rank of a group.
        replicated_bytes=spec.state_bytes if spec.lora is not None else 0,
        base_model=spec.base_model,
    )
