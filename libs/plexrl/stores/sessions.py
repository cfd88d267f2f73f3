"""Client sessions, per tenant."""

from __future__ import annotations

import msgspec

from plexrl.messages import decode, encode
from plexrl.stores.redis import RedisStore, raw_bytes, text


class SessionRecord(msgspec.Struct, frozen=True):
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    tags: list[str] = []
    user_metadata: dict[str, str] = {}


class SessionStore(RedisStore):
    """`session:<id>` (lives `ttl_s` from its last heartbeat) and `tenant:<t>:sessions`."""

    async def put_session(self, session: SessionRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("session", session.session_id), encode(session), ex=self._keys.ttl_s)
            pipe.sadd(self._k("tenant", session.tenant, "sessions"), session.session_id)
            await pipe.execute()

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return await self._get(self._k("session", session_id), SessionRecord)

    async def tenant_sessions(self, tenant: str) -> list[SessionRecord]:
        """The tenant's sessions that have not expired, oldest first."""
        ids = [text(m) for m in await self._redis.smembers(self._k("tenant", tenant, "sessions"))]
        raws = await self._redis.mget([self._k("session", i) for i in ids]) if ids else []
        sessions: list[SessionRecord] = [
            decode(raw_bytes(r), SessionRecord) for r in raws if r is not None
        ]
        return sorted(sessions, key=lambda s: (s.created_at, s.session_id))
