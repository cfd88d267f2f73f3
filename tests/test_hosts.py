"""The host bed: the cluster across hosts that are network namespaces on a bridge, each
with its own address (plexrl_tools.hostbed). Kafka is three brokers on three hosts (every
topic three copies, two in sync), Redis a primary and two replicas watched by three
Sentinels, the disk tier SeaweedFS's S3 on a host of its own, the workers on two more,
two schedulers (one leading), two gateways behind one address, two state-stores.

Then host faults, one after another on the same bed, each run compared with the
undisturbed one (no call lost, no step applied twice, losses and checkpoint bytes
bit-identical): a worker's host cut off past the heartbeat timeout, the leading
scheduler's host cut off, and the Redis primary's host killed, which is also a Kafka
broker's host (every process on it: a broker, a Sentinel, a gateway, a state-store).
plexrl_tools.host_faults has two more kinds, a lossy slow link and a broker's host killed and
revived; `bench/chaos.py --hosts` runs every kind, at random, with the link lossy for a
minute (the suite's time budget holds three).

The bed starts once for the module (its start is most of its cost). Needs root;
skipped without it, except under CI=true.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from aiokafka.admin import AIOKafkaAdminClient

from plexrl_tools.faults import (
    JobOutcome,
    StoreCheckpoints,
    Workload,
    differences,
    run_job,
    run_workload,
)
from plexrl_tools.host_faults import FaultConfig, HostFaults
from plexrl_tools.hostbed import KAFKA_PORT, HostBed, kafka_cluster_id
from plexrl_tools.hostnet import can_build

pytestmark = pytest.mark.integration

KEY, TENANT = "tml-hosts", "hosts"
WORKLOAD = Workload(seeds=(1, 2), steps=3)
START_TIMEOUT_S = 900.0
FAULTS = ("worker-partition", "leader-partition", "redis-primary-host-kill")
"""The bounded set, in this order; the last host is not brought back."""
HANDOVER_TARGET_S = 10.0
"""A leader cut off is replaced within this: its lease's 4 s, half a second to ask, the
new leader's start."""


def test_kafka_cluster_ids_never_start_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kafka's storage tool reads a leading '-' as an option (1 id in 64 would)."""
    draws = iter([b"\xf8" + bytes(15), bytes(16)])  # '-' first, then 'A...'
    monkeypatch.setattr("secrets.token_bytes", lambda n: next(draws))
    assert kafka_cluster_id() == "A" * 22


def test_a_job_that_is_not_bit_identical_says_how() -> None:
    ref = [JobOutcome(1, losses=[1.0, 2.0], checkpoint_sha256="a") for _ in range(4)]
    got = [
        JobOutcome(1, losses=[1.0, 2.0], checkpoint_sha256="a"),
        JobOutcome(1, losses=[1.0, 2.5], checkpoint_sha256="a"),
        JobOutcome(1, losses=[1.0, 2.0], checkpoint_sha256=""),
        JobOutcome(1, losses=[1.0, 2.0], checkpoint_sha256="b"),
    ]
    assert differences(ref, got) == [
        "job 1: losses differ from step 2",
        "job 1: its final checkpoint was not found",
        "job 1: its final checkpoint's bytes differ",
    ]


def test_a_call_never_answered_is_a_lost_call_not_a_hang() -> None:
    from concurrent.futures import Future

    class Unanswered:  # the SDK's edge: a create whose result never comes
        def create_lora_training_client(self, **_: object) -> Future[None]:
            return Future()

    started = time.monotonic()
    out = run_job(Unanswered(), Workload(call_timeout_s=0.2), 1, None, "t")  # type: ignore[arg-type]
    assert out.errors == ["a call was not answered within 0.2 s: create_lora_training_client"]
    assert time.monotonic() - started < 5


@pytest.fixture(scope="module")
def host_bed(tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostBed]:
    """A bed of six hosts with the whole cluster on it, removed (namespaces, interfaces,
    processes) when the module ends, also when it fails."""
    from plexrl_tools.private_infra import seaweedfs_binary

    missing = can_build() or (None if seaweedfs_binary() else "no SeaweedFS binary")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the host bed cannot run here: {missing} (scripts/hosts.sh prepare)")
        pytest.skip(f"the host bed cannot run here: {missing} (scripts/hosts.sh prepare)")
    bed = HostBed(
        tmp_path_factory.mktemp("bed"),
        tiny_registry,
        api_keys=f"{KEY}={TENANT}",
        env={"PLEXRL_WORKER_TIMEOUT_S": "3"},
    )
    bed.up(START_TIMEOUT_S)
    try:
        yield bed
    finally:
        bed.down()


