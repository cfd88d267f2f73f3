"""The worker's side of co-batched sampling and the rollout-tail release: a group of
sample calls runs as one batch, each call is answered as it finishes, and the worker is
told once when fewer than the threshold of the batch's sequences still decode."""

from __future__ import annotations

import asyncio
import os
from typing import Any, cast

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

from plexrl.messages import (
    Function,
    JobSpec,
    LoraSpec,
    PhaseRequest,
    SampleInput,
    SamplingParams,
)
from plexrl.models import ModelRegistry, init_tiny
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.executor import LocalExecutor
from plexrl_worker.runner import CallRunner, Ran

BASE = "plexrl/tiny-qwen3"
SPEC = JobSpec(base_model=BASE, lora=LoraSpec(rank=4), seed=1)


class _Resident:
    """The edge of this test: every state is on the device already (no tiers here)."""

    async def onload(self, job_id: str) -> float:
        return 0.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TorchEngine:
    root = tmp_path_factory.mktemp("tail-models")
    init_tiny(root / "tiny")
    return TorchEngine(ModelRegistry(root), EngineConfig())


def _call(rid: str, samples: int, max_tokens: int, seed: int) -> PhaseRequest:
    params = SamplingParams(max_tokens=max_tokens, seed=seed, stop_at_eos=False)
    return PhaseRequest(
        request_id=rid,
        job_id=f"job-{rid}",
        tenant="t",
        function=Function.SAMPLE,
        payload=SampleInput(prompt=[21, 22, 15], num_samples=samples, params=params),
        arrival_time=0.0,
        spec=SPEC,
    )


def engine_runner(engine: TorchEngine, thread: EngineThread) -> CallRunner:
    """A runner on the engine alone: no stores, every state on the device."""
    none = cast(Any, None)
    return CallRunner(
        executor=LocalExecutor(engine, thread, none),
        states=cast(Any, _Resident()),
        payloads=none,
        checkpoints=none,
        jobs=none,
        store=none,
    )


def test_the_tail_is_released_once_and_early_calls_answer_first(engine: TorchEngine) -> None:
    # Three short calls (3 samples x 2 tokens) and one long (1 x 12): after two steps
    # 1 of 10 sequences decodes, under a 0.25 threshold.
    calls = [
        _call("s1", 3, 2, 1),
        _call("s2", 3, 2, 2),
        _call("s3", 3, 2, 3),
        _call("long", 1, 12, 4),
    ]
    events: list[tuple[str, Any]] = []

    async def on_tail(running: list[int], remaining: int, total: int) -> None:
        events.append(("tail", (running, remaining, total)))

    async def on_done(ended: list[tuple[int, Ran]]) -> None:
        events.extend(("done", i) for i, _ in ended)

    async def main() -> list[Ran]:
        thread = EngineThread()
        try:
            return await engine_runner(engine, thread).run_samples(
                calls, tail_threshold=0.25, on_tail=on_tail, on_done=on_done
            )
        finally:
            thread.shutdown()

    rans = asyncio.run(main())
    assert [e for e in events if e[0] == "tail"] == [("tail", ([3], 1, 10))]
    assert events[-1] == ("done", 3) and [e[1] for e in events[:3]] == [0, 1, 2]
    assert all(r.error is None and r.output is not None for r in rans)
    assert [r.tail_released_at is None for r in rans] == [True, True, True, False]
    # Each call's device share: the long call pays alone for the steps after the others.
    assert rans[3].compute_s > rans[0].compute_s
    # Co-batched or alone, the same samples.
    alone = [engine.sample(f"base:{BASE}", cast(SampleInput, c.payload)) for c in calls]
    assert [r.output for r in rans] == alone


def test_without_a_threshold_nothing_is_released(engine: TorchEngine) -> None:
    told: list[int] = []

    async def on_tail(running: list[int], remaining: int, total: int) -> None:
        told.append(remaining)

    async def main() -> list[Ran]:
        thread = EngineThread()
        try:
            calls = [_call("a", 3, 2, 1), _call("b", 1, 8, 2)]
            return await engine_runner(engine, thread).run_samples(
                calls, tail_threshold=0.0, on_tail=on_tail
            )
        finally:
            thread.shutdown()

    rans = asyncio.run(main())
    assert told == [] and all(r.tail_released_at is None for r in rans)


def test_a_preempted_batch_lets_go_at_once_pauses_at_its_gate_and_samples_the_same(
    engine: TorchEngine,
) -> None:
    call = _call("long", 2, 40, 7)
    told: list[tuple[list[int], int, int]] = []
    steps: list[int] = []
    gate_open = asyncio.Event()
    gate_open.set()

    async def on_tail(running: list[int], remaining: int, total: int) -> None:
        told.append((running, remaining, total))
        gate_open.clear()  # the preempting dispatch runs: the batch waits

    async def gate() -> None:
        steps.append(1)
        await gate_open.wait()

    async def main() -> tuple[list[Ran], int, int]:
        thread = EngineThread()
        release = asyncio.Event()
        try:
            task = asyncio.create_task(
                engine_runner(engine, thread).run_samples(
                    [call], tail_threshold=0.0, on_tail=on_tail, release=release, gate=gate
                )
            )
            while len(steps) < 4:
                await asyncio.sleep(0.001)
            release.set()
            while not told:
                await asyncio.sleep(0.001)
            paused_at = len(steps)
            await asyncio.sleep(0.3)
            assert not task.done()
            held = len(steps)
            gate_open.set()
            return await task, paused_at, held
        finally:
            thread.shutdown()

    rans, paused_at, held = asyncio.run(main())
    assert held == paused_at  # no decode step while paused
    running, remaining, total = told[0]
    assert len(told) == 1 and running == [0] and total == 2 and 0 < remaining <= 2
    assert rans[0].tail_released_at is not None and rans[0].error is None
    # Paused and resumed, the same samples as run straight through.
    assert rans[0].output == engine.sample(f"base:{BASE}", cast(SampleInput, call.payload))
