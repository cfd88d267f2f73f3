"""Client of the state-store's HTTP API (the disk tier and checkpoint records).

Errors say what kind they are, so a caller retries only what may pass: a state-store
that cannot be reached or answers 5xx raises `StateStoreError` (transient,
`plexrl.retry.is_transient` reads its status); a request it refuses (a bad key, a
record it never takes) raises `StateStoreRefused`; a full disk `StateStoreFull`; a
write whose lease no longer stands `StateStoreFenced`. None of the last three can
pass by retrying the same request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from urllib.parse import quote

import httpx
import msgspec
import numpy as np

from plexrl import tracing
from plexrl.endpoints import failover_client
from plexrl.service_auth import auth_headers
from plexrl.stores import CheckpointRecord

CHECKPOINT_PREFIX = "ckpt"
"""Blobs under `ckpt/<tenant>/` are that tenant's checkpoints; others are service-internal
(offloaded states, snapshots), reachable with the service token alone."""

FENCE_JOB_HEADER = "x-plexrl-job"
FENCE_EPOCH_HEADER = "x-plexrl-epoch"


@dataclass(frozen=True)
class Fence:
    """The lease a job's call runs under: its writes count only while it stands."""

    job_id: str
    epoch: int

    def headers(self) -> dict[str, str]:
        return {FENCE_JOB_HEADER: self.job_id, FENCE_EPOCH_HEADER: str(self.epoch)}


class StateStoreError(RuntimeError):
    """The state-store failed a request; `status_code` is its HTTP status (0: never
    answered)."""

    def __init__(self, message: str, status_code: int = 0) -> None:
        super().__init__(message)
        self.status_code = status_code


class StateStoreRefused(StateStoreError):
    """The state-store refused the request as it stands (4xx): it never will take it."""


class StateStoreFull(StateStoreError):
    """The state-store's disk is full (507): nothing more fits until space is freed."""


class StateStoreFenced(StateStoreError):
    """The write's lease no longer stands (409): the job has a new home."""


def blob_tenant(key: str) -> str | None:
    """The tenant whose checkpoint blob `key` is, or None for a service-internal blob."""
    parts = key.split("/")
    if parts[0] != CHECKPOINT_PREFIX:
        return None
    # `ckpt` or `ckpt/<tenant>` alone name no blob of anyone's: nobody may write there.
    return parts[1] if len(parts) >= 3 else ""


def blob_url(key: str) -> str:
    """The URL path of a blob: each part of the key percent-escaped, so no character of
    a key can end the path early (`#`, `?`) or name another blob."""
    return "/v1/blobs/" + quote(key, safe="/")


class BlobRange:
    """A range of a blob being received: its pieces as they arrive, then `aclose`."""

    def __init__(self, response: httpx.Response, size: int) -> None:
        self._response = response
        self.size = size
        """Bytes in the range."""

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_raw():
            yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()


