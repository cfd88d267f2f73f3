"""A directory of blobs addressed by key; writes are atomic (temp file, then rename)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

_KEY = re.compile(r"^[A-Za-z0-9._:@=+-]+(/[A-Za-z0-9._:@=+-]+)*$")


class BadKeyError(ValueError):
    pass


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
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
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

    def read(self, key: str) -> bytes | None:
        target = self.path(key)
        return target.read_bytes() if target.is_file() else None

    def size(self, key: str) -> int | None:
        target = self.path(key)
        return target.stat().st_size if target.is_file() else None

    def delete(self, key: str) -> bool:
        target = self.path(key)
        if target.is_file():
            target.unlink()
            return True
        return False

    def usage_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())
