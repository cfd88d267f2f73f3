"""Several addresses for one service: an HTTP client that uses one and moves on to the next
when it does not answer.

Settings such as `PLEXRL_STATE_STORE_URL` and `PLEXRL_SCHEDULER_URL` may list several
URLs, comma separated (state-store replicas over one object store; the schedulers, one
of which leads). The client sends each request to the endpoint that answered last; an
endpoint that refuses or times out the connection is set aside for a few seconds and
the request goes to the next at once (nothing was sent, so any request may go again).
A failure after the request was sent is the caller's to retry, as with one address, but
its next request goes elsewhere. GET and HEAD requests answered 503 (a replica whose
Redis is away, a standby scheduler) are sent to the next endpoint too. With one URL it
is a plain client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

SET_ASIDE_S = 5.0
"""How long an endpoint that failed is tried only when every other failed too."""


def split_urls(spec: str) -> list[str]:
    """`"http://a:8300, http://b:8300"` → the URLs, without trailing slashes."""
    urls = [u.strip().rstrip("/") for u in spec.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"no URL in {spec!r}: give one or several, comma separated")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} in {spec!r} is not an http:// or https:// URL")
    return urls


class FailoverTransport(httpx.AsyncBaseTransport):
    def __init__(
        self,
        urls: list[str],
        inner: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._targets = [httpx.URL(u) for u in urls]
        self._inner = inner or httpx.AsyncHTTPTransport()
        self._clock = clock
        self._aside_until = [0.0] * len(urls)
        self._current = 0

    @property
    def current(self) -> str:
        return str(self._targets[self._current])

    def _order(self) -> list[int]:
        """Every endpoint once, the one in use first, those set aside last."""
        n = len(self._targets)
        ring = [(self._current + i) % n for i in range(n)]
        now = self._clock()
        return [i for i in ring if self._aside_until[i] <= now] + [
            i for i in ring if self._aside_until[i] > now
        ]

    def _set_aside(self, i: int) -> None:
        self._aside_until[i] = self._clock() + SET_ASIDE_S
        if i == self._current:
            self._current = (i + 1) % len(self._targets)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        order = self._order()
        readable = request.method in ("GET", "HEAD")
        failure: Exception | None = None
        for n, i in enumerate(order):
            target = self._targets[i]
            request.url = request.url.copy_with(
                scheme=target.scheme, host=target.host, port=target.port
            )
            request.headers["host"] = target.netloc.decode()
            last = n == len(order) - 1
            try:
                response = await self._inner.handle_async_request(request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._set_aside(i)  # nothing was sent: the next endpoint may take it
                failure = exc
                continue
            except httpx.TransportError:
                self._set_aside(i)  # sent, maybe received: the caller decides
                raise
            if response.status_code == 503 and readable and not last:
                await response.aclose()
                self._set_aside(i)
                continue
            self._current = i
            return response
        assert failure is not None
        raise failure

    async def aclose(self) -> None:
        await self._inner.aclose()


def failover_client(urls: str, **kwargs: Any) -> httpx.AsyncClient:
    """An httpx.AsyncClient over the endpoints `urls` lists (comma separated); `kwargs` as
    for httpx.AsyncClient (timeouts, headers)."""
    targets = split_urls(urls)
    return httpx.AsyncClient(base_url=targets[0], transport=FailoverTransport(targets), **kwargs)
