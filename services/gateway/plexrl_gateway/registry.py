"""Sessions, jobs (training models and sampling sessions) and checkpoints, seen per tenant.

Every lookup takes the caller's tenant; an object of another tenant is reported exactly
like a missing one (404), so a key cannot learn what others have. Every record a tenant
creates is checked against its quotas (plexrl.quotas) as it is written: a refusal is a
400 naming the quota, and nothing is stored.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from plexrl.messages import JobSpec
from plexrl.quotas import DEFAULT_QUOTAS, QuotaError, RecordQuotas
from plexrl.stores import (
    CheckpointRecord,
    CheckpointStore,
    JobKind,
    JobRecord,
    JobStore,
    SessionRecord,
    SessionStore,
)
from plexrl.stores.checkpoints import CheckpointGone, is_ephemeral
from plexrl.stores.tenant_records import QuotaExceeded, RecordKind, TenantRecords
from plexrl_gateway.errors import ApiError, bad_request, not_found

Clock = Callable[[], float]


class Registry:
    def __init__(
        self,
        sessions: SessionStore,
        jobs: JobStore,
        checkpoints: CheckpointStore,
        records: TenantRecords,
        quotas: RecordQuotas = DEFAULT_QUOTAS,
        clock: Clock = time.time,
    ) -> None:
        """`records`: what each tenant holds (counted as records are written), read to
        check checkpoints against `quotas`."""
        self._sessions = sessions
        self._jobs = jobs
        self._checkpoints = checkpoints
        self._records = records
        self._quotas = quotas
        self._clock = clock

    # Sessions ------------------------------------------------------------------

    async def new_session(
        self, tenant: str, tags: list[str], user_metadata: dict[str, Any] | None
    ) -> SessionRecord:
        now = self._clock()
        metadata = metadata_strings(user_metadata)
        session = SessionRecord(
            # Ids go into model ids ("<session>:train:<n>") and URL paths: no ':' or '/'.
            session_id=f"sess-{uuid.uuid4().hex[:16]}",
            tenant=tenant,
            created_at=now,
            last_heartbeat=now,
            tags=list(tags),
            user_metadata=metadata,
        )
        with self._quota(tenant):
            self._quotas.check_metadata(RecordKind.SESSION, metadata, tags)
            await self._sessions.put_session(session, self._quotas.caps(RecordKind.SESSION))
        return session

    async def session(self, tenant: str, session_id: str) -> SessionRecord:
        session = await self._sessions.get_session(session_id)
        if session is None or session.tenant != tenant:
            raise not_found(f"unknown session {session_id!r}; create one with create_session")
        return session

    async def heartbeat(self, tenant: str, session_id: str) -> None:
        """Keeps the session (and its TTL) alive."""
        session = await self.session(tenant, session_id)
        await self._sessions.put_session(
            SessionRecord(
                session_id=session.session_id,
                tenant=session.tenant,
                created_at=session.created_at,
                last_heartbeat=self._clock(),
                tags=session.tags,
                user_metadata=session.user_metadata,
            )
        )

    async def sessions(self, tenant: str) -> list[SessionRecord]:
        return await self._sessions.tenant_sessions(tenant)

    # Jobs ------------------------------------------------------------------------

    async def find_job(self, tenant: str, job_id: str) -> JobRecord | None:
        job = await self._jobs.get_job(job_id)
        return job if job is not None and job.tenant == tenant else None

    async def training_model(self, tenant: str, model_id: str) -> JobRecord:
        """A live training model of the tenant; 404 otherwise."""
        job = await self.find_job(tenant, model_id)
        if job is None or job.kind != JobKind.TRAINING:
            raise not_found(f"unknown model {model_id!r}")
        if job.unloaded:
            raise not_found(f"model {model_id!r} was unloaded; create a new one")
        return job

    async def sampling_session(self, tenant: str, session_id: str) -> JobRecord:
        """A sampling session of the tenant; 404 otherwise, and also once the checkpoint
        it samples from may no longer be read (deleted, expired, or another tenant's
        that was unpublished)."""
        job = await self.find_job(tenant, session_id)
        if job is None or job.kind != JobKind.SAMPLING:
            raise not_found(
                f"unknown sampling session {session_id!r}; create one with "
                "create_sampling_session. A sampling client from "
                "save_weights_and_get_sampling_client lasts as long as its snapshot: each "
                "model keeps its newest PLEXRL_EPHEMERAL_KEEP (8 by default) while loaded"
            )
        path = job.sampler_path
        # Ephemeral snapshots are retired with their sessions: no read per sample there.
        if path is not None and not is_ephemeral(path) and not await self._readable(tenant, path):
            raise not_found(
                f"sampling session {session_id!r} samples from {path}, which is no "
                "longer there: it was deleted, its TTL passed, or its owner unpublished "
                "it; sample from another checkpoint"
            )
        return job

    async def put_job(self, job: JobRecord) -> None:
        """Write a job; a new one takes a place under its tenant's quota (400 when none is
        left), a rewrite of one it holds (an unload) never fails for the count."""
        kind = RecordKind.TRAINING if job.kind == JobKind.TRAINING else RecordKind.SAMPLING
        with self._quota(job.tenant):
            if not job.unloaded:  # an unload must go through even after a cap was lowered
                self._quotas.check_metadata(kind, job.metadata)
            await self._jobs.put_job(job, self._quotas.caps(kind))

    async def jobs(self, tenant: str) -> list[JobRecord]:
        return await self._jobs.tenant_jobs(tenant)

    async def job_ids(self, tenant: str) -> set[str]:
        """The tenant's job ids, with no record read."""
        return await self._jobs.tenant_job_ids(tenant)

    async def job_count(self, tenant: str) -> int:
        return await self._jobs.tenant_job_count(tenant)

    async def live_owner(self, tenant: str, job_id: str) -> str | None:
        """`job_id` when it is a live training model of the tenant (a sampling session over
        its checkpoint runs on its home worker, in order with it), else None."""
        job = await self.find_job(tenant, job_id)
        ok = job is not None and job.kind == JobKind.TRAINING and not job.unloaded
        return job_id if ok else None

    # Checkpoints -------------------------------------------------------------------

    async def checkpoint(self, tenant: str, path: str) -> CheckpointRecord:
        """A checkpoint the tenant may read (info, load, sample): its own or a published
        one, not past its TTL; 404 otherwise."""
        record = await self._checkpoints.readable(path, tenant, self._clock())
        if record is None:
            raise not_found(f"no checkpoint at {path!r}")
        return record

    async def _readable(self, tenant: str, path: str) -> bool:
        return await self._checkpoints.readable(path, tenant, self._clock()) is not None

    async def owned_checkpoint(self, tenant: str, path: str) -> CheckpointRecord:
        """A checkpoint the tenant may change (delete, publish, TTL): its own; 404 for
        one it cannot see, 403 for another tenant's published one."""
        record = await self.checkpoint(tenant, path)
        if record.tenant != tenant:
            raise ApiError(
                403,
                f"checkpoint {path} is published by another tenant: only its owner may "
                "delete, unpublish or set its TTL",
            )
        return record

    async def find_checkpoint(self, tenant: str, path: str) -> CheckpointRecord | None:
        """The tenant's own checkpoint at `path`, if one stands (not past its TTL)."""
        record = await self._checkpoints.get_checkpoint(path)
        ok = record is not None and record.owned_by(tenant, self._clock())
        return record if ok else None

    async def checkpoints(self, tenant: str) -> list[CheckpointRecord]:
        return await self._checkpoints.tenant_checkpoints(tenant)

    async def admit_checkpoint(self, tenant: str) -> None:
        """400 when the tenant holds its quota of checkpoints: call before publishing a
        save that creates one (the worker writes the record, so the count is read here)."""
        held = await self._records.checkpoints(tenant)
        with self._quota(tenant):
            self._quotas.check_checkpoints(tenant, held)

    async def admit_save(self, tenant: str, path: str, ttl_s: int | None) -> None:
        """Before a save of `path` is sent: 400 for a TTL out of range or a tenant whose
        checkpoints hold its quota of bytes; else the TTL is left for the record to take
        when the worker writes it (none: the checkpoint is kept until deleted)."""
        with self._quota(tenant):
            self._quotas.check_ttl(ttl_s)
            held = await self._checkpoints.stored_bytes(tenant)
            self._quotas.check_checkpoint_bytes(tenant, held)
        await self._checkpoints.expire_on_save(path, ttl_s)

    async def set_checkpoint_ttl(
        self, tenant: str, path: str, ttl_s: int | None
    ) -> CheckpointRecord:
        """Expire the tenant's checkpoint `ttl_s` from now, or never (None)."""
        await self.owned_checkpoint(tenant, path)
        with self._quota(tenant):
            self._quotas.check_ttl(ttl_s)
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        try:
            return await self._checkpoints.set_expiry(path, expires_at)
        except CheckpointGone:
            raise not_found(f"no checkpoint at {path!r}") from None

    async def publish_checkpoint(self, tenant: str, path: str, public: bool) -> CheckpointRecord:
        """Make the tenant's checkpoint readable by every key (or by its owner's only)."""
        await self.owned_checkpoint(tenant, path)
        try:
            return await self._checkpoints.set_public(path, public)
        except CheckpointGone:
            raise not_found(f"no checkpoint at {path!r}") from None

    async def stored_bytes(self, tenant: str) -> int:
        return await self._checkpoints.stored_bytes(tenant)

    @contextlib.contextmanager
    def _quota(self, tenant: str) -> Iterator[None]:
        """A quota refused in the block is the tenant's 400, saying which and what to do."""
        try:
            yield
        except QuotaExceeded as exc:
            raise bad_request(str(self._quotas.refusal(tenant, exc))) from None
        except QuotaError as exc:
            raise bad_request(str(exc)) from None


def metadata_strings(metadata: dict[str, Any] | None) -> dict[str, str]:
    """Tinker's free-form user metadata as the string map the records keep."""
    return {str(k): v if isinstance(v, str) else str(v) for k, v in (metadata or {}).items()}


def new_job(
    kind: JobKind,
    job_id: str,
    tenant: str,
    session_id: str,
    spec: JobSpec,
    *,
    clock: Clock = time.time,
    sampler_path: str | None = None,
    owner_job: str | None = None,
    metadata: dict[str, str] | None = None,
) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        tenant=tenant,
        kind=kind,
        spec=spec,
        created_at=clock(),
        session_id=session_id,
        sampler_path=sampler_path,
        owner_job=owner_job,
        metadata=metadata or {},
    )
