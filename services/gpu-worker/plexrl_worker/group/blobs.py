"""A rank's own reads and writes of the disk tier: every rank moves its own shard.

In a worker the ranks read and write the state-store (`StoreBlobs`, its HTTP API with
the service token), from whichever host they run on; a test or benchmark without one
gives them a directory (`DirBlobs`). `BlobPlace` says which, and travels to each rank
when the group starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from plexrl.service_auth import auth_headers
from plexrl.state_store_client import StateStoreRefused, blob_url, check_answer


class Blobs(Protocol):
    def get(self, key: str, tenant: str | None = None) -> bytes: ...
    def put(self, key: str, pieces: Iterable[bytes | memoryview], size: int) -> None: ...


@dataclass(frozen=True)
class BlobPlace:
    """Where a group's ranks read and write blobs: the state-store at `url` (with the
    cluster's service token), or a local `directory`."""

    url: str | None = None
    token: str | None = None
    directory: Path | None = None
    timeout_s: float = 60.0

    def open(self) -> Blobs:
        if self.directory is not None:
            return DirBlobs(self.directory)
        if self.url is None:
            raise ValueError("BlobPlace needs a state-store url or a directory")
        return StoreBlobs(self.url, self.token, self.timeout_s)


class DirBlobs:
    """Blobs as files under a directory (keys are relative paths)."""

    def __init__(self, root: Path) -> None:
        self._root = Path(root)

    def get(self, key: str, tenant: str | None = None) -> bytes:
        try:
            return (self._root / key).read_bytes()
        except FileNotFoundError as exc:
            raise StateStoreRefused(f"no blob {key!r}", 404) from exc

    def put(self, key: str, pieces: Iterable[bytes | memoryview], size: int) -> None:
        path = self._root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("wb") as out:
            for piece in pieces:
                out.write(piece)
        tmp.replace(path)


class StoreBlobs:
    """The state-store's blob API, synchronous (a rank has no event loop of its own)."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        self._http = httpx.Client(
            base_url=url.rstrip("/"),
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            headers=auth_headers(token),
        )

    def get(self, key: str, tenant: str | None = None) -> bytes:
        response = self._http.get(blob_url(key), headers=auth_headers(None, tenant))
        check_answer(response, f"reading blob {key}")
        return response.content

    def put(self, key: str, pieces: Iterable[bytes | memoryview], size: int) -> None:
        headers = {"content-length": str(size)}
        response = self._http.put(blob_url(key), content=_bytes(pieces), headers=headers)
        check_answer(response, f"storing blob {key}")


def _bytes(pieces: Iterable[bytes | memoryview]) -> Iterable[bytes]:
    for piece in pieces:
        yield bytes(piece) if isinstance(piece, memoryview) else piece