class StateStoreClient:
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 30.0,
        token: str | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        # Every request carries the cluster's service token (PLEXRL_SERVICE_TOKEN).
        # `timeout_s` bounds each read or write of the socket, not a whole transfer: a
        # large blob keeps going while bytes move, a hung store is given up on.
        # `base_url` may list several replicas (comma separated): see plexrl.endpoints.
        self._http = failover_client(
            base_url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers=auth_headers(token),
        )
        # Each request continues the caller's trace (the state-store hop of a call).
        tracing.instrument_client(self._http)

    async def close(self) -> None:
        await self._http.aclose()

    # `tenant`: the tenant a call acts for; required for a checkpoint's blob
    # (`ckpt/<tenant>/...`), which the state-store serves to that tenant only.
    # `fence`: the lease of the job's call that writes (checkpoints), see `Fence`.

    async def put_blob(
        self, key: str, data: bytes, tenant: str | None = None, fence: Fence | None = None
    ) -> int:
        response = await self._http.put(
            blob_url(key), content=data, headers=_headers(tenant, fence)
        )
        check_answer(response, f"storing blob {key}")
        return int(response.json()["size_bytes"])

    async def put_stream(
        self,
        key: str,
        chunks: Iterable[bytes | memoryview],
        size: int,
        tenant: str | None = None,
        fence: Fence | None = None,
    ) -> int:
        """Store a blob of `size` bytes sent piece by piece (`chunks`, e.g. views of a
        state's tensors): nothing is joined into one buffer, and the event loop runs
        between pieces, so a large blob holds neither memory twice nor the loop."""

        async def pieces() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk  # type: ignore[misc]  # h11 writes any bytes-like object
                await asyncio.sleep(0)

        headers = {**_headers(tenant, fence), "content-length": str(size)}
        response = await self._http.put(blob_url(key), content=pieces(), headers=headers)
        check_answer(response, f"storing blob {key}")
        return int(response.json()["size_bytes"])

    async def get_blob(self, key: str, tenant: str | None = None) -> memoryview:
        """The blob's bytes, received piece by piece into one buffer that is neither
        zeroed first nor joined at the end: for a large state either would hold the
        event loop for a whole copy."""
        headers = auth_headers(None, tenant)
        async with self._http.stream("GET", blob_url(key), headers=headers) as response:
            if response.status_code >= 400:
                await response.aread()
                check_answer(response, f"reading blob {key}")
            size = int(response.headers.get("content-length", "-1"))
            if size < 0:  # no length said: the plain way
                return memoryview(await response.aread())
            # An uninitialised buffer of `size` bytes (numpy allocates without zeroing).
            data, at = np.empty(size, dtype=np.uint8).data, 0
            async for chunk in response.aiter_raw():
                if at + len(chunk) > size:
                    raise StateStoreError(f"blob {key} is longer than its {size} bytes", 502)
                data[at : at + len(chunk)] = chunk
                at += len(chunk)
                await asyncio.sleep(0)  # a fast socket never suspends: let the loop run
        if at != size:
            raise StateStoreError(f"blob {key} ended after {at} of its {size} bytes", 502)
        return data

    async def open_range(
        self, key: str, offset: int, size: int, tenant: str | None = None
    ) -> BlobRange:
        """Bytes `offset` to `offset + size` of a blob, to be read as they arrive
        (`BlobRange.chunks`), never held whole; close it when done. Raises as the other
        reads do before any byte is read (a missing blob: StateStoreRefused, 404)."""
        if offset < 0 or size < 1:
            raise ValueError(
                f"a blob's range starts at 0 or later and holds a byte or more: {offset}+{size}"
            )
        headers = {**auth_headers(None, tenant), "range": f"bytes={offset}-{offset + size - 1}"}
        request = self._http.build_request("GET", blob_url(key), headers=headers)
        response = await self._http.send(request, stream=True)
        try:
            if response.status_code >= 400:
                await response.aread()
                check_answer(response, f"reading bytes {offset}+{size} of blob {key}")
            length = int(response.headers.get("content-length", "-1"))
            if response.status_code != 206 or length != size:
                raise StateStoreError(
                    f"blob {key} answered a range of {size} bytes with status "
                    f"{response.status_code} and {length} bytes (shorter than its record says?)",
                    502,
                )
        except BaseException:
            await response.aclose()
            raise
        return BlobRange(response, size)

    async def delete_blob(self, key: str, tenant: str | None = None) -> None:
        response = await self._http.delete(blob_url(key), headers=auth_headers(None, tenant))
        check_answer(response, f"deleting blob {key}")

    async def put_checkpoint(self, record: CheckpointRecord, fence: Fence | None = None) -> None:
        response = await self._http.post(
            "/v1/checkpoints",
            content=msgspec.json.encode(record),
            headers={"content-type": "application/json", **_headers(record.tenant, fence)},
        )
        check_answer(response, f"recording checkpoint {record.path}")

    async def delete_checkpoint(self, path: str, tenant: str, fence: Fence | None = None) -> bool:
        """Delete a checkpoint's record and blob; False if there was none."""
        response = await self._http.delete(
            "/v1/checkpoints", params={"path": path}, headers=_headers(tenant, fence)
        )
        if response.status_code == 404:
            return False
        check_answer(response, f"deleting checkpoint {path}")
        return True

    async def healthy(self) -> bool:
        try:
            response = await self._http.get("/healthz")
        except httpx.HTTPError:
            return False
        return response.status_code == 200


def _headers(tenant: str | None, fence: Fence | None) -> dict[str, str]:
    return {**auth_headers(None, tenant), **(fence.headers() if fence else {})}


def check_answer(response: httpx.Response, doing: str) -> None:
    """Raise the error the state-store's answer means, by kind (nothing below 400)."""
    status = response.status_code
    if status < 400:
        return
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    message = f"state-store failed {doing}: {status} {str(detail)[:500]}"
    if status == 409:
        raise StateStoreFenced(message, status)
    if status == 507:
        raise StateStoreFull(message, status)
    if 400 <= status < 500:
        raise StateStoreRefused(message, status)
    raise StateStoreError(message, status)


__all__ = [
    "CHECKPOINT_PREFIX",
    "BlobRange",
    "Fence",
    "StateStoreClient",
    "StateStoreError",
    "StateStoreFenced",
    "StateStoreFull",
    "StateStoreRefused",
    "blob_tenant",
    "blob_url",
    "check_answer",
]
