"""Exported weights out: which tenants may list an export's files, their signed URLs,
and each file's bytes, read from the state-store as they are sent.

An export (`save_weights_external`) is one blob; its record lists each file as a byte
range of it (`CheckpointFile`). A download reads just that range, piece by piece: the
gateway never holds a whole file.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, urlencode

from plexrl.state_store_client import BlobRange, StateStoreClient
from plexrl.stores import CheckpointFile, CheckpointRecord, CheckpointStore
from plexrl_gateway.errors import ApiError, bad_request, not_found
from plexrl_gateway.signing import BadSignature, Expired, UrlSigner
from plexrl_gateway.translate import CheckpointKind, TinkerPath, parse_tinker_path

FILES_ROUTE = "/api/v1/external_weights"
"""Where the files are served: `<route>/<run>/<name>/<file>?expires=...&signature=...`."""


@dataclass(frozen=True)
class SignedUrls:
    urls: dict[str, str]
    """File name → its URL."""
    expires: datetime
    """When every one of them stops working."""


class ExportFiles:
    def __init__(
        self,
        records: CheckpointStore,
        store: StateStoreClient,
        signer: UrlSigner,
        url_ttl_s: float,
        public_url: str | None = None,
    ) -> None:
        self._records = records
        self._store = store
        self._signer = signer
        self._url_ttl_s = url_ttl_s
        self._public_url = public_url.rstrip("/") if public_url else None

    async def close(self) -> None:
        await self._store.close()

    async def readable(self, tenant: str, path: TinkerPath) -> CheckpointRecord:
        """The export at `path` if `tenant` may read it: its own, or one published.
        404 otherwise (another tenant's private export is not revealed)."""
        if path.kind != CheckpointKind.EXTERNAL_WEIGHTS:
            raise bad_request(
                f"{path} is not an external weights checkpoint: download URLs exist only for "
                "tinker://<run>/external_weights/<name> (from save_weights_external)"
            )
        record = await self._records.get_checkpoint(str(path))
        if record is None or (record.tenant != tenant and not record.public):
            raise not_found(f"no checkpoint at {str(path)!r}")
        self._check_not_expired(record)
        return record

    def sign(self, record: CheckpointRecord, request_base_url: str) -> SignedUrls:
        """A URL per file, valid for the configured lifetime, never past the
        checkpoint's own expiry."""
        expires = int(self._signer.now() + self._url_ttl_s)
        if record.expires_at is not None:
            expires = min(expires, int(record.expires_at))
        path = parse_tinker_path(record.path)
        base = (self._public_url or request_base_url.rstrip("/")) + FILES_ROUTE
        urls = {}
        for file in record.files:
            signature = self._signer.sign(record.path, file.name, expires)
            where = "/".join(quote(part, safe="") for part in (path.model_id, path.name))
            query = urlencode({"expires": expires, "signature": signature})
            urls[file.name] = f"{base}/{where}/{quote(file.name, safe='/')}?{query}"
        return SignedUrls(urls, datetime.fromtimestamp(expires, UTC))

    async def find(
        self, run_id: str, name: str, file: str, expires: int, signature: str
    ) -> tuple[CheckpointRecord, CheckpointFile]:
        """The export and file a signed URL names. 403 for a signature that does not
        match, 410 for a URL or export past its expiry, 404 for an export or file that is
        gone."""
        path = str(TinkerPath(run_id, CheckpointKind.EXTERNAL_WEIGHTS, name))
        try:
            self._signer.check(path, file, expires, signature)
        except BadSignature as exc:
            raise ApiError(403, str(exc)) from None
        except Expired as exc:
            raise ApiError(410, str(exc)) from None
        record = await self._records.get_checkpoint(path)
        if record is None:
            raise not_found(f"checkpoint {path} no longer exists (it was deleted)")
        self._check_not_expired(record)
        entry = next((f for f in record.files if f.name == file), None)
        if entry is None:
            raise not_found(f"checkpoint {path} has no file {file!r}")
        return record, entry

    async def read(
        self, record: CheckpointRecord, entry: CheckpointFile, start: int, size: int
    ) -> BlobRange:
        """Bytes `start` to `start + size` of the file, as the state-store sends them."""
        return await self._store.open_range(
            record.blob_key, entry.offset + start, size, record.tenant
        )

    def _check_not_expired(self, record: CheckpointRecord) -> None:
        if record.expires_at is not None and self._signer.now() >= record.expires_at:
            expired = datetime.fromtimestamp(record.expires_at, UTC).isoformat()
            raise ApiError(410, f"checkpoint {record.path} expired at {expired}")


def requested_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first byte, bytes) of a single `Range: bytes=a-b`, `bytes=a-` or `bytes=-n`
    within a file of `size` bytes; None for no Range (the whole file). 416 for one that
    asks for nothing in the file or for several ranges."""
    if header is None:
        return None
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    valid = unit.strip() == "bytes" and dash and "," not in spec
    try:
        if valid and first:
            start = int(first)
            end = min(int(last), size - 1) if last else size - 1
        elif valid and last:
            start, end = max(0, size - int(last)), size - 1
        else:
            raise ValueError
    except ValueError:
        start, end = size, -1
    if start > end or start >= size:
        raise ApiError(
            416,
            f"range {header!r} asks for no bytes of this {size}-byte file; give one range "
            "like 'bytes=0-1023' or 'bytes=1024-'",
            headers={"content-range": f"bytes */{size}"},
        )
    return start, end - start + 1
