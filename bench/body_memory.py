"""How much memory JSON forward_backward bodies cost the gateway to take in.

With Redis up (`scripts/infra.sh up`):

    PYTHONPATH=tests .venv/bin/python bench/body_memory.py TOKENS [N]

It serves a gateway over real Redis (PLEXRL_REDIS_URL; Kafka faked, as in
tests/gateway_harness.py) in a child process of its own on a real port, posts N JSON
forward_backward bodies at once, each one datum of TOKENS tokens with its targets and
weights (2,200,000 tokens is a 30 MB body, far over the call caps: what a hostile or
careless client sends; 131,072 is the most tokens one call may carry), and prints the
growth of the gateway process's peak RSS against the bytes sent; ends with one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from gateway_support import TINY_MODEL, FakePublisher, free_port, unique_cluster

KEY = "tml-mem"


def body_of(tokens: int, model_id: str) -> bytes:
    """One datum of `tokens` tokens with its targets and weights."""
    ids = b"1234," * (tokens - 1) + b"1234"
    weights = b"0.5," * (tokens - 1) + b"0.5"
    return (
        b'{"model_id":"' + model_id.encode() + b'","seq_id":1,"forward_backward_input":'
        b'{"data":[{"model_input":{"chunks":[{"type":"encoded_text","tokens":[' + ids + b"]}]},"
        b'"loss_fn_inputs":{"target_tokens":{"data":[' + ids + b'],"dtype":"int64"},'
        b'"weights":{"data":[' + weights + b'],"dtype":"float32"}}}],'
        b'"loss_fn":"cross_entropy","loss_fn_config":null}}'
    )


async def serve(port: int) -> None:
    """The child: a gateway on `port`; each line on stdin is answered with its peak RSS."""
    from plexrl.health import HttpServer
    from plexrl.models import init_tiny
    from plexrl.settings import GatewaySettings
    from plexrl.stores import Stores
    from plexrl_gateway.app import build_app
    from plexrl_gateway.components import Gateway

    registry = Path(tempfile.mkdtemp())
    init_tiny(registry / "tiny-qwen3")
    settings = GatewaySettings(
        cluster_id=unique_cluster("gwmem"),
        redis_url=os.environ.get("PLEXRL_REDIS_URL", "redis://127.0.0.1:6379/0"),
        api_keys=f"{KEY}=mem",
        model_registry=registry,
    )
    stores = Stores.from_url(settings.redis_url, settings.cluster_id, 600)
    server = HttpServer(
        build_app(Gateway.build(settings, stores, FakePublisher())), "127.0.0.1", port
    )
    await server.start()
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while await loop.run_in_executor(None, sys.stdin.readline):
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, flush=True)


async def measure(tokens: int, parallel: int) -> None:
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"

        def peak_mb() -> float:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write("\n")
            child.stdin.flush()
            return float(child.stdout.readline())

        headers = {"X-API-Key": KEY, "content-type": "application/json"}
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=300
        ) as http:
            session = (await http.post("/api/v1/create_session", json={})).json()["session_id"]
            created = await http.post(
                "/api/v1/create_model",
                json={"session_id": session, "model_seq_id": 0, "base_model": TINY_MODEL},
            )
            body = body_of(tokens, created.json()["model_id"])
            before = peak_mb()
            answers = await asyncio.gather(
                *(http.post("/api/v1/forward_backward", content=body) for _ in range(parallel))
            )
            grew = peak_mb() - before
    finally:
        child.terminate()
        child.wait(30)
    sent = len(body) * parallel / 1024 / 1024
    statuses = sorted(a.status_code for a in answers)
    print(
        f"{parallel} x {len(body) / 1024 / 1024:.1f} MB ({tokens} tokens): gateway peak RSS "
        f"+{grew:.0f} MB ({grew / sent:.1f}x the bytes sent); statuses {statuses}; "
        f"{answers[0].text[:140]}"
    )
    line = {
        "benchmark": "body_memory",
        "tokens": tokens,
        "bodies": parallel,
        "body_mb": round(len(body) / 1024 / 1024, 2),
        "peak_rss_growth_mb": round(grew, 1),
        "growth_per_byte_sent": round(grew / sent, 2),
        "statuses": statuses,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        asyncio.run(serve(int(sys.argv[2])))
    else:
        asyncio.run(measure(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1))
