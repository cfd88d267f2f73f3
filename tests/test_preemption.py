"""The worker's pause of a preempted batch: held until the next dispatch lets go of it,
or for a grace period if none comes; the sampler's pause and resume hooks run once."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
from preempt_support import Scene, check_a_rollout_yields, tokens
from tinker import types

from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_worker.preemption import Preemption


def test_a_hold_lasts_until_the_claiming_dispatch_opens_it() -> None:
    hooks: list[str] = []

    async def pause() -> None:
        hooks.append("pause")

    async def resume() -> None:
        hooks.append("resume")

    async def main() -> None:
        p = Preemption(pause=pause, resume=resume, grace_s=0.05)
        asked = p.yieldable("d1")
        assert await p.ask("d1") and asked.is_set()
        p.finished("d1")
        assert not await p.ask("d1")  # released already: nothing to yield
        await p.hold()
        claimed = p.claim()  # the next dispatch claims it: no expiry
        assert p.paused and claimed is not None
        await asyncio.sleep(0.1)
        assert p.paused and p.paused_seconds() >= 0.1  # not charged to the paused call
        await p.open(claimed)
        assert not p.paused and p.claim() is None
        held = p.paused_seconds()
        await asyncio.sleep(0.02)
        assert p.paused_seconds() == held  # no pause, no more
        await asyncio.wait_for(p.wait_open(), 1.0)

    asyncio.run(main())
    assert hooks == ["pause", "resume"]


def test_a_dispatch_lets_go_only_of_the_hold_it_claimed() -> None:
    async def main() -> None:
        p = Preemption(grace_s=0.05)
        await p.hold()
        claimed = p.claim()
        await p.open()  # its own sample calls join the batch: the pause lifts
        await p.hold()  # and its batch is preempted in turn, for the next dispatch
        await p.open(claimed)  # the claiming dispatch ends: the newer hold stays
        assert p.paused
        nxt = p.claim()
        assert nxt is not None and nxt != claimed
        await p.open(nxt)
        assert not p.paused

    asyncio.run(main())


def test_a_hold_no_dispatch_claims_expires() -> None:
    async def main() -> None:
        p = Preemption(grace_s=0.05)
        await p.hold()
        assert p.paused
        await asyncio.wait_for(p.wait_open(), 1.0)
        assert not p.paused and p.preempted == 1

    asyncio.run(main())


# Live: the scheduler preempts a long rollout for a neighbour's training call -------------


@pytest.mark.integration
def test_a_long_rollout_yields_to_a_short_training_call_and_samples_the_same(
    shared_cluster: ClusterConfig,
) -> None:
    # About a second of decoding on two cores; seeded, so the rollout is reproducible.
    params = types.SamplingParams(max_tokens=400, temperature=1.0, seed=11)
    check_a_rollout_yields(shared_cluster.gateway_url, "tml-preempt", params, num_samples=16)


@pytest.mark.integration
def test_a_worker_killed_while_a_rollout_is_preempted_answers_it_after_a_restart(
    infra: dict[str, str], tiny_registry: Path, tmp_path: Path
) -> None:
    # The preempted rollout's dispatch was acknowledged at its release: after the crash
    # Kafka does not bring it back; the scheduler must (it sees the restart in the next
    # heartbeat). The worker timeout is long, so this is a restart, never a lost worker.
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path,
        "prk",
        api_keys="tml-preempt-kill=prk",
        worker_threads=1,
        env={"PLEXRL_WORKER_TIMEOUT_S": "300"},
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    params = types.SamplingParams(max_tokens=400, temperature=1.0, seed=11)
    with LocalCluster(config) as cluster:
        scene = Scene(config.gateway_url, "tml-preempt-kill", params, num_samples=16)
        metrics = f"http://127.0.0.1:{config.worker_port(0)}/metrics"
        long, short = scene.preempting()
        deadline = time.monotonic() + 10
        while _counter(metrics, "plexrl_worker_preempted_batches_total") < 1:
            assert time.monotonic() < deadline, "no preemption"
            time.sleep(0.02)
        cluster.kill("worker-0")  # kill -9, the rollout paused or just resumed
        cluster.restart("worker-0")
        assert short.result(timeout=120).metrics["loss:sum"] == scene.loss
        assert tokens(long.result(timeout=120)) == tokens(scene.alone)
        log = cluster.logs()["scheduler"].read_text()
    assert "worker-0 restarted: requeued" in log  # the rollout was lost with it


def _counter(url: str, name: str) -> float:
    for line in httpx.get(url, timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