@pytest.fixture(scope="module")
def checkpoints(host_bed: HostBed) -> StoreCheckpoints:
    return StoreCheckpoints(host_bed.urls("state-store"), host_bed.cluster.service_token)


@pytest.fixture(scope="module")
def reference(host_bed: HostBed, checkpoints: StoreCheckpoints) -> list[JobOutcome]:
    """The undisturbed run every disturbed one is compared with."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    service = tinker.ServiceClient(base_url=host_bed.gateway_url, api_key=KEY)
    outcomes = run_workload(service, WORKLOAD, checkpoints, TENANT)
    for o in outcomes:
        assert not o.errors and o.steps == list(range(1, WORKLOAD.steps + 1)), o
        assert o.checkpoint_sha256, f"no checkpoint bytes read back for {o.model_id}"
    return outcomes


async def _brokers_and_replicas(bed: HostBed) -> tuple[set[str], dict[str, set[int]]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bed.bootstrap)
    await admin.start()
    try:
        brokers = {b["host"] for b in (await admin.describe_cluster())["brokers"]}
        topics = [t for t in await admin.list_topics() if t.startswith(bed.cluster_id)]
        replicas = {
            t["topic"]: {len(p["replicas"]) for p in t["partitions"]}
            for t in await admin.describe_topics(topics)
        }
    finally:
        await admin.close()
    return brokers, replicas


def test_each_part_runs_on_its_own_host_and_every_topic_has_three_copies(
    host_bed: HostBed, reference: list[JobOutcome]
) -> None:
    brokers, replicas = asyncio.run(_brokers_and_replicas(host_bed))
    assert brokers == {host_bed.address(h) for h in host_bed.layout.brokers}
    assert replicas and all(copies == {3} for copies in replicas.values()), replicas
    assert host_bed.bootstrap.count(f":{KAFKA_PORT}") == 3
    # Redis: the primary where the layout put it, its replicas in sync.
    assert host_bed.redis_primary() == host_bed.layout.redis_primary
    with host_bed.redis_target().connect_sync() as redis:
        replication = redis.info("replication")
    assert replication["role"] == "master"
    assert replication["connected_slaves"] == len(host_bed.layout.redis_replicas)
    # Every service answers at its own host's address, and nowhere else.
    with httpx.Client(timeout=3.0) as http:
        for name, _ in host_bed.layout.services:
            assert http.get(f"{host_bed.url_of(name)}/healthz").status_code == 200, name
            port = host_bed.url_of(name).rsplit(":", 1)[1]
            busy = {h for n, h in host_bed.layout.services if host_bed.url_of(n).endswith(port)}
            elsewhere = next(h for h in host_bed.layout.hosts if h not in busy)
            with pytest.raises(httpx.ConnectError):
                http.get(f"http://{host_bed.address(elsewhere)}:{port}/healthz")


def test_a_job_across_the_hosts_keeps_its_checkpoints_in_the_object_store(
    host_bed: HostBed, reference: list[JobOutcome]
) -> None:
    # The reference run's checkpoints were read back through the state-store from the
    # bucket on the object store's host; none went to a local directory.
    assert all(o.checkpoint_sha256 for o in reference)
    local = host_bed.cluster.config.state_dir / "blobs"
    assert not local.exists() or not any(p.is_file() for p in local.rglob("*"))


@pytest.fixture(scope="module")
def faults(
    host_bed: HostBed, checkpoints: StoreCheckpoints, reference: list[JobOutcome]
) -> HostFaults:
    service = tinker.ServiceClient(base_url=host_bed.gateway_url, api_key=KEY)
    config = FaultConfig(hold_s=8.0)
    return HostFaults(host_bed, service, checkpoints, TENANT, WORKLOAD, reference, config)


@pytest.mark.parametrize("kind", FAULTS)
def test_a_host_fault_changes_nothing_a_job_learns(kind: str, faults: HostFaults) -> None:
    # The last fault's host is not brought back: the module ends with it.
    run = faults.run(kind, at_step=1, delay_s=0.3, revive=kind != FAULTS[-1])
    where = f"{kind} on {run.host}: stall {run.stall_s:.1f}s, failover {run.failover_s}"
    print(where, run.notes)
    assert run.comparison.lost == 0, where
    assert run.comparison.duplicated == 0, where
    assert run.comparison.not_identical == 0, where
    if kind == "leader-partition":
        assert run.failover_s is not None and run.failover_s <= HANDOVER_TARGET_S, where
    if kind in ("worker-partition", "redis-primary-host-kill"):
        assert run.failover_s is not None, f"{where}: never failed over"
