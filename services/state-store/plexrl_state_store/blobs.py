"""Where the state-store keeps its blobs: a directory (`BlobDir`, one machine), or an
S3-compatible object store that state-store replicas on several hosts share
(`plexrl_state_store.s3.S3Blobs`). Both are a `BlobStore`.

Blobs are addressed by key (`snapshot/<job>/...`, `ckpt/<tenant>/...`). Beside them the
store keeps a copy of each checkpoint's record (`records`, under `#records/`, a name no
blob key can take), so that Redis can lose the record and get it back.

A directory's writes are atomic (temp file, then rename): a write that dies half way
(the process killed, the disk full) leaves at most a `.tmp-*` file, never a partial
blob; `sweep_temp` removes those left behind. An object store's writes are atomic by
themselves.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
RECORDS_DIR = "#records"
"""Where the copies of checkpoint records go: `#` is not in the key alphabet, so no blob
key can name them."""
CHUNK_BYTES = 1 << 20
"""A range of a blob is sent in pieces of this size."""
_FULL = (errno.ENOSPC, errno.EDQUOT)

_KEY = re.compile(r"^[A-Za-z0-9._:@=+-]+(/[A-Za-z0-9._:@=+-]+)*$")


class BadKeyError(ValueError):
    pass


class DiskFullError(OSError):
    """The blob directory's file system has no room (or the quota is spent) for a write."""


class BlobStore(Protocol):
    """What the state-store needs of the place its blobs live. Calls block (file or
    network I/O): the app runs them in worker threads."""

    def validate(self, key: str) -> None:
        """Raise BadKeyError when `key` is not a blob key."""

    def write(self, key: str, data: bytes) -> int:
        """Store the blob whole (atomically), replacing any; returns its size."""

    def read(self, key: str) -> bytes | None: ...

    def size(self, key: str) -> int | None: ...

    def delete(self, key: str) -> bool:
        """Delete the blob; False when there was none."""

    def read_range(self, key: str, first: int, last: int) -> Iterator[bytes]:
        """Bytes `first`..`last` (inclusive) of the blob, in pieces; the caller checked
        they lie within it."""

    def put_record(self, name: str, data: bytes) -> None:
        """Keep a checkpoint record's copy under `name` (`<blob key>.json`)."""

    def records(self) -> Iterator[tuple[str, bytes]]:
        """Every record copy kept: (name, bytes)."""

    def delete_record(self, name: str) -> None: ...

    def sweep_temp(self, older_than_s: float) -> int:
        """Remove what writes that died left behind; returns how many."""

    def describe(self) -> str:
        """Where the blobs are, for logs."""


def check_key(key: str) -> None:
    """Refuse keys outside the blob alphabet or that could climb out of their folder."""
    if not _KEY.match(key) or any(part in (".", "..") for part in key.split("/")):
        raise BadKeyError(
            f"blob key {key!r} is not valid: use letters, digits and ._:@=+- in "
            "'/'-separated parts, without '.' or '..' parts"
        )


class BlobDir:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """The file of `key`; refuses keys that could leave the directory."""
        check_key(key)
        return self.root / key

    def validate(self, key: str) -> None:
        check_key(key)

    def describe(self) -> str:
        return str(self.root)

    def write(self, key: str, data: bytes) -> int:
        return self.write_file(self.path(key), data, f"blob {key!r}")

    def write_file(self, target: Path, data: bytes, what: str = "") -> int:
        """Write a file under the root atomically; DiskFullError when it does not fit."""
        try:
            return write_atomically(target, data)
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            free = shutil.disk_usage(self.root).free
            raise DiskFullError(
                exc.errno,
                f"the state-store's disk is full: {len(data)} bytes for "
                f"{what or target.name} do not fit in the {free} bytes free under "
                f"{self.root}; free space there or point PLEXRL_STATE_STORE_DIR at a larger "
                "volume",
            ) from exc

    def read(self, key: str) -> bytes | None:
        target = self.path(key)
        return target.read_bytes() if target.is_file() else None

    def existing(self, key: str) -> Path | None:
        """The file of `key` if it is there."""
        target = self.path(key)
        return target if target.is_file() else None

    def size(self, key: str) -> int | None:
        target = self.path(key)
        return target.stat().st_size if target.is_file() else None

    def delete(self, key: str) -> bool:
        target = self.path(key)
        if target.is_file():
            target.unlink()
            return True
        return False

    def read_range(self, key: str, first: int, last: int) -> Iterator[bytes]:
        with self.path(key).open("rb") as f:
            f.seek(first)
            left = last - first + 1
            while left > 0:
                chunk = f.read(min(CHUNK_BYTES, left))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk

    def _record(self, name: str) -> Path:
        check_key(name)  # `<blob key>.json`: in the alphabet too
        return self.root / RECORDS_DIR / name

    def put_record(self, name: str, data: bytes) -> None:
        self.write_file(self._record(name), data, f"the record copy {name!r}")

    def records(self) -> Iterator[tuple[str, bytes]]:
        base = self.root / RECORDS_DIR
        for path in sorted(base.rglob("*.json")) if base.is_dir() else []:
            try:
                yield path.relative_to(base).as_posix(), path.read_bytes()
            except OSError:  # deleted meanwhile
                continue

    def delete_record(self, name: str) -> None:
        self._record(name).unlink(missing_ok=True)

    def sweep_temp(self, older_than_s: float) -> int:
        """Remove temp files of writes that died (older than `older_than_s`); returns how
        many. Only this process writes here, so at start every one is left over."""
        cutoff = time.time() - older_than_s
        removed = 0
        for path in self.root.rglob(f"{TEMP_PREFIX}*"):
            try:
                if path.is_file() and path.stat().st_mtime <= cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # finished (renamed) meanwhile
                continue
        if removed:
            log.warning("removed %d temp files of blob writes that did not finish", removed)
        return removed

    def usage_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())


def write_atomically(target: Path, data: bytes) -> int:
    """Write `data` at `target` so that a crash leaves the old file or the new one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(data)
