"""A request that may have written to Redis is answered only once Redis's replicas hold
what it wrote (PLEXRL_REDIS_WAIT_REPLICAS; nothing to wait for on one machine).

What the gateway writes for a request (an accepted call with its future, outbox and
cursor; a session, a model, a checkpoint's deletion) is what the client is told about.
Redis replicates asynchronously, so a primary that dies right after answering could
take it back with it: the client would poll a future that no longer exists, or send
the next call of a model whose cursor went back. Waiting once, as the answer leaves,
covers every write of the request (replication is one ordered stream). Reads (GET,
HEAD) write nothing and are not held.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_READS = frozenset({"GET", "HEAD", "OPTIONS"})


class WaitForReplicas:
    def __init__(self, app: ASGIApp, replicated: Callable[[], Awaitable[int]]) -> None:
        self._app = app
        self._replicated = replicated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _READS:
            await self._app(scope, receive, send)
            return

        async def send_replicated(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 500:
                await self._replicated()
            await send(message)

        await self._app(scope, receive, send_replicated)
