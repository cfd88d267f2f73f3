"""A directory of blobs addressed by key; writes are atomic (temp file, then rename).

A write that dies half way (the process killed, the disk full) leaves at most a
`.tmp-*` file, never a partial blob; `sweep_temp` removes those left behind.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp-"
_FULL = (errno.ENOSPC, errno.EDQUOT)

_KEY = re.compile(r"^[A-Za-z0-9._:@=+-]+(/[A-Za-z0-9._:@=+-]+)*$")


class BadKeyError(ValueError):
    pass


class DiskFullError(OSError):
    """The blob directory's file system has no room (or the quota is spent) for a write."""


class BlobDir:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """The file of `key`; refuses keys that could leave the directory."""
        if not _KEY.match(key) or any(part in (".", "..") for part in key.split("/")):
            raise BadKeyError(
                f"blob key {key!r} is not valid: use letters, digits and ._:@=+- in "
                "'/'-separated parts, without '.' or '..' parts"
            )
        return self.root / key

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
