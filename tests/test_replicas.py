"""No single process whose loss stops the cluster, part by part: two gateways ordering one
model's calls through the cursor in Redis, clients of several replicas moving on from one
that does not answer, schedulers that take turns leading (a deposed one numbers, fences
and dispatches nothing that counts), and a worker skipping a deposed leader's dispatch.
The whole of it, across hosts with faults, is tests/test_hosts.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI, Response

from plexrl.endpoints import FailoverTransport, failover_client, split_urls
from plexrl.lease import SCHEDULER, FencedError, Lease, LeaseConfig, lease_key
from plexrl.ledger import Ledger
from plexrl.messages import Dispatch
from plexrl.stores import Stores
from plexrl_gateway.sequencer import Sequencer
from plexrl_scheduler.main import stamp_dispatch
from plexrl_tools.cluster import free_port
from plexrl_worker.leader import LeaderFence

# Gateways ---------------------------------------------------------------------------


async def test_a_call_waiting_for_a_lower_seq_id_goes_once_another_gateway_accepted_it(
    stores: Stores,
) -> None:
    a, b = Sequencer(stores.calls, 10.0), Sequencer(stores.calls, 10.0)
    await stores.calls.set_next_seq("job", 3)  # calls 0-2 went before
    order: list[str] = []

    async def on_b() -> None:  # seq_id 4 reached gateway b first
        async with b.turn("job", 4):
            order.append("b:4")

    waiting = asyncio.create_task(on_b())
    await asyncio.sleep(0.3)
    assert order == [] and not waiting.done()
    async with a.turn("job", 3) as turn:  # seq_id 3 reaches gateway a
        order.append("a:3")
        await stores.calls.set_next_seq("job", 4)  # accepted: the cursor moves with it
        turn.settle(stored=True)
    await asyncio.wait_for(waiting, 5.0)
    assert order == ["a:3", "b:4"]


# Several endpoints ------------------------------------------------------------------


@pytest_asyncio.fixture
async def replica() -> AsyncIterator[tuple[str, list[str]]]:
    """One live HTTP endpoint (whose GET /standby answers 503), and the log of what it got."""
    got: list[str] = []
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "PUT"])
    async def anything(path: str, response: Response) -> dict[str, str]:
        got.append(path)
        if path == "standby":
            response.status_code = 503
        return {"path": path}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield f"http://127.0.0.1:{port}", got
    server.should_exit = True
    await serving


async def test_a_client_of_several_replicas_moves_on_from_one_that_does_not_answer(
    replica: tuple[str, list[str]],
) -> None:
    live, got = replica
    dead = f"http://127.0.0.1:{free_port()}"
    async with failover_client(f"{dead},{live}", timeout=2.0) as client:
        assert (await client.put("/blob", content=b"x")).json() == {"path": "blob"}
        assert (await client.get("/again")).status_code == 200
    assert got == ["blob", "again"]
    with pytest.raises(ValueError, match="not an http"):
        split_urls("http://a:1,b:2")


async def test_a_get_answered_503_is_sent_to_the_next_replica(
    replica: tuple[str, list[str]],
) -> None:
    live, got = replica
    transport = FailoverTransport([live, live])
    async with httpx.AsyncClient(base_url=live, transport=transport) as client:
        answered = await client.get("/standby")
    assert answered.status_code == 503 and got == ["standby", "standby"]


# Schedulers taking turns ------------------------------------------------------------


async def test_a_deposed_schedulers_numbers_and_epochs_are_refused(
    stores: Stores, cluster_id: str
) -> None:
    key = lease_key(stores.keys.key, SCHEDULER)
    config = LeaseConfig(ttl_s=1.0, renew_s=0.2, margin_s=0.2)
    old_lease = Lease(stores.keys.redis, key, "old", config=config)
    old = await old_lease.try_acquire()
    assert old is not None
    deposed = Ledger(stores.keys.redis, cluster_id, fence=old_lease.fence(old))
    assert await deposed.assign("job", ["r1"]) == [1]
    await stores.keys.redis.delete(key)  # its lease ran out
    new_lease = Lease(stores.keys.redis, key, "new", config=config)
    new = await new_lease.try_acquire()
    assert new is not None
    leader = Ledger(stores.keys.redis, cluster_id, fence=new_lease.fence(new))
    with pytest.raises(FencedError, match="another leads now"):
        await deposed.assign("job", ["r2"])
    with pytest.raises(FencedError):
        await deposed.bump_epoch("job", "worker-0")
    assert await leader.assign("job", ["r1", "r2"]) == [1, 2]
    assert await leader.bump_epoch("job", "worker-1") == 1


async def test_a_worker_skips_a_dispatch_of_a_deposed_scheduler(stores: Stores) -> None:
    token_key = lease_key(stores.keys.key, SCHEDULER) + ":token"
    fence = LeaderFence(stores.keys.redis, token_key)
    dispatch = Dispatch(dispatch_id="d", worker_id="w", calls=[])
    assert not await fence.deposed(dispatch)  # no leader election at all
    await stores.keys.redis.set(token_key, 7)
    assert not await fence.deposed(stamp_dispatch(dispatch, token=7))
    assert await fence.deposed(stamp_dispatch(dispatch, token=6))
    assert fence.skipped == 1
    assert stamp_dispatch("not a dispatch", token=7) == "not a dispatch"


@pytest.mark.integration
def test_two_schedulers_take_turns_and_the_standby_leads_soon_after_the_leader_dies(
    infra: dict[str, str], cluster_id: str, tmp_path: Path
) -> None:
    ports = [free_port(), free_port()]
    env = {
        **os.environ,
        "PLEXRL_KAFKA_BOOTSTRAP": infra["kafka"],
        "PLEXRL_REDIS_URL": infra["redis"],
        "PLEXRL_CLUSTER_ID": cluster_id,
        "PLEXRL_LEADER_LEASE_S": "3",
    }
    procs = []
    for i, port in enumerate(ports):
        log = (tmp_path / f"scheduler-{i}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "plexrl_scheduler"],
                env={**env, "PLEXRL_SCHEDULER_PORT": str(port), "PLEXRL_SCHEDULER_ID": f"s{i}"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        roles = _roles(ports, until=lambda r: sorted(r) == ["leader", "standby"])
        leader = roles.index("leader")
        standby = 1 - leader
        with httpx.Client() as http:
            detail = http.get(f"http://127.0.0.1:{ports[standby]}/status")
        assert detail.status_code == 503 and f"s{leader}" in detail.text
        procs[leader].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _roles([ports[standby]], until=lambda r: r == ["leader"])
        assert time.monotonic() - killed < 3 + 3.0, "the standby took too long to lead"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _roles(ports: list[int], until: object, timeout_s: float = 180.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    roles: list[str] = []
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            roles = []
            for port in ports:
                try:
                    roles.append(http.get(f"http://127.0.0.1:{port}/healthz").json()["role"])
                except (httpx.HTTPError, KeyError, ValueError):
                    roles.append("")
            if until(roles):  # type: ignore[operator]
                return roles
            time.sleep(0.1)
    raise AssertionError(f"roles stayed {roles}")


async def test_the_gateway_asks_the_scheduler_its_lease_names_first(
    replica: tuple[str, list[str]], stores: Stores
) -> None:
    from plexrl.lease import Lease
    from plexrl_gateway.cluster import ClusterView
    from plexrl_gateway.components import advertised_leader

    live, got = replica
    key = lease_key(stores.keys.key, SCHEDULER)
    lease = Lease(stores.keys.redis, key, "s1", advertised=live)
    assert await lease.try_acquire() is not None
    assert await advertised_leader(stores.keys) == live
    view = ClusterView(
        jobs=stores.jobs,
        workers=stores.workers,
        residency=stores.residency,
        usage=stores.usage,
        # Behind this one name no scheduler answers (a Service over standbys, say).
        scheduler_url=f"http://127.0.0.1:{free_port()}",
        leader_url=lambda: advertised_leader(stores.keys),
    )
    try:
        assert await view.scheduler() == {"path": "status"}
    finally:
        await view.close()
    assert got == ["status"]
