"""The lease with fencing tokens (plexrl.lease) over the real Redis: one holder at a time,
a higher token each term, a deposed holder's writes refused by the token, and a holder
cut off from Redis stepping down before its lease could run out in Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.exceptions

from plexrl.lease import FENCE_CHECK, Leadership, Lease, LeaseConfig, Term
from plexrl.redis_target import ReplicaLagError
from plexrl.stores import Stores

pytestmark = pytest.mark.integration

QUICK = LeaseConfig(ttl_s=1.0, renew_s=0.2, retry_s=0.05, margin_s=0.2)

# KEYS: token key, target. ARGV: token, value. Writes only while the token is the latest.
_FENCED_SET = (
    FENCE_CHECK
    + """
if fenced_by(KEYS[1], ARGV[1]) then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""
)


def lease_of(stores: Stores, holder: str, config: LeaseConfig = QUICK) -> Lease:
    return Lease(stores.keys.redis, stores.keys.key("lease", "x"), holder, config=config)


def test_a_lease_that_could_run_out_between_renewals_is_refused() -> None:
    with pytest.raises(ValueError, match="renew_s must be positive and below ttl_s"):
        LeaseConfig(ttl_s=1.0, renew_s=0.9, margin_s=0.2)


async def test_one_holder_at_a_time_and_every_term_a_higher_token(stores: Stores) -> None:
    a, b = lease_of(stores, "a"), lease_of(stores, "b")
    first = await a.try_acquire()
    assert first is not None and await b.try_acquire() is None
    holder = await b.current()
    assert holder is not None and (holder.holder, holder.token) == ("a", first.token)
    await a.release(first)
    second = await b.try_acquire()
    assert second is not None and second.token > first.token
    assert not await a.renew(first)  # not a's any more
    assert await b.renew(second)


async def test_a_deposed_holders_write_is_refused_by_its_token(stores: Stores) -> None:
    a, b = lease_of(stores, "a"), lease_of(stores, "b")
    write = stores.keys.redis.register_script(_FENCED_SET)
    target = stores.keys.key("fenced-target")
    old = await a.try_acquire()
    assert old is not None
    assert await write(keys=[a.token_key, target], args=[old.token, "from a"]) == 1
    await stores.keys.redis.delete(a.key)  # a's lease ran out (it was cut off)
    new = await b.try_acquire()
    assert new is not None
    # a's write arrives late (held in a buffer through a partition): refused.
    assert await write(keys=[a.token_key, target], args=[old.token, "late from a"]) == 0
    assert await write(keys=[b.token_key, target], args=[new.token, "from b"]) == 1
    assert await stores.keys.redis.get(target) == b"from b"


class CutOff(Lease):
    """A lease whose commands stop reaching Redis after `cut_at` (a partition)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cut_at: float | None = None

    async def _reach(self) -> None:
        if self.cut_at is not None and time.monotonic() >= self.cut_at:
            await asyncio.sleep(0.05)
            raise redis.exceptions.ConnectionError("cut off")

    async def renew(self, term: Term) -> bool:
        await self._reach()
        return await super().renew(term)

    async def try_acquire(self) -> Term | None:
        await self._reach()
        return await super().try_acquire()


async def test_a_leader_cut_off_steps_down_before_another_can_take_over(
    stores: Stores,
) -> None:
    cut = CutOff(stores.keys.redis, stores.keys.key("lease", "x"), "a", config=QUICK)
    leader, standby = Leadership(cut), Leadership(lease_of(stores, "b"))
    ended_at: dict[str, float] = {}
    started_at: dict[str, float] = {}

    async def work(name: str, term: Term, ended: asyncio.Event) -> None:
        started_at[name] = time.monotonic()
        await ended.wait()
        ended_at.setdefault(name, time.monotonic())

    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    run_a = asyncio.create_task(leader.run(stop_a, lambda t, e: work("a", t, e)))
    await asyncio.sleep(0.3)
    assert leader.leading
    run_b = asyncio.create_task(standby.run(stop_b, lambda t, e: work("b", t, e)))
    cut.cut_at = time.monotonic()
    try:
        deadline = time.monotonic() + 5
        while "b" not in started_at and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert "b" in started_at, "the standby never took over"
        # The cut-off leader stopped leading before the standby began: no overlap.
        assert ended_at["a"] < started_at["b"]
        assert started_at["b"] - cut.cut_at <= QUICK.ttl_s + QUICK.retry_s + 0.5
    finally:
        stop_a.set()
        stop_b.set()
        await asyncio.gather(run_a, run_b)


async def test_a_leader_whose_work_ends_cancelled_seeks_the_lease_again(stores: Stores) -> None:
    leadership = Leadership(lease_of(stores, "a"))
    terms: list[int] = []

    async def work(term: Term, ended: asyncio.Event) -> None:
        terms.append(term.token)
        if len(terms) == 1:  # cancelled from within (a library's task, say)
            raise asyncio.CancelledError
        await ended.wait()

    stop = asyncio.Event()
    running = asyncio.create_task(leadership.run(stop, work))
    deadline = time.monotonic() + 5
    while len(terms) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    stop.set()
    await running  # the process's own loop never ended early
    assert len(terms) == 2 and terms[1] > terms[0]


async def test_a_renewal_no_replica_confirms_fails(stores: Stores) -> None:
    """A holder cut off together with the Redis primary renews on that primary alone:
    unconfirmed, the renewal counts as failed, so the holder steps down in time."""
    cut_off = False

    async def replicated() -> int:
        if cut_off:
            raise ReplicaLagError("0 of 1 Redis replica(s) hold the write after 1000 ms")
        return 1

    lease = Lease(
        stores.keys.redis, stores.keys.key("lease", "x"), "a", config=QUICK, replicated=replicated
    )
    term = await lease.try_acquire()
    assert term is not None and await lease.renew(term)
    cut_off = True
    with pytest.raises(ReplicaLagError):
        await lease.renew(term)
