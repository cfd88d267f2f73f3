"""The disk tier on an S3-compatible object store (SeaweedFS on the host bed, any S3 in
production), through boto3: state-store replicas on several hosts share one bucket, so
a worker restored on any host reads the snapshot another wrote.

Keys map one to one onto object keys under an optional prefix; record copies go under
`#records/`. An object's PUT is atomic (readers see the old object or the new one), so
nothing like the directory's temp files is ever left behind. A store that cannot be
reached or answers 5xx raises `ObjectStoreAway`, which the app answers with a 503 the
caller retries.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from plexrl_state_store.blobs import CHUNK_BYTES, RECORDS_DIR, check_key

log = logging.getLogger(__name__)

_MISSING = {"404", "NoSuchKey", "NotFound"}


class ObjectStoreAway(RuntimeError):
    """The object store could not be reached, or failed the request (5xx)."""


@dataclass(frozen=True)
class S3Config:
    """Where the bucket is and how to reach it (settings `PLEXRL_STATE_STORE_S3_*`)."""

    endpoint: str
    """The S3 endpoint URL, e.g. http://10.0.0.6:8333 (SeaweedFS's S3 gateway)."""
    bucket: str = "plexrl"
    prefix: str = ""
    """Put before every key, so that clusters can share a bucket (`cluster-a/`)."""
    region: str = "us-east-1"
    access_key: str | None = None
    """None: boto3's own chain (AWS_ACCESS_KEY_ID, a profile, an instance role)."""
    secret_key: str | None = None
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 30.0


class S3Blobs:
    """A `BlobStore` over one bucket; thread-safe (boto3 clients are)."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self._prefix = config.prefix
        self._bucket = config.bucket
        self._s3: Any = boto3.client(
            "s3",
            endpoint_url=config.endpoint,
            region_name=config.region,
            aws_access_key_id=config.access_key,
            aws_secret_access_key=config.secret_key,
            config=Config(
                s3={"addressing_style": "path"},
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"max_attempts": 3, "mode": "standard"},
            ),
        )
        # Large blobs go up in parts, several at once; small ones in one PUT.
        self._transfer = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=16 << 20)

    def ensure_bucket(self) -> None:
        """Create the bucket unless it is there (several replicas may race to)."""
        try:
            self._call(self._s3.head_bucket, Bucket=self._bucket)
            return
        except botocore.exceptions.ClientError as exc:
            if _code(exc) not in _MISSING:
                raise
        try:
            self._call(self._s3.create_bucket, Bucket=self._bucket)
            log.info("created bucket %s at %s", self._bucket, self.config.endpoint)
        except botocore.exceptions.ClientError as exc:
            if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def describe(self) -> str:
        return f"s3://{self._bucket}/{self._prefix} at {self.config.endpoint}"

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _call(self, method: Any, **kwargs: Any) -> Any:
        try:
            return method(**kwargs)
        except (
            botocore.exceptions.EndpointConnectionError,
            botocore.exceptions.ConnectTimeoutError,
            botocore.exceptions.ReadTimeoutError,
            botocore.exceptions.ConnectionClosedError,
        ) as exc:
            raise ObjectStoreAway(
                f"the object store at {self.config.endpoint} is away ({type(exc).__name__}); "
                "retry shortly"
            ) from exc
        except botocore.exceptions.ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if int(status) >= 500 or _code(exc) in ("SlowDown", "ServiceUnavailable"):
                raise ObjectStoreAway(
                    f"the object store at {self.config.endpoint} failed with {_code(exc)} "
                    f"({status}); retry shortly"
                ) from exc
            raise

    def validate(self, key: str) -> None:
        check_key(key)

    def write(self, key: str, data: bytes) -> int:
        check_key(key)
        self._call(
            self._s3.upload_fileobj,
            Fileobj=io.BytesIO(data),
            Bucket=self._bucket,
            Key=self._key(key),
            Config=self._transfer,
        )
        return len(data)

    def _get(self, key: str, **extra: Any) -> Any | None:
        try:
            return self._call(self._s3.get_object, Bucket=self._bucket, Key=key, **extra)
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _MISSING:
                return None
            raise

    def read(self, key: str) -> bytes | None:
        check_key(key)
        found = self._get(self._key(key))
        return None if found is None else bytes(found["Body"].read())

    def size(self, key: str) -> int | None:
        check_key(key)
        try:
            head = self._call(self._s3.head_object, Bucket=self._bucket, Key=self._key(key))
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _MISSING:
                return None
            raise
        return int(head["ContentLength"])

    def delete(self, key: str) -> bool:
        # S3 deletes say nothing of whether there was an object: ask first.
        existed = self.size(key) is not None
        if existed:
            self._call(self._s3.delete_object, Bucket=self._bucket, Key=self._key(key))
        return existed

    def read_range(self, key: str, first: int, last: int) -> Iterator[bytes]:
        check_key(key)
        found = self._get(self._key(key), Range=f"bytes={first}-{last}")
        if found is None:
            return
        body = found["Body"]
        try:
            yield from body.iter_chunks(CHUNK_BYTES)
        finally:
            body.close()

    def _record(self, name: str) -> str:
        check_key(name)
        return f"{self._prefix}{RECORDS_DIR}/{name}"

    def put_record(self, name: str, data: bytes) -> None:
        self._call(self._s3.put_object, Bucket=self._bucket, Key=self._record(name), Body=data)

    def records(self) -> Iterator[tuple[str, bytes]]:
        base = f"{self._prefix}{RECORDS_DIR}/"
        pages = self._s3.get_paginator("list_objects_v2")
        try:
            listing = list(pages.paginate(Bucket=self._bucket, Prefix=base))
        except botocore.exceptions.BotoCoreError as exc:
            raise ObjectStoreAway(f"listing {self.describe()} failed ({exc!r})") from exc
        for page in listing:
            for entry in page.get("Contents", []):
                found = self._get(entry["Key"])
                if found is not None:  # deleted meanwhile otherwise
                    yield entry["Key"][len(base) :], bytes(found["Body"].read())

    def delete_record(self, name: str) -> None:
        self._call(self._s3.delete_object, Bucket=self._bucket, Key=self._record(name))

    def sweep_temp(self, older_than_s: float) -> int:
        return 0  # a PUT is atomic: a write that died left nothing


def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
