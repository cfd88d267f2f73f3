"""What every service's HTTP server (plexrl.health.HttpServer) writes, and when.

A response's head goes out in one send with its body when the app sends both in one
step (`HeadWithBody`); a head whose body comes later (a stream) still goes out at once,
and the order of bytes never changes. The transport under it in the unit tests is a
recorder, at the edge; the streaming and keep-alive tests run a real uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from gateway_support import free_port

from plexrl.health import HeadWithBody, HttpServer


class Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


async def test_a_head_and_its_body_in_one_step_are_one_send() -> None:
    sent = Recorder()
    transport = HeadWithBody(sent, asyncio.get_running_loop())
    transport.write(HEAD)
    transport.write(b"{}")
    assert sent.sent == [HEAD + b"{}"]
    await asyncio.sleep(0)  # the step's end finds nothing held
    assert sent.sent == [HEAD + b"{}"]


async def test_a_large_body_follows_its_head_uncopied() -> None:
    sent = Recorder()
    transport = HeadWithBody(sent, asyncio.get_running_loop())
    body = b"x" * (1 << 20)
    transport.write(HEAD)
    transport.write(body)
    assert sent.sent == [HEAD, body]


async def test_a_head_alone_goes_out_at_the_end_of_its_step_and_close_sends_what_is_held() -> None:
    sent = Recorder()
    transport = HeadWithBody(sent, asyncio.get_running_loop())
    transport.write(HEAD)
    assert sent.sent == []
    await asyncio.sleep(0)
    assert sent.sent == [HEAD]
    transport.write(b"{}")  # a body chunk on its own: at once
    assert sent.sent == [HEAD, b"{}"]
    transport.write(HEAD)
    transport.close()  # (a refusal: its head, then the close)
    assert sent.sent == [HEAD, b"{}", HEAD] and sent.closed
    await asyncio.sleep(0)
    assert sent.sent == [HEAD, b"{}", HEAD]


def streaming_app() -> FastAPI:
    app = FastAPI()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first\n"
            await asyncio.sleep(1.0)
            yield b"second\n"

        return StreamingResponse(chunks(), media_type="text/plain")

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    return app


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[int]:
    port = free_port()
    server = HttpServer(streaming_app(), "127.0.0.1", port)
    await server.start()
    try:
        yield port
    finally:
        await server.stop()


async def test_a_streamed_response_starts_at_once_and_keep_alive_serves_after_it() -> None:
    async with served() as port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        started = time.monotonic()
        async with http.stream("GET", "/stream") as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            assert await anext(lines) == "first"
            assert time.monotonic() - started < 0.8  # not held until the rest
            assert await anext(lines) == "second"
        for _ in range(3):  # the same connection, in order
            assert (await http.get("/ping")).json() == {"ok": True}
