"""HTTP API of the state-store: blobs, checkpoint records, residency reads."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest

from plexrl.meta import CheckpointRecord, MetaStore
from plexrl_state_store.blobs import BadKeyError, BlobDir
from plexrl_state_store.records import CheckpointRecords

_BYTES = Counter("plexrl_state_store_bytes_total", "Blob bytes moved", ["direction"])


def get_blobs(request: Request) -> BlobDir:
    return request.app.state.blobs


def get_meta(request: Request) -> MetaStore:
    return request.app.state.meta


Blobs = Annotated[BlobDir, Depends(get_blobs)]
Meta = Annotated[MetaStore, Depends(get_meta)]


def build_app(blobs: BlobDir, meta: MetaStore) -> FastAPI:
    app = FastAPI(title="plexrl state-store", docs_url=None, redoc_url=None)
    app.state.blobs = blobs
    app.state.meta = meta
    app.state.records = CheckpointRecords(blobs, meta)

    @app.exception_handler(BadKeyError)
    async def bad_key(_: Request, exc: BadKeyError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.get("/healthz")
    async def healthz(m: Meta, b: Blobs) -> dict[str, Any]:
        return {"service": "state-store", "ok": await m.ping(), "dir": str(b.root)}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.put("/v1/blobs/{key:path}")
    async def put_blob(key: str, request: Request, b: Blobs) -> dict[str, Any]:
        data = await request.body()
        size = b.write(key, data)
        _BYTES.labels("in").inc(size)
        return {"key": key, "size_bytes": size}

    @app.get("/v1/blobs/{key:path}")
    def get_blob(key: str, b: Blobs) -> Response:
        data = b.read(key)
        if data is None:
            raise HTTPException(404, f"no blob {key!r}")
        _BYTES.labels("out").inc(len(data))
        return Response(data, media_type="application/octet-stream")

    @app.head("/v1/blobs/{key:path}")
    def head_blob(key: str, b: Blobs) -> Response:
        size = b.size(key)
        if size is None:
            raise HTTPException(404, f"no blob {key!r}")
        return Response(headers={"content-length": str(size)})

    @app.delete("/v1/blobs/{key:path}")
    def delete_blob(key: str, b: Blobs) -> dict[str, Any]:
        return {"key": key, "deleted": b.delete(key)}

    @app.post("/v1/checkpoints")
    async def put_checkpoint(request: Request, b: Blobs, m: Meta) -> dict[str, Any]:
        try:
            record = msgspec.json.decode(await request.body(), type=CheckpointRecord)
        except msgspec.DecodeError as exc:
            raise HTTPException(400, f"not a checkpoint record: {exc}") from exc
        if b.size(record.blob_key) is None:
            raise HTTPException(400, f"blob {record.blob_key!r} must be stored first")
        await m.put_checkpoint(record)
        request.app.state.records.keep(record)  # beside its blob: Redis may lose it
        return {"path": record.path}

    @app.get("/v1/checkpoints")
    async def list_checkpoints(
        m: Meta, x_plexrl_tenant: Annotated[str, Header()]
    ) -> list[dict[str, Any]]:
        records = await m.tenant_checkpoints(x_plexrl_tenant)
        return [msgspec.to_builtins(r) for r in records]

    @app.delete("/v1/checkpoints")
    async def delete_checkpoint(
        path: str, b: Blobs, m: Meta, x_plexrl_tenant: Annotated[str, Header()]
    ) -> dict[str, Any]:
        record = await m.get_checkpoint(path)
        if record is None or record.tenant != x_plexrl_tenant:
            raise HTTPException(404, f"no checkpoint {path!r}")
        await m.delete_checkpoint(record)
        CheckpointRecords(b, m).forget(record)
        b.delete(record.blob_key)
        return {"path": path, "deleted": True}

    @app.get("/v1/residency/{job_id}")
    async def residency(job_id: str, m: Meta) -> dict[str, Any]:
        record = await m.get_residency(job_id)
        if record is None:
            raise HTTPException(404, f"no residency record for job {job_id!r}")
        return dict(msgspec.to_builtins(record))

    return app
