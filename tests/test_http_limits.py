"""Every service's HTTP server (plexrl.health.HttpServer) against clients that hold it open.

Real sockets against a real uvicorn on a free port: half-sent heads, a body that stops,
a head trickled in a byte at a time, more connections than the cap; a normal client
beside them must still be served, and the stalled ones must be closed on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from gateway_support import free_port

from plexrl.health import ConnectionReport, HttpLimits, HttpServer, health_app
from plexrl.settings import CommonSettings

HALF_HEAD = b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"


def slow_app() -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/wait")
    async def wait(s: float) -> dict[str, float]:
        await asyncio.sleep(s)
        return {"waited": s}

    @app.post("/echo")
    async def echo(body: dict[str, int]) -> dict[str, int]:
        return body

    return app


@contextlib.asynccontextmanager
async def served(limits: HttpLimits) -> AsyncIterator[int]:
    port = free_port()
    server = HttpServer(slow_app(), "127.0.0.1", port, limits)
    await server.start()
    try:
        yield port
    finally:
        await server.stop()


async def half_sent(
    port: int, data: bytes = HALF_HEAD
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent before closing; fails if it keeps the connection open. A
    reset is a close too: the kernel resets a connection its server closed with bytes
    still unread in its buffer (what it received of a half-sent request), and whether
    the server read them first is a race."""
    try:
        return await asyncio.wait_for(reader.read(), seconds)
    except ConnectionResetError:
        return b""


async def test_half_sent_connections_neither_stall_others_nor_stay_open() -> None:
    limits = HttpLimits(
        max_connections=400, max_connections_per_client=400, head_timeout_s=1.0, body_timeout_s=1.0
    )
    async with served(limits) as port:
        stalled = [await half_sent(port) for _ in range(300)]
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            answer = await http.get("/ping")
        assert answer.status_code == 200
        assert time.monotonic() - started < 0.5  # served at once, not after the stalled ones
        closed = await asyncio.gather(*(closed_within(r, 3.0) for r, _ in stalled))
        assert closed == [b""] * len(stalled)  # closed by the server, nothing answered
        assert time.monotonic() - started < 3.0
        for _, writer in stalled:
            writer.close()


async def test_one_client_with_a_thousand_stalled_connections_leaves_room_for_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="plexrl.health")
    limits = HttpLimits(head_timeout_s=2.0)  # the default caps: 512 open, 128 per client
    async with served(limits) as port:
        flood = [await half_sent(port) for _ in range(1100)]
        started = time.monotonic()
        # Another client (another loopback address) is served at once.
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", transport=transport
        ) as http:
            answer = await http.get("/ping")
        assert answer.status_code == 200
        assert time.monotonic() - started < 1.0
        answers = await asyncio.gather(*(closed_within(r, 5.0) for r, _ in flood))
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 ")]
        assert len(refused) == 1100 - limits.max_connections_per_client
        assert answers.count(b"") == limits.max_connections_per_client  # closed at the deadline
        for _, writer in flood:
            writer.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "plexrl.health"]
    assert 1 <= len(lines) <= 2, lines  # the first refusal, then at most one per 10 s


async def test_a_head_trickled_in_is_cut_at_its_deadline() -> None:
    async with served(HttpLimits(head_timeout_s=1.0)) as port:
        reader, writer = await half_sent(port, b"G")
        started = time.monotonic()

        async def trickle() -> None:
            # Each byte would reset uvicorn's own keep-alive timer; the deadline holds.
            for byte in b"ET /ping HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                await asyncio.sleep(0.1)
                writer.write(bytes([byte]))

        trickling = asyncio.create_task(trickle())
        assert await closed_within(reader, 3.0) == b""
        assert 0.9 < time.monotonic() - started < 2.0
        trickling.cancel()
        writer.close()


async def test_a_head_over_the_cap_is_answered_431_and_one_under_it_is_served() -> None:
    limits = HttpLimits(max_head_bytes=4096, head_timeout_s=5.0)
    async with served(limits) as port:
        # Under the cap, whole.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            answer = await http.get("/ping", headers={"X-Big": "a" * 3000})
        assert answer.status_code == 200
        # Over it: one header that never ends, streamed fast (the parser would hold it
        # all in memory): cut once the head passes the cap, long before the deadline.
        reader, writer = await half_sent(port, b"GET /ping HTTP/1.1\r\nX-Endless: ")
        started = time.monotonic()

        async def stream() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(100):
                    writer.write(b"a" * 1024)
                    await writer.drain()
                    await asyncio.sleep(0.01)

        streaming = asyncio.create_task(stream())
        answered = await closed_within(reader, 3.0)
        assert time.monotonic() - started < 2.0
        streaming.cancel()
        writer.close()
        # (A reset may beat the answer: the client is still sending when the server closes.)
        if answered:
            assert answered.startswith(b"HTTP/1.1 431 "), answered[:80]
            assert b"PLEXRL_HTTP_MAX_HEAD_BYTES" in answered
        # Sent at once, then read: the answer says what to change.
        reader, writer = await half_sent(port, b"GET /ping HTTP/1.1\r\nX-Big: " + b"a" * 5000)
        answered = await closed_within(reader, 3.0)
        writer.close()
        assert answered.startswith(b"HTTP/1.1 431 "), answered[:80]
        assert b"larger than 4096 bytes" in answered


