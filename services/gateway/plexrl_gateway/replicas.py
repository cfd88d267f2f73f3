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

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plexrl.redis_target import ReplicaLagError
from plexrl_gateway.errors import Category, error_body

_READS = frozenset({"GET", "HEAD", "OPTIONS"})


class WaitForReplicas:
    def __init__(self, app: ASGIApp, replicated: Callable[[], Awaitable[int]]) -> None:
        self._app = app
        self._replicated = replicated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _READS:
            await self._app(scope, receive, send)
            return

        unconfirmed = False

        async def send_replicated(message: Message) -> None:
            nonlocal unconfirmed
            if unconfirmed:
                return  # the 503 below answers instead
            if message["type"] == "http.response.start" and message["status"] < 500:
                try:
                    await self._replicated()
                except ReplicaLagError:
                    unconfirmed = True
                    await _unconfirmed()(scope, receive, send)
                    return
            await send(message)

        await self._app(scope, receive, send_replicated)


_UNCONFIRMED = (
    "no Redis replica confirmed this request's writes (the primary may be failing over); "
    "send it again"
)
"""What the client is told when no replica confirmed the request's writes: nothing it
may rely on happened; sending it again (the SDK does on a 503) is safe."""


def _unconfirmed() -> JSONResponse:
    return JSONResponse(
        error_body(_UNCONFIRMED, Category.SERVER), 503, headers={"retry-after": "1"}
    )
