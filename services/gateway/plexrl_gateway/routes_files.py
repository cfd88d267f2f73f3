"""Files out behind signed, expiring URLs: an export's files, and a session's trace.

`GET .../external_weights_urls` (the SDK's `RestClient.get_external_weights_urls`)
answers, for the owner's key or any key when the export is published, one URL per
file; `GET /api/v1/sessions/{id}/trace_export` (routes_rest) one for the session's
trace. A file's URL needs no key: its signature is the permission, until `expires`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from plexrl_gateway.deps import GatewayDep, Tenant
from plexrl_gateway.exports import FILES_ROUTE, ExportFiles, requested_range
from plexrl_gateway.session_trace import TRACE_FILE, TRACES_ROUTE
from plexrl_gateway.translate import TINKER_SCHEME, parse_tinker_path

router = APIRouter()


async def _exports(gateway: GatewayDep) -> ExportFiles:
    return gateway.exports


Exports = Annotated[ExportFiles, Depends(_exports)]


@router.get("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(
    run_id: str, checkpoint_id: str, request: Request, tenant: Tenant, exports: Exports
) -> dict[str, Any]:
    path = parse_tinker_path(f"{TINKER_SCHEME}{run_id}/{checkpoint_id}")
    record = await exports.readable(tenant, path)
    signed = exports.sign(record, str(request.base_url))
    return {"urls": signed.urls, "expires": signed.expires.isoformat().replace("+00:00", "Z")}


@router.get(FILES_ROUTE + "/{run_id}/{name}/{file:path}")
async def external_weights_file(
    run_id: str,
    name: str,
    file: str,
    exports: Exports,
    expires: Annotated[int, Query()],
    signature: Annotated[str, Query(max_length=128)],
    range_: Annotated[str | None, Header(alias="range")] = None,
) -> Response:
    """The file, or the one byte range a `Range` header asks for (a resumed download)."""
    record, entry = await exports.find(run_id, name, file, expires, signature)
    part = requested_range(range_, entry.size_bytes)
    start, size = part if part is not None else (0, entry.size_bytes)
    file_name = entry.name.rpartition("/")[2]
    headers = {
        "content-length": str(size),
        "accept-ranges": "bytes",
        "etag": f'"{entry.sha256}"',
        "content-disposition": f"attachment; filename*=UTF-8''{quote(file_name)}",
        "cache-control": "private, no-store",
    }
    status = 200
    if part is not None:
        status = 206
        headers["content-range"] = f"bytes {start}-{start + size - 1}/{entry.size_bytes}"
    if size == 0:
        return Response(b"", status, headers=headers, media_type="application/octet-stream")
    blob = await exports.read(record, entry, start, size)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in blob.chunks():
                yield chunk
        finally:  # also when the client goes away half way
            await blob.aclose()

    return StreamingResponse(body(), status, headers=headers, media_type="application/octet-stream")


@router.get(TRACES_ROUTE + "/{session_id}/" + TRACE_FILE)
async def session_trace_file(
    session_id: str,
    gateway: GatewayDep,
    tenant: Annotated[str, Query(max_length=256)],
    expires: Annotated[int, Query()],
    signature: Annotated[str, Query(max_length=128)],
) -> Response:
    """The session's calls as a Perfetto trace (open it in ui.perfetto.dev)."""
    trace = await gateway.traces.build(session_id, tenant, expires, signature)
    headers = {
        "content-disposition": f"attachment; filename*=UTF-8''{quote(session_id)}.pftrace",
        "cache-control": "private, no-store",
    }
    return Response(trace, 200, headers=headers, media_type="application/octet-stream")