async def test_pipelined_requests_are_answered_in_order_and_a_pipelined_head_has_a_deadline() -> (
    None
):
    async with served(HttpLimits(head_timeout_s=1.0)) as port:
        one = b"GET /wait?s=0.3 HTTP/1.1\r\nHost: t\r\n\r\n"
        two = (
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 8\r\n\r\n{"a": 2}'
        )
        reader, writer = await half_sent(port, one + two + b"GET /ping HTTP/1.1\r\nHo")
        started = time.monotonic()
        # Both whole requests are answered, in order; the third, half-sent, is cut at
        # the head deadline (counted from when its first bytes came, the app at work).
        answered = await closed_within(reader, 4.0)
        writer.close()
        assert answered.count(b"HTTP/1.1 200 ") == 2, answered
        assert answered.index(b'{"waited":0.3}') < answered.index(b'{"a":2}')
        assert 0.9 < time.monotonic() - started < 2.5


async def test_a_body_that_stops_is_cut_and_a_slow_app_is_not() -> None:
    limits = HttpLimits(head_timeout_s=0.5, body_timeout_s=1.0)
    async with served(limits) as port:
        head = HALF_HEAD + b"Content-Length: 20\r\n\r\n" + b'{"a": 1'
        reader, writer = await half_sent(port, head)
        started = time.monotonic()
        assert await closed_within(reader, 3.0) == b""
        assert 0.9 < time.monotonic() - started < 2.5
        writer.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            # The app's own time (a long poll) is not a read deadline.
            answer = await http.get("/wait", params={"s": 1.5})
            assert answer.json() == {"waited": 1.5}
            # The same keep-alive connection serves the next request.
            assert (await http.post("/echo", json={"a": 1})).json() == {"a": 1}


async def test_a_long_body_arriving_steadily_outlasts_the_body_timeout_a_trickle_does_not() -> None:
    # A large blob (a job's state to the state-store) takes longer than body_timeout_s;
    # it keeps going while it arrives at the least rate on average.
    limits = HttpLimits(body_timeout_s=0.5, min_body_bytes_per_s=10_000)
    payload = b'{"a": ' + b" " * 19_990 + b"1}"
    async with served(limits) as port:
        head = HALF_HEAD + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        reader, writer = await half_sent(port, head)
        started = time.monotonic()
        for i in range(0, len(payload), 1000):  # 20 kB/s, for about a second
            writer.write(payload[i : i + 1000])
            await writer.drain()
            await asyncio.sleep(0.05)
        answer = await asyncio.wait_for(reader.read(4096), 5.0)
        assert time.monotonic() - started > 0.9
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"a":1}')
        writer.close()
        # 1 kB/s is under the least rate: cut near body_timeout_s + bytes / rate.
        reader, writer = await half_sent(port, head)
        started = time.monotonic()
        with contextlib.suppress(ConnectionError):
            for i in range(0, len(payload), 100):
                writer.write(payload[i : i + 100])
                await writer.drain()
                await asyncio.sleep(0.1)
                if reader.at_eof():
                    break
        assert await closed_within(reader, 3.0) == b""
        assert time.monotonic() - started < 2.0
        writer.close()


async def test_connections_over_the_cap_get_a_503_until_stalled_ones_are_reclaimed() -> None:
    limits = HttpLimits(max_connections=20, head_timeout_s=1.0)
    async with served(limits) as port:
        stalled = [await half_sent(port) for _ in range(20)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        busy = await closed_within(reader, 2.0)
        assert busy.startswith(b"HTTP/1.1 503 ")
        assert b"retry-after: 1" in busy.lower()
        writer.close()
        await asyncio.gather(*(closed_within(r, 3.0) for r, _ in stalled))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/ping")).status_code == 200
        for _, w in stalled:
            w.close()


async def test_a_flood_of_stalled_connections_is_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limits = HttpLimits(max_connections=50, head_timeout_s=0.5, log_every_s=60)
    caplog.set_level(logging.WARNING, logger="plexrl.health")
    async with served(limits) as port:
        stalled = [await half_sent(port) for _ in range(80)]  # 30 over the cap
        await asyncio.gather(*(closed_within(r, 3.0) for r, _ in stalled))
        for _, w in stalled:
            w.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "plexrl.health"]
    assert len(lines) == 1, lines
    assert "refused over the cap of 50 open" in lines[0]


def test_report_logs_counts_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    report = ConnectionReport("srv", every_s=10, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="plexrl.health")
    for t in range(25):
        now[0] = float(t)
        report.note("closed with no complete request head after 10s")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # at 0, 10 and 20 s
    assert lines[1] == (
        "HTTP server srv: connections 10 closed with no complete request head after 10s "
        "in the last 10s"
    )


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLEXRL_HTTP_MAX_CONNECTIONS", "64")
    monkeypatch.setenv("PLEXRL_HTTP_HEAD_TIMEOUT_S", "2.5")
    limits = HttpLimits.from_settings(CommonSettings())
    assert (limits.max_connections, limits.head_timeout_s) == (64, 2.5)
    assert limits.body_timeout_s == HttpLimits().body_timeout_s


async def test_a_server_built_without_limits_takes_them_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # How the scheduler's and the workers' health servers are built.
    monkeypatch.setenv("PLEXRL_HTTP_HEAD_TIMEOUT_S", "0.5")
    port = free_port()
    server = HttpServer(health_app("svc", lambda: {"ok": True}), "127.0.0.1", port)
    await server.start()
    try:
        reader, writer = await half_sent(port)
        started = time.monotonic()
        assert await closed_within(reader, 3.0) == b""
        assert time.monotonic() - started < 1.5
        writer.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/healthz")).json()["ok"] is True
    finally:
        await server.stop()
