"""A save serialises the job's state off the worker's event loop: heartbeats and health
keep being answered while a large state is turned into bytes.

The worker's own CallRunner, a real TorchEngine (a full fine-tuning job of the tiny
Qwen3 made wider, so the state carries millions of weights and their Adam moments), the
state-store served over HTTP from a thread of its own (its own event loop, as its own
process has) over real Redis and a blob directory; the worker loop's longest gap during
the save is set beside the time the same serialisation takes.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import uvicorn

from plexrl.ledger import Ledger
from plexrl.messages import (
    CreateInput,
    Function,
    JobSpec,
    PhaseRequest,
    SaveInput,
    SaveKind,
    SaveOutput,
)
from plexrl.models import ModelRegistry, TinyShape, init_tiny
from plexrl.state_store_client import Fence, StateStoreClient
from plexrl.stores import Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine.state import state_to_bytes
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.runner import CallRunner

BASE = "plexrl/tiny-qwen3"
JOB, TENANT = "full-1", "t"


class _Resident:
    """The edge of this test: the job's state is on the device already (no tiers)."""

    async def onload(self, job_id: str) -> float:
        return 0.0

    async def created(self, job_id: str, state_bytes: int) -> None:
        pass


@pytest.fixture
def served(infra: dict[str, str], cluster_id: str, tmp_path: Path) -> Iterator[str]:
    """The state-store's app on a free port, in a thread with its own loop and stores."""

    app_stores = Stores.from_url(infra["redis"], cluster_id, ttl_s=60)
    app = build_app(BlobDir(tmp_path / "blobs"), app_stores.checkpoints, app_stores.residency)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )

    async def serve(server: uvicorn.Server) -> None:
        try:
            await server.serve()
        finally:
            await app_stores.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(server),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the state-store did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def request(function: Function, payload: Any) -> PhaseRequest:
    return PhaseRequest(
        request_id=f"r-{function}",
        job_id=JOB,
        tenant=TENANT,
        function=function,
        payload=payload,
        arrival_time=time.time(),
    )


async def longest_gap(until: asyncio.Task[Any], every_s: float = 0.002) -> float:
    """The longest the event loop went without running this ticker, until `until` ends."""
    gap, last = 0.0, time.perf_counter()
    while not until.done():
        await asyncio.sleep(every_s)
        now = time.perf_counter()
        gap, last = max(gap, now - last - every_s), now
    return gap


async def test_a_save_leaves_the_event_loop_free_while_the_state_is_serialised(
    stores: Stores, cluster_id: str, tmp_path: Path, served: str
) -> None:
    # Some 30M weights and moments: a state of about 120 MB, a tenth of a second or more
    # to serialise.
    shape = TinyShape(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8)
    init_tiny(tmp_path / "models" / "tiny-qwen3", shape=shape)
    engine = TorchEngine(ModelRegistry(tmp_path / "models"), EngineConfig())
    thread = EngineThread()
    store = StateStoreClient(served)
    runner = CallRunner(
        engine=engine,
        thread=thread,
        states=cast(Any, _Resident()),
        payloads=stores.payloads,
        checkpoints=stores.checkpoints,
        jobs=stores.jobs,
        store=store,
    )
    try:
        epoch = await Ledger(stores.keys.redis, cluster_id).bump_epoch(JOB, "worker-0")
        fence = Fence(JOB, epoch)
        spec = JobSpec(base_model=BASE, seed=1)  # full fine-tuning: every weight
        created = await runner.run(request(Function.CREATE, CreateInput(spec)), fence)
        assert created.error is None, created.error
        state = engine.export_state(JOB, optimizer=True, gradients=False)
        start = time.perf_counter()
        size = len(state_to_bytes(state))
        serialise_s = time.perf_counter() - start

        save = SaveInput(SaveKind.STATE, f"tinker://{JOB}/weights/big")
        task = asyncio.create_task(runner.run(request(Function.SAVE, save), fence))
        gap = await longest_gap(task)
        ran = await task
    finally:
        await store.close()
        thread.shutdown()
    assert ran.error is None, ran.error
    assert isinstance(ran.output, SaveOutput) and ran.output.size_bytes == size
    # On the loop, the save would hold it at least as long as one serialisation.
    assert gap < 0.5 * serialise_s, (gap, serialise_s, size)
