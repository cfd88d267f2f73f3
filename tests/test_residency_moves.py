"""A worker cut off while its job was re-homed comes back to a dispatch that moves the
job's state: the residency record (real Redis) names the new home, so this worker drops
its copy instead of moving it, and the dispatch goes on (it used to fail on the record,
then on the copy it had offloaded meanwhile, and was dead-lettered with its calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from plexrl.messages import Tier
from plexrl.stores import Residency, Stores
from plexrl_worker.residency import StateManager

pytestmark = pytest.mark.integration


@dataclass
class Engine:
    """The executor's edge: which states it holds, and what was done to them."""

    held: set[str] = field(default_factory=set)
    done: list[str] = field(default_factory=list)

    async def offload(self, job_id: str) -> None:
        self.done.append(f"offload {job_id}")

    async def drop(self, job_id: str) -> None:
        self.held.discard(job_id)
        self.done.append(f"drop {job_id}")


@dataclass
class QuietPublisher:
    sent: list[Any] = field(default_factory=list)

    async def publish_soon(self, topic: str, key: Any, message: Any) -> None:
        self.sent.append(message)


def manager(stores: Stores, engine: Engine) -> StateManager:
    return StateManager(
        worker_id="worker-0",
        executor=engine,  # type: ignore[arg-type]
        residency=stores.residency,
        store=None,  # type: ignore[arg-type]
        publisher=QuietPublisher(),  # type: ignore[arg-type]
        events_topic="events",
    )


async def test_a_state_re_homed_elsewhere_is_dropped_not_moved(stores: Stores) -> None:
    engine = Engine(held={"job"})
    states = manager(stores, engine)
    await states.created("job", 1000)
    assert states.tier("job") == Tier.DEVICE
    # Re-homed while this worker was cut off: the new home restored it and wrote its record.
    now = await stores.residency.get_residency("job")
    assert now is not None
    moved = Residency("worker-1", Tier.DEVICE, 1000, now.version + 1, now.updated_at)
    assert await stores.residency.cas_residency("job", now.version, moved)
    assert await states.move("job", Tier.HOST) == 0.0
    assert engine.done == ["drop job"] and states.tier("job") is None
    record = await stores.residency.get_residency("job")
    assert record is not None and record.worker_id == "worker-1"  # left alone


async def test_a_state_still_here_moves_as_before(stores: Stores) -> None:
    engine = Engine(held={"job"})
    states = manager(stores, engine)
    await states.created("job", 1000)
    assert await states.move("job", Tier.HOST) >= 0.0
    assert engine.done == ["offload job"] and states.tier("job") == Tier.HOST
    record = await stores.residency.get_residency("job")
    assert record is not None and (record.worker_id, record.tier) == ("worker-0", Tier.HOST)
