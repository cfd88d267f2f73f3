"""The worker's pause of a preempted batch: held until the next dispatch lets go of it,
or for a grace period if none comes; the sampler's pause and resume hooks run once."""

from __future__ import annotations

import asyncio

import pytest
from preempt_support import check_a_rollout_yields
from tinker import types

from plexrl.cluster import ClusterConfig
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
        assert p.paused
        await p.open(claimed)
        assert not p.paused and p.claim() is None
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
