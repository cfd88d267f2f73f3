"""The gateway refuses a new training model no live worker group could hold, with a 400
that names its size, the groups' sizes and what to change; the groups are the worker
records in Redis as their heartbeats wrote them."""

from __future__ import annotations

import time

import pytest

from plexrl.messages import JobSpec, LoraSpec, RankMemory, WorkerHeartbeat, encode
from plexrl.stores import Stores
from plexrl_gateway.errors import ApiError
from plexrl_gateway.placement import Placement

MB = 10**6


async def beat(
    stores: Stores, worker_id: str, ranks: int, per_rank: int, age_s: float = 0.0
) -> None:
    now = time.time()
    heartbeat = WorkerHeartbeat(
        worker_id=worker_id,
        device="cpu",
        device_bytes=ranks * per_rank,
        host_bytes=ranks * 10**9,
        base_models=["plexrl/tiny-qwen3"],
        resident=[],
        busy=False,
        started_at=now - 100,
        sent_at=now - age_s,
        devices=ranks,
        ranks=[RankMemory(r, "cpu", per_rank, 0, 0) for r in range(ranks)],
    )
    await stores.workers.put_worker(worker_id, encode(heartbeat), 60)


FULL = JobSpec(base_model="plexrl/tiny-qwen3", state_bytes=8 * MB)
LORA = JobSpec(base_model="plexrl/tiny-qwen3", lora=LoraSpec(rank=4), state_bytes=3 * MB)


async def test_a_job_bigger_than_every_groups_ranks_is_refused_with_what_to_change(
    stores: Stores,
) -> None:
    placement = Placement(stores.workers, timeout_s=6.0)
    await placement.check("m1", FULL)  # no group has reported yet: it waits for one
    await beat(stores, "w0", 1, 5 * MB)
    await beat(stores, "w1", 1, 5 * MB)
    await placement.check("m2", LORA)
    with pytest.raises(ApiError) as refused:
        await placement.check("m3", FULL)
    assert refused.value.status == 400
    message = refused.value.message
    assert "8000000 bytes" in message and "1 rank(s) x 5000000 bytes" in message
    assert "PLEXRL_WORKER_RANKS" in message


async def test_a_live_two_rank_group_takes_it_and_a_silent_one_does_not(stores: Stores) -> None:
    placement = Placement(stores.workers, timeout_s=6.0)
    await beat(stores, "w0", 1, 5 * MB)
    await beat(stores, "g", 2, 5 * MB, age_s=30.0)  # stopped heartbeating
    with pytest.raises(ApiError):
        await placement.check("m1", FULL)
    await beat(stores, "g", 2, 5 * MB)
    await placement.check("m1", FULL)
    groups = {g.worker_id: g for g in await placement.groups()}
    assert groups["g"].devices == 2 and groups["g"].device_bytes == 10 * MB
