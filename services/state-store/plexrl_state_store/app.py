"""HTTP API of the state-store: blobs, checkpoint records, residency reads.

Callers are the cluster's own services, never tenants: every `/v1` call carries the
shared service token (`Authorization: Bearer $PLEXRL_SERVICE_TOKEN`) when the store
has one. Inside that boundary each tenant's checkpoints stay its own: a checkpoint's
blob lives under `ckpt/<tenant>/`, is served only to a call that acts for that tenant
(`X-PlexRL-Tenant`), and a checkpoint record can only name a blob of its own tenant,
so no record can be forged to point one tenant's model at another's weights.

A job's call that writes here says under which lease it runs (`X-PlexRL-Job`,
`X-PlexRL-Epoch`): its blob is kept and its record written only while that lease
stands, so a worker that comes back after its job was re-homed leaves nothing behind.
A blob write checks before and after (a blob written by a writer fenced meanwhile is
deleted again); a record is checked in the same Redis script that writes it, and a
refused record's blob is deleted. Errors say what they are: 400 a key or record this
store never takes, 403/404 another tenant's, 409 a fenced writer, 507 a full disk, 503
its Redis away (retry).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import msgspec
import redis.exceptions
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from plexrl import tracing
from plexrl.health import service_app
from plexrl.http_metrics import ObserveRequests
from plexrl.service_auth import bearer_matches
from plexrl.state_store_client import (
    CHECKPOINT_PREFIX,
    FENCE_EPOCH_HEADER,
    FENCE_JOB_HEADER,
    Fence,
    blob_tenant,
)
from plexrl.stores import CheckpointRecord, CheckpointStore, FencedWriteError, ResidencyStore
from plexrl_state_store import metrics
from plexrl_state_store.blobs import BadKeyError, BlobStore, DiskFullError
from plexrl_state_store.records import CheckpointRecords
from plexrl_state_store.s3 import ObjectStoreAway


def get_blobs(request: Request) -> BlobStore:
    return request.app.state.blobs


def get_checkpoints(request: Request) -> CheckpointStore:
    return request.app.state.checkpoints


def get_residency(request: Request) -> ResidencyStore:
    return request.app.state.residency


def authenticate(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """401 unless the call carries the service token (when the store has one)."""
    token: str | None = request.app.state.token
    if token and not bearer_matches(token, authorization):
        raise HTTPException(
            401,
            "the state-store needs the cluster's service token: send 'Authorization: Bearer "
            "<token>' with the token set in PLEXRL_SERVICE_TOKEN",
            headers={"WWW-Authenticate": "Bearer"},
        )


Blobs = Annotated[BlobStore, Depends(get_blobs)]
Checkpoints = Annotated[CheckpointStore, Depends(get_checkpoints)]
Residencies = Annotated[ResidencyStore, Depends(get_residency)]
ActingFor = Annotated[str | None, Header(alias="x-plexrl-tenant")]
"""The tenant a service call acts for."""


def call_fence(
    job: Annotated[str | None, Header(alias=FENCE_JOB_HEADER)] = None,
    epoch: Annotated[str | None, Header(alias=FENCE_EPOCH_HEADER)] = None,
) -> Fence | None:
    """The lease a job's call writes under, if it names one."""
    if job is None and epoch is None:
        return None
    if not job or epoch is None or not epoch.isdigit():
        raise HTTPException(
            400,
            f"a fenced write names the job ({FENCE_JOB_HEADER}) and the lease's epoch "
            f"({FENCE_EPOCH_HEADER}, a whole number), not {job!r} and {epoch!r}",
        )
    return Fence(job, int(epoch))


Fenced = Annotated[Fence | None, Depends(call_fence)]


def _fenced_off(fence: Fence, doing: str) -> HTTPException:
    metrics.FENCED_WRITES.inc()
    return HTTPException(
        409,
        f"{doing} refused: the lease of epoch {fence.epoch} on job {fence.job_id} no longer "
        "stands (the job was re-homed; its new home writes instead)",
    )


def one_range(header: str, size: int) -> tuple[int, int]:
    """(first, last) byte of a single `bytes=a-b`, `bytes=a-` or `bytes=-n` range of a
    blob of `size` bytes; 416 for one outside it, several, or another form."""
    first, sep, last = header.strip().removeprefix("bytes=").partition("-")
    span: tuple[int, int] | None = None
    if sep and "," not in header:
        if first.isdigit() and (last.isdigit() or not last):
            span = (int(first), min(int(last), size - 1) if last else size - 1)
        elif not first and last.isdigit() and int(last) > 0:
            span = (max(0, size - int(last)), size - 1)
    if span is None or span[0] > span[1] or span[0] >= size:
        raise HTTPException(
            416,
            f"range {header!r} asks for no bytes of this {size}-byte blob (one range, within it)",
            headers={"content-range": f"bytes */{size}"},
        )
    return span


