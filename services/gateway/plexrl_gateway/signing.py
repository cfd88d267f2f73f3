"""Signed, expiring URLs of exported files: an HMAC-SHA256, under the gateway's secret,
over the checkpoint's tinker path, the file's name and the URL's expiry.

Whoever holds a URL may read that one file until its expiry, with no API key (the
Tinker SDK and CLI fetch them with a plain HTTP client); changing any of the three, or
the signature, makes it worthless. Every gateway of a cluster derives the same secret
from the service token (`signing_secret`), so a URL one signs any other serves.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_DERIVATION = b"plexrl: signed URLs of exported weights"


class BadSignature(Exception):
    """The signature does not match the path, file and expiry (or is not one at all)."""


class Expired(Exception):
    """The URL's expiry has passed; the message says when it was."""


def signing_secret(configured: str | None, service_token: str | None) -> bytes:
    """The secret URLs are signed with: PLEXRL_URL_SIGNING_SECRET when set, else one
    derived from the service token (the token itself never signs anything a client
    sees), else a random one for this process alone."""
    if configured:
        return configured.encode()
    if service_token:
        return hmac.new(service_token.encode(), _DERIVATION, hashlib.sha256).digest()
    log.warning(
        "neither PLEXRL_URL_SIGNING_SECRET nor PLEXRL_SERVICE_TOKEN is set: download URLs "
        "are signed with a random secret, valid on this gateway process only"
    )
    return secrets.token_bytes(32)


class UrlSigner:
    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        if not secret:
            raise ValueError("a URL signing secret must not be empty")
        self._secret = secret
        self._clock = clock

    def now(self) -> float:
        return self._clock()

    def sign(self, path: str, file: str, expires: int) -> str:
        """The signature (hex) of `file` of checkpoint `path`, valid until `expires`
        (Unix seconds)."""
        message = "\n".join((path, file, str(expires))).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def check(
        self,
        path: str,
        file: str,
        expires: int,
        signature: str,
        renew: str = "get_external_weights_urls",
    ) -> None:
        """BadSignature unless `signature` is this one's for (path, file, expires);
        Expired if it is but `expires` has passed. The signature is checked first, in
        constant time, so an expiry is only reported for a URL this gateway signed.
        `renew`: the call that gives a fresh URL, as the messages name it."""
        if not hmac.compare_digest(self.sign(path, file, expires).encode(), signature.encode()):
            raise BadSignature(
                f"the signature of this URL of {file!r} does not match: it was altered, or "
                f"signed by another cluster; ask {renew} for a fresh one"
            )
        now = self._clock()
        if now >= expires:
            raise Expired(
                f"this URL of {file!r} expired {now - expires:.0f} s ago (at Unix time "
                f"{expires}); ask {renew} for a fresh one"
            )
