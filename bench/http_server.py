"""The services' HTTP server against uvicorn's h11 and httptools servers, CPU per request.

    .venv/bin/python bench/http_server.py [--requests 20000] [--clients 16] [--rounds 3]

Each server runs in a process of its own and answers a small JSON body from a bare ASGI
app (no framework, no I/O), so what differs is the HTTP layer alone:

- *services*: `plexrl.health.HttpServer`, as every service runs it (uvicorn's httptools
  parser with the connection cap, the read deadlines and the head cap);
- *h11*: uvicorn on its pure-Python h11 parser, no limits (what the services ran before);
- *httptools*: uvicorn on httptools, no limits (what the limits cost on top).

A client process keeps `--clients` keep-alive connections busy, one request in flight
on each (a POST with the headers the Tinker SDK sends); the server's CPU per request is
read from /proc over `--requests` requests after a warm-up, in alternating rounds, and
the best round of each kept. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

from control_plane import BARE_ASGI, cpu_s, free_port

SERVER = (
    BARE_ASGI
    + r"""
import asyncio

kind, port = sys.argv[1], int(sys.argv[2])
if kind == "services":
    from plexrl.health import HttpServer

    async def main():
        server = HttpServer(app, "127.0.0.1", port)
        await server.start()
        await asyncio.Event().wait()

    asyncio.run(main())
else:
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=kind,
                lifespan="off", loop="asyncio")
"""
)

CLIENT = r"""
import selectors, socket, sys
port, n, clients = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
body = b'{"sdk_version": "0.38.0"}'
request = (
    b"POST /plexrl/v1/echo HTTP/1.1\r\nhost: 127.0.0.1\r\nx-api-key: tml-bench\r\n"
    b"content-type: application/json\r\naccept: application/json\r\n"
    b"traceparent: 00-0000000000000000000000000000abcd-00000000000000ef-01\r\n"
    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
)
selector = selectors.DefaultSelector()
for _ in range(clients):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    selector.register(s, selectors.EVENT_READ)
    s.sendall(request)
answered = 0
while answered < n:
    for key, _ in selector.select():
        data = key.fileobj.recv(65536)
        if not data:
            raise SystemExit("the server closed a connection")
        answered += data.count(b"HTTP/1.1 200 ")
        key.fileobj.sendall(request)
"""

KINDS = ("services", "h11", "httptools")


def wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the server did not listen within 30 s")


def one_round(kind: str, requests: int, clients: int) -> tuple[float, float]:
    """(server CPU µs per request, requests/s) for one server of `kind`."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, kind, str(port)])
    client = [sys.executable, "-c", CLIENT, str(port)]
    try:
        wait_listening(port, server)
        subprocess.run([*client, str(requests // 10), str(clients)], check=True)
        pid = {"server": server.pid}
        before, started = cpu_s(pid)["server"], time.perf_counter()
        subprocess.run([*client, str(requests), str(clients)], check=True)
        wall = time.perf_counter() - started
        return (cpu_s(pid)["server"] - before) / requests * 1e6, requests / wall
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rounds: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        for kind in KINDS if r % 2 == 0 else reversed(KINDS):
            rounds[kind].append(one_round(kind, args.requests, args.clients))
            cpu, rate = rounds[kind][-1]
            print(f"round {r} {kind}: {cpu:.1f} µs of server CPU per request, {rate:.0f}/s")
    best = {k: min(v) for k, v in rounds.items()}
    result = {
        "benchmark": "http_server",
        "requests": args.requests,
        "clients": args.clients,
        "rounds": args.rounds,
        "server_cpu_us_per_request": {k: round(v[0], 1) for k, v in best.items()},
        "server_cpu_us_per_request_by_round": {
            k: [round(c, 1) for c, _ in v] for k, v in rounds.items()
        },
        "requests_per_s": {k: round(max(r for _, r in v)) for k, v in rounds.items()},
        "services_over_h11": round(best["services"][0] / best["h11"][0], 3),
        "services_over_httptools": round(best["services"][0] / best["httptools"][0], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