def range_bytes(header: str) -> int:
    """Bytes a single `bytes=<first>-<last>` range asks for (0 for any other form; the
    response still answers it, this only counts)."""
    first, sep, last = header.removeprefix("bytes=").partition("-")
    if not (sep and first.isdigit() and last.isdigit()):
        return 0
    return max(0, int(last) - int(first) + 1)


def _visible(key: str, acting_for: str | None) -> bool:
    owner = blob_tenant(key)
    return owner is None or (bool(owner) and owner == acting_for)


def build_app(
    blobs: BlobStore,
    checkpoints: CheckpointStore,
    residency: ResidencyStore,
    token: str | None = None,
) -> FastAPI:
    app = service_app("plexrl state-store", openapi_url=None)
    app.state.blobs = blobs
    app.state.checkpoints = checkpoints
    app.state.residency = residency
    app.state.token = token
    app.state.records = CheckpointRecords(blobs, checkpoints)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])

    @app.exception_handler(BadKeyError)
    async def bad_key(_: Request, exc: BadKeyError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def redis_away(_: Request, exc: Exception) -> JSONResponse:
        # Transient: the caller retries (a 500 would read as a bug and fail its call).
        return JSONResponse(
            {"detail": f"the state-store's Redis is away ({type(exc).__name__}); retry shortly"},
            status_code=503,
            headers={"retry-after": "1"},
        )

    @app.exception_handler(DiskFullError)
    async def disk_full(_: Request, exc: DiskFullError) -> JSONResponse:
        metrics.DISK_FULL.inc()
        return JSONResponse({"detail": exc.strerror}, status_code=507)

    @app.exception_handler(ObjectStoreAway)
    async def object_store_away(_: Request, exc: ObjectStoreAway) -> JSONResponse:
        # Transient, as Redis away is: the caller retries.
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"retry-after": "1"})

    @app.get("/healthz")
    async def healthz(c: Checkpoints, request: Request) -> dict[str, Any]:
        rounds = getattr(request.app.state, "rounds", None)
        return {
            "service": "state-store",
            "ok": await c.ping(),
            # Whether this replica runs the background rounds (one replica does).
            "sweeping": rounds is not None and rounds.leading,
        }

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @v1.put("/blobs/{key:path}")
    async def put_blob(
        key: str,
        request: Request,
        b: Blobs,
        c: Checkpoints,
        fence: Fenced,
        acting_for: ActingFor = None,
    ) -> dict[str, Any]:
        b.validate(key)  # a bad key is refused before the body is read
        if not _visible(key, acting_for):
            raise HTTPException(
                403,
                f"blob {key!r} is not a checkpoint of tenant {acting_for!r}: checkpoint blobs "
                "go under ckpt/<tenant>/... and are written acting for that tenant "
                "(X-PlexRL-Tenant)",
            )
        # Named in the job's blob book before it is written: a writer killed before its
        # record leaves it findable, and the job's next owner deletes it.
        if fence is not None and not await c.writing(fence.job_id, fence.epoch, key):
            raise _fenced_off(fence, f"writing blob {key!r}")
        # Off the event loop: a large blob's write and fsync must not stall other calls.
        size = await asyncio.to_thread(b.write, key, await request.body())
        if fence is not None and not await c.epoch_stands(fence.job_id, fence.epoch):
            await asyncio.to_thread(b.delete, key)  # re-homed while it was written
            raise _fenced_off(fence, f"writing blob {key!r}")
        metrics.BLOB_WRITTEN_BYTES.inc(size)
        return {"key": key, "size_bytes": size}

    @v1.get("/blobs/{key:path}")
    def get_blob(
        key: str,
        b: Blobs,
        acting_for: ActingFor = None,
        range_: Annotated[str | None, Header(alias="range")] = None,
    ) -> Response:
        """The blob; with `Range: bytes=<first>-<last>`, only those bytes (206), read
        from the file as they are sent (an exported file of a large checkpoint)."""
        if range_ is not None:
            size = b.size(key) if _visible(key, acting_for) else None
            if size is None:
                raise HTTPException(404, f"no blob {key!r}")
            first, last = one_range(range_, size)
            metrics.BLOB_READ_BYTES.inc(last - first + 1)
            # Sent as it is read, a piece at a time (a sync iterator: read in a thread).
            return StreamingResponse(
                b.read_range(key, first, last),
                status_code=206,
                media_type="application/octet-stream",
                headers={
                    "content-range": f"bytes {first}-{last}/{size}",
                    "content-length": str(last - first + 1),
                    "accept-ranges": "bytes",
                },
            )
        data = b.read(key) if _visible(key, acting_for) else None
        if data is None:
            raise HTTPException(404, f"no blob {key!r}")
        metrics.BLOB_READ_BYTES.inc(len(data))
        return Response(data, media_type="application/octet-stream")

    @v1.head("/blobs/{key:path}")
    def head_blob(key: str, b: Blobs, acting_for: ActingFor = None) -> Response:
        size = b.size(key) if _visible(key, acting_for) else None
        if size is None:
            raise HTTPException(404, f"no blob {key!r}")
        return Response(headers={"content-length": str(size)})

    @v1.delete("/blobs/{key:path}")
    def delete_blob(key: str, b: Blobs, acting_for: ActingFor = None) -> dict[str, Any]:
        if not _visible(key, acting_for):
            raise HTTPException(404, f"no blob {key!r}")
        deleted = b.delete(key)
        if deleted:
            metrics.BLOBS_DELETED.inc()
        return {"key": key, "deleted": deleted}

    @v1.post("/checkpoints")
    async def put_checkpoint(
        request: Request, b: Blobs, c: Checkpoints, fence: Fenced, acting_for: ActingFor = None
    ) -> dict[str, Any]:
        try:
            record = msgspec.json.decode(await request.body(), type=CheckpointRecord)
        except msgspec.DecodeError as exc:
            raise HTTPException(400, f"not a checkpoint record: {exc}") from exc
        if acting_for != record.tenant:
            raise HTTPException(
                403,
                f"a checkpoint of tenant {record.tenant!r} is recorded acting for that tenant "
                f"(X-PlexRL-Tenant: {record.tenant}), not for {acting_for!r}",
            )
        if blob_tenant(record.blob_key) != record.tenant:
            raise HTTPException(
                403,
                f"checkpoint blob {record.blob_key!r} is not under "
                f"{CHECKPOINT_PREFIX}/{record.tenant}/: a record names its own tenant's blob",
            )
        if not record.path.startswith(f"tinker://{record.job_id}/"):
            raise HTTPException(
                400, f"checkpoint path {record.path!r} is not under tinker://{record.job_id}/"
            )
        if b.size(record.blob_key) is None:
            raise HTTPException(400, f"blob {record.blob_key!r} must be stored first")
        if fence is not None and fence.job_id != record.job_id:
            raise HTTPException(
                400, f"a call of job {fence.job_id!r} records checkpoints of its own job only"
            )
        standing = await c.get_checkpoint(record.path)
        if standing is not None and standing.tenant != record.tenant:
            raise HTTPException(403, f"checkpoint {record.path!r} belongs to another tenant")
        records: CheckpointRecords = request.app.state.records
        try:
            replaced = await c.put_checkpoint(record, None if fence is None else fence.epoch)
        except FencedWriteError as exc:
            # The blob was written for this record alone (its key is unique to the save).
            await asyncio.to_thread(b.delete, record.blob_key)
            metrics.FENCED_WRITES.inc()
            raise HTTPException(409, str(exc)) from None
        try:
            await asyncio.to_thread(records.keep, record)  # beside its blob: Redis may lose it
        except OSError:
            # No copy, no record (the disk filled between the blob and its copy): put
            # back what stood, so the failed save changed nothing.
            if replaced is not None:
                await c.put_checkpoint(replaced)
            else:
                await c.delete_checkpoint(record)
            await asyncio.to_thread(records.forget, record.blob_key)
            raise
        if replaced is not None and replaced.blob_key != record.blob_key:
            await asyncio.to_thread(records.forget, replaced.blob_key)
        # Recorded only once a Redis replica holds it: a record written to a primary cut
        # off from its replicas (this replica's side of a partition) is lost when that
        # primary rejoins, and the worker, told it stood, would answer the save.
        await c.replicated()
        metrics.CHECKPOINTS_RECORDED.inc()
        return {"path": record.path}

    @v1.get("/checkpoints")
    async def list_checkpoints(
        c: Checkpoints, x_plexrl_tenant: Annotated[str, Header()]
    ) -> list[dict[str, Any]]:
        records = await c.tenant_checkpoints(x_plexrl_tenant)
        return [msgspec.to_builtins(r) for r in records]

    @v1.delete("/checkpoints")
    async def delete_checkpoint(
        path: str,
        request: Request,
        c: Checkpoints,
        fence: Fenced,
        x_plexrl_tenant: Annotated[str, Header()],
    ) -> dict[str, Any]:
        record = await c.get_checkpoint(path)
        if record is None or record.tenant != x_plexrl_tenant:
            raise HTTPException(404, f"no checkpoint {path!r}")
        if fence is not None and not await c.epoch_stands(fence.job_id, fence.epoch):
            raise _fenced_off(fence, f"deleting checkpoint {path!r}")
        # The tombstone first: killed after it, the next rebuild finishes the delete.
        await c.delete_checkpoint(record)
        records: CheckpointRecords = request.app.state.records
        if blob_tenant(record.blob_key) == record.tenant:
            await asyncio.to_thread(records.forget, record.blob_key)
        await c.buried([record.blob_key])
        return {"path": path, "deleted": True}

    @v1.get("/residency/{job_id}")
    async def residency_of(job_id: str, r: Residencies) -> dict[str, Any]:
        record = await r.get_residency(job_id)
        if record is None:
            raise HTTPException(404, f"no residency record for job {job_id!r}")
        return dict(msgspec.to_builtins(record))

    app.include_router(v1)
    app.add_middleware(ObserveRequests, observe=metrics.observe_request)
    # One server span per request, continuing the caller's trace (the worker's call).
    tracing.instrument_app(app)
    return app
