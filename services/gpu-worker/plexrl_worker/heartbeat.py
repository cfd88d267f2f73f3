"""Announces this worker group (its ranks and their memory, base models, resident
states, what sharing it costs as measured) every few seconds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from plexrl.kafka import Publisher
from plexrl.messages import RankMemory, Tier, WorkerHeartbeat, encode
from plexrl.settings import WorkerSettings
from plexrl.stores import WorkerStore
from plexrl_worker import metrics
from plexrl_worker.residency import StateManager
from plexrl_worker.sharing import SharingMeter

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        *,
        settings: WorkerSettings,
        base_models: list[str],
        rank_devices: list[str],
        states: StateManager,
        workers: WorkerStore,
        publisher: Publisher,
        events_topic: str,
        slices_training: bool = False,
        meter: SharingMeter | None = None,
    ) -> None:
        self._settings = settings
        self._meter = meter
        self._slices_training = slices_training
        self._base_models = base_models
        self._rank_devices = rank_devices
        self._states = states
        self._workers = workers
        self._publisher = publisher
        self._topic = events_topic
        self._started_at = time.time()
        self.busy = False

    def beat(self) -> WorkerHeartbeat:
        settings = self._settings
        sharing = self._meter.measured() if self._meter is not None else None
        if sharing is not None:
            metrics.observe_sharing(sharing)
        ranks = len(self._rank_devices)
        on_device = self._states.rank_bytes_in(Tier.DEVICE)
        on_host = self._states.rank_bytes_in(Tier.HOST)
        return WorkerHeartbeat(
            worker_id=settings.worker_id,
            device=settings.worker_device,
            # The group's capacity is its ranks' together; each holds its share of a job.
            device_bytes=settings.worker_device_bytes * ranks,
            host_bytes=settings.worker_host_bytes * ranks,
            base_models=self._base_models,
            resident=self._states.resident(),
            busy=self.busy,
            started_at=self._started_at,
            sent_at=time.time(),
            devices=ranks,
            sampler=settings.sampler,
            slices_training=self._slices_training,
            sharing=sharing,
            ranks=[
                RankMemory(r, device, settings.worker_device_bytes, on_device[r], on_host[r])
                for r, device in enumerate(self._rank_devices)
            ],
        )

    async def send(self) -> None:
        beat = self.beat()
        await self._publisher.publish_soon(self._topic, beat.worker_id, beat)
        ttl = max(2, int(self._settings.heartbeat_s * 10))
        await self._workers.put_worker(beat.worker_id, encode(beat), ttl)
        # Residency is rebuilt from the workers that hold the states after Redis lost it.
        await self._states.reannounce()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.send()
            except Exception:  # a missed beat is logged; the next one may get through
                log.exception("heartbeat failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._settings.heartbeat_s)
