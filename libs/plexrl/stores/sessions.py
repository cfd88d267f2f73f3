"""Client sessions, per tenant."""

from __future__ import annotations

import msgspec

from plexrl.messages import decode, encode
from plexrl.stores.redis import RedisKeys, RedisStore, raw_bytes, text
from plexrl.stores.tenant_records import (
    NO_CAPS,
    Caps,
    RecordKind,
    RecordWrite,
    TenantRecords,
    metadata_bytes,
)


class SessionRecord(msgspec.Struct, frozen=True):
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    tags: list[str] = []
    user_metadata: dict[str, str] = {}


class SessionStore(RedisStore):
    """`session:<id>` (lives `ttl_s` from its last heartbeat) and `tenant:<t>:sessions`;
    each write moves the tenant's counts (plexrl.stores.tenant_records) in the same
    script, and frees the places of the tenant's sessions that expired."""

    def __init__(self, keys: RedisKeys) -> None:
        super().__init__(keys)
        self._records = TenantRecords(keys)

    async def put_session(self, session: SessionRecord, caps: Caps = NO_CAPS) -> None:
        """Write a session (a new one checked against `caps`: `QuotaExceeded` otherwise)."""
        await self._records.write(
            RecordWrite(
                tenant=session.tenant,
                kind=RecordKind.SESSION,
                record_id=session.session_id,
                record_key=self._k("session", session.session_id),
                id_set_key=self._k("tenant", session.tenant, "sessions"),
                encoded=encode(session),
                ttl_s=self._keys.ttl_s,
                metadata_bytes=metadata_bytes(session.user_metadata, session.tags),
            ),
            caps,
        )

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
