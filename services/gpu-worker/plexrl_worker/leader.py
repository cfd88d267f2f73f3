"""A dispatch from a deposed scheduler is skipped.

Schedulers take turns leading under the `scheduler` lease; each term has a token higher
than any before (`plexrl.lease`) and puts it on every dispatch it sends
(`Dispatch.leader_token`). A leader cut off from the cluster may still get a dispatch
through after a newer one took over (held in a buffer through the partition, a Kafka
send retried): the worker compares the dispatch's token with the lease's latest, read
from Redis as the dispatch arrives, and skips it when a newer term began. Its calls are
not lost: the new leader read them again from the requests topic and dispatches them
itself. (Running them would not apply a numbered call twice either, the ledger sees to
that, but it would run work twice and race the new leader's plan.)
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from plexrl.messages import Dispatch

log = logging.getLogger(__name__)


class LeaderFence:
    def __init__(self, redis: aioredis.Redis, token_key: str) -> None:
        self._redis = redis
        self._token_key = token_key
        self.skipped = 0

    async def deposed(self, dispatch: Dispatch) -> bool:
        """True when a newer scheduler term began since this dispatch was sent."""
        if not dispatch.leader_token:
            return False  # no leader election: one scheduler
        raw = await self._redis.get(self._token_key)
        latest = int(raw) if raw is not None else 0
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
