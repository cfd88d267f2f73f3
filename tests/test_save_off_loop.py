"""A save serialises the job's state, and a load parses it, off the worker's event loop:
heartbeats and health keep being answered while a large state moves.

The worker's own CallRunner, a real TorchEngine (a full fine-tuning job of the tiny
Qwen3 made wider, so the state carries millions of weights and their Adam moments), the
state-store served over HTTP from a process of its own, as deployed, over real Redis
and a blob directory; the worker loop's longest gap during
the save is set beside the time the same serialisation takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, cast

os.environ["HF_HUB_OFFLINE"] = "1"

import httpx
import pytest
from gateway_support import free_port

from plexrl.ledger import Ledger
from plexrl.messages import (
    CreateInput,
    Function,
    JobSpec,
    LoadInput,
    PhaseRequest,
    SaveInput,
    SaveKind,
    SaveOutput,
)
from plexrl.models import ModelRegistry, TinyShape, init_tiny
from plexrl.state_store_client import Fence, StateStoreClient
from plexrl.stores import Stores
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine.state import state_to_bytes
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.executor import LocalExecutor
from plexrl_worker.runner import CallRunner, Ran

BASE = "plexrl/tiny-qwen3"
JOB, TENANT = "full-1", "t"
ATTEMPTS = 3
"""Saves (and loads) tried before a long loop gap counts against the code."""


class _Resident:
    """The edge of this test: the job's state is on the device already (no tiers)."""

    async def onload(self, job_id: str) -> float:
        return 0.0

    async def created(self, job_id: str, state_bytes: int) -> None:
        pass


_SERVE = """
import sys
from pathlib import Path

import uvicorn

from plexrl.stores import Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir

redis_url, cluster_id, root, port = sys.argv[1:5]
stores = Stores.from_url(redis_url, cluster_id, 60)
app = build_app(BlobDir(Path(root)), stores.checkpoints, stores.residency)
uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning")
"""


@pytest.fixture
def served(infra: dict[str, str], cluster_id: str, tmp_path: Path) -> Iterator[str]:
    """The state-store's app in a process of its own (as deployed: it shares no
    interpreter with the worker), on a free port, over the real Redis."""
    port = free_port()
    args = [infra["redis"], cluster_id, str(tmp_path / "blobs"), str(port)]
    process = subprocess.Popen([sys.executable, "-c", _SERVE, *args])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "the state-store exited"
            assert time.monotonic() < deadline, "the state-store did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(30)


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


async def shortest_gaps(
    run: Callable[[int], Coroutine[Any, Any, Ran]], below_s: float
) -> tuple[list[float], Ran]:
    """Up to ATTEMPTS runs (`run(attempt)`), stopping at the first whose longest loop gap
    is under `below_s` or that fails: each run's longest gap, and the last run's result."""
    gaps: list[float] = []
    for attempt in range(ATTEMPTS):
        task = asyncio.create_task(run(attempt))
        gaps.append(await longest_gap(task))
        ran = await task
        if ran.error is not None or gaps[-1] < below_s:
            break
    return gaps, ran


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
        executor=LocalExecutor(engine, thread, store),
        states=cast(Any, _Resident()),
        payloads=stores.payloads,
        checkpoints=stores.checkpoints,
        jobs=stores.jobs,
        store=store,
    )
    try:
        epoch = await Ledger(stores.keys.redis, cluster_id).bump_epoch(JOB, "worker-0")
        fence = Fence(JOB, epoch)
        assert await store.healthy()  # a worker's first request sets up its client
        spec = JobSpec(base_model=BASE, seed=1)  # full fine-tuning: every weight
        created = await runner.run(request(Function.CREATE, CreateInput(spec)), fence)
        assert created.error is None, created.error
        state = engine.export_state(JOB, optimizer=True, gradients=False)
        start = time.perf_counter()
        size = len(state_to_bytes(state))
        serialise_s = time.perf_counter() - start

        # Held on the loop, every attempt would stall it at least one serialisation
        # long; a single long gap can also be this process descheduled on a busy
        # machine, so each direction gets up to ATTEMPTS tries and the shortest counts.
        def saved(attempt: int) -> str:
            return f"tinker://{JOB}/weights/big-{attempt}"

        gaps, ran = await shortest_gaps(
            lambda attempt: runner.run(
                request(Function.SAVE, SaveInput(SaveKind.STATE, saved(attempt))), fence
            ),
            0.5 * serialise_s,
        )
        gap = min(gaps)
        # And back: the load receives and parses the same bytes (no step taken yet, so
        # the state holds weights alone).
        path = saved(len(gaps) - 1)
        load_gaps, loaded = await shortest_gaps(
            lambda _: runner.run(request(Function.LOAD, LoadInput(path, False)), fence),
            0.5 * serialise_s,
        )
        load_gap = min(load_gaps)
        again = engine.export_state(JOB, optimizer=True, gradients=False)
    finally:
        await store.close()
        thread.shutdown()
    assert ran.error is None, ran.error
    assert isinstance(ran.output, SaveOutput) and ran.output.size_bytes == size
    # On the loop, the save would hold it at least as long as one serialisation.
    assert gap < 0.5 * serialise_s, (gaps, serialise_s, size)
    assert loaded.error is None, loaded.error
    assert load_gap < 0.5 * serialise_s, (load_gaps, serialise_s, size)
    assert state_to_bytes(again) == state_to_bytes(state)  # the state it saved, bit for bit
