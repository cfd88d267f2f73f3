"""Helpers for the gateway tests: a fake Kafka edge and a fake worker's answers.

Only the edges are fake: the publisher stand-in records what the gateway would send to
Kafka, and the fake worker answers phase requests with canned outputs the way a real
worker records them (Redis first, then the completions topic).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from plexrl import tracing
from plexrl.messages import (
    CompletionStatus,
    CreateOutput,
    ErrorInfo,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    Function,
    LoadInput,
    LoadOutput,
    NoopOutput,
    OptimStepOutput,
    PhaseCompletion,
    PhaseInput,
    PhaseOutput,
    PhaseRequest,
    SampledSequence,
    SampleInput,
    SampleOutput,
    SaveInput,
    SaveKind,
    SaveOutput,
    StopReason,
    TensorArray,
    Timings,
    UnloadOutput,
)
from plexrl.payloads import resolve
from plexrl.stores import CallStore, CheckpointRecord, Stores
from plexrl_gateway.futures import FutureWaiter
from plexrl_tools.cluster import free_port as free_port  # re-exported to the tests

TINY_MODEL = "plexrl/tiny-qwen3"
"""The name conftest's `tiny_registry` model answers to."""


def unique_cluster(prefix: str = "gwtest") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def drop_cluster_keys(stores: Stores, cluster_id: str) -> None:
    keys = [k async for k in stores.keys.redis.scan_iter(match=f"{cluster_id}:*", count=1000)]
    if keys:
        await stores.keys.redis.delete(*keys)


@dataclass
class FakePublisher:
    """Records what would go to Kafka; `fail` makes every publish raise."""

    sent: list[tuple[str, str | bytes | None, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    """The Kafka headers each message would carry (the trace context)."""
    fail: bool = False

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None:
        if self.fail:
            raise ConnectionError("broker unreachable")
        self.sent.append((topic, key, message))
        # The real producer's send span is a child of the current span: same trace.
        self.headers.append({"traceparent": tracing.traceparent_of() or ""})

    async def publish_deferred(
        self, topic: str, key: str | bytes | None, message: Any
    ) -> asyncio.Future[None]:
        """`publish`, acknowledged at once."""
        await self.publish(topic, key, message)
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ack.set_result(None)
        return ack

    async def ping(self, timeout_s: float = 2.0) -> bool:
        return not self.fail

    def requests(self) -> list[PhaseRequest]:
        return [m for _, _, m in self.sent if isinstance(m, PhaseRequest)]


async def canned_output(stores: Stores, request: PhaseRequest) -> PhaseOutput:
    """What a worker would answer, without a model: fixed numbers of the right shapes."""
    payload = await resolve(stores.payloads, request.payload, PhaseInput)
    match payload:
        case ForwardBackwardInput():
            outputs = [
                {"logprobs": TensorArray.from_list([-1.5] * len(d.tokens), "float32")}
                for d in payload.data
            ]
            loss = 1.5 * sum(len(d.tokens) for d in payload.data)
            return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": loss})
        case SampleInput():
            sequences = [
                SampledSequence(
                    tokens=[10 + i, 11, 12],
                    logprobs=[-0.25] * 3,
                    stop_reason=StopReason.LENGTH if i % 2 == 0 else StopReason.STOP,
                )
                for i in range(payload.num_samples)
            ]
            prompt_lp: list[float | None] | None = None
            if payload.prompt_logprobs:
                prompt_lp = [None] + [-2.0] * (len(payload.prompt) - 1)
            return SampleOutput(sequences=sequences, prompt_logprobs=prompt_lp)
        case SaveInput():
            kind = "weights" if payload.kind == SaveKind.STATE else "sampler_weights"
            await stores.checkpoints.put_checkpoint(
                CheckpointRecord(
                    path=payload.path,
                    tenant=request.tenant,
                    job_id=request.job_id,
                    kind=kind,
                    blob_key=f"fake/{payload.path}",
                    size_bytes=123,
                    created_at=time.time(),
                    base_model=TINY_MODEL,
                    lora_rank=8,
                )
            )
            return SaveOutput(path=payload.path, size_bytes=123)
        case LoadInput():
            return LoadOutput(path=payload.path)
    by_function: dict[str, PhaseOutput] = {
        "create": CreateOutput(trainable_params=1000, state_bytes=16000),
        "optim_step": OptimStepOutput(metrics={"grad_norm": 0.5, "lr:mean": 1e-4}),
        "unload": UnloadOutput(),
    }
    return by_function.get(str(request.function), NoopOutput())


def completion_for(
    request: PhaseRequest, output: PhaseOutput | None, error: ErrorInfo | None = None
) -> PhaseCompletion:
    return PhaseCompletion(
        request_id=request.request_id,
        job_id=request.job_id,
        tenant=request.tenant,
        worker_id="fake-worker",
        function=request.function,
        status=CompletionStatus.OK if error is None else CompletionStatus.ERROR,
        timings=Timings(queue_s=0.0, compute_s=0.0),
        result=output,
        error=error,
        finished_at=time.time(),
    )


async def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


def noop_completion(request_id: str, worker: str = "w0") -> PhaseCompletion:
    """A finished NOOP call of job `job` (tenant `alice`), as a worker records it."""
    return PhaseCompletion(
        request_id=request_id,
        job_id="job",
        tenant="alice",
        worker_id=worker,
        function=Function.NOOP,
        status=CompletionStatus.OK,
        timings=Timings(queue_s=0.0, compute_s=0.0),
        result=NoopOutput(),
        finished_at=time.time(),
    )


async def start_waiting(
    futures: FutureWaiter, request_id: str, timeout_s: float = 60.0
) -> asyncio.Task[PhaseCompletion | None]:
    """A poll for the call's completion, returned once its waiter has registered."""
    waiter = asyncio.create_task(futures.wait(request_id, timeout_s))
    deadline = time.monotonic() + 5
    while request_id not in futures.waiting:
        assert time.monotonic() < deadline, "the waiter never registered"
        await asyncio.sleep(0.005)
    return waiter


async def answered_when_recorded(
    calls: CallStore, futures: FutureWaiter, request_id: str, within_s: float
) -> PhaseCompletion | None:
    """Wait for a call, record its completion, and what the wait answered."""
    waiter = await start_waiting(futures, request_id)
    await calls.record_completion(noop_completion(request_id))
    return await asyncio.wait_for(waiter, within_s)
