"""bench/control_plane.py's lean client and bare server, without a cluster: the ceiling
they report is only worth reading if the client counts real answers."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from control_plane import LeanClient, bare_server


def test_the_lean_client_counts_every_answer_of_the_bare_server() -> None:
    with bare_server() as url:
        rate, cpu = asyncio.run(LeanClient(url, "/anything").calls(clients=4, n=200))
    assert rate > 0
    assert 0 < cpu < 0.05  # seconds of this process per call


def test_the_lean_client_refuses_an_answer_that_is_not_a_200() -> None:
    async def refusing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async def call() -> None:
        server = await asyncio.start_server(refusing, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await LeanClient(f"http://127.0.0.1:{port}", "/plexrl/v1/echo").calls(1, 1)

    with pytest.raises(RuntimeError, match="401"):
        asyncio.run(call())
