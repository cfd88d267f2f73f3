"""Which Tinker SDK is calling, read from the headers it sends, and what that changes.

Every SDK built by Stainless sends `X-Stainless-Package-Version: 0.16.1` and
`User-Agent: AsyncTinker/Python 0.16.1` on every request (checked for 0.16.1 through
0.38.0). The answer changes with the version only where an older SDK asserts something a
newer answer breaks; a client that sends neither header (curl, another SDK) gets the
newest answer. Result encodings are not decided here: they follow the request's own
`Content-Type` and `Accept` (protobuf when the SDK says it speaks it, else JSON).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")
# `AsyncTinker/Python 0.16.1` (the SDK's client class, then its version).
_USER_AGENT = re.compile(r"Tinker/Python (\d+\.\d+\.\d+)", re.IGNORECASE)


class SdkVersion(NamedTuple):
    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


# SDKs before 0.20.0 assert that the ephemeral save_weights_for_sampler result (no name,
# a sampling session opened over it) has no `path`; 0.20.0 and later ignore it.
EPHEMERAL_SAVE_WITHOUT_PATH_BEFORE = SdkVersion(0, 20, 0)


def parse_version(text: str) -> SdkVersion | None:
    """`0.16.1` (or `0.16.1rc2`, `0.16.1.dev0`) as a version; None for anything else."""
    match = _VERSION.match(text.strip())
    return SdkVersion(*(int(part) for part in match.groups())) if match else None


def sdk_version(headers: Mapping[str, str]) -> SdkVersion | None:
    """The Tinker SDK version a request came from, or None when it does not say.

    `headers` must look names up case-insensitively (Starlette's and httpx's do).
    X-Stainless-Package-Version is read first; User-Agent (`…Tinker/Python X.Y.Z`) is the
    fallback, since a proxy may drop the X- headers but keeps the user agent.
    """
    stated = headers.get("x-stainless-package-version")
    if stated and (version := parse_version(stated)):
        return version
    agent = _USER_AGENT.search(headers.get("user-agent", ""))
    return parse_version(agent.group(1)) if agent else None


def ephemeral_save_carries_path(version: SdkVersion | None) -> bool:
    """Whether the ephemeral save_weights_for_sampler result may name its snapshot."""
    return version is None or version >= EPHEMERAL_SAVE_WITHOUT_PATH_BEFORE
