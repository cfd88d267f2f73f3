"""A dispatch from a deposed scheduler is skipped.

Schedulers take turns leading under the `scheduler` lease; each term has a token higher
than any before (`plexrl.lease`) and puts it on every dispatch it sends
(`Dispatch.leader_token`). A leader cut off from the cluster may still get a dispatch
through after a newer one took over (held in a buffer through the partition, a Kafka
send retried): the worker compares the dispatch's token with the lease's latest, read
from Redis before the dispatch runs (with the poll's other reads, `PollIntake`), and
skips it when a newer term began; a dispatch of pure calls that moves nothing is
compared as each call is recorded instead (`plexrl.stores.calls.RecordFence`), and its
calls' records refused. Its calls are
not lost: the new leader read them again from the requests topic and dispatches them
itself. (Running them would not apply a numbered call twice either, the ledger sees to
that, but it would run work twice and race the new leader's plan.)
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis

from plexrl.messages import Dispatch

log = logging.getLogger(__name__)


class LeaderFence:
    def __init__(self, redis: aioredis.Redis, token_key: str) -> None:
        self._redis = redis
        self._token_key = token_key
        self.skipped = 0

    @property
    def token_key(self) -> str:
        """The Redis key of the latest term's token."""
        return self._token_key

    def queue_latest(self, pipe: Any) -> None:
        """The latest token's read on a pipeline of this fence's Redis client; its reply
        is read with `latest_of`."""
        pipe.get(self._token_key)

    @staticmethod
    def latest_of(reply: Any) -> int:
        return int(reply) if reply is not None else 0

    async def deposed(self, dispatch: Dispatch, latest: int | None = None) -> bool:
        """True when a newer scheduler term began since this dispatch was sent.
        `latest`: the latest token read ahead (`PollIntake`); None reads it."""
        if not dispatch.leader_token:
            return False  # no leader election: one scheduler
        if latest is None:
            latest = self.latest_of(await self._redis.get(self._token_key))
        if dispatch.leader_token >= latest:
            return False
        self.skipped += 1
        log.warning(
            "dispatch %s is from a deposed scheduler (token %d, the leader's is %d): skipped",
            dispatch.dispatch_id,
            dispatch.leader_token,
            latest,
        )
        return True
