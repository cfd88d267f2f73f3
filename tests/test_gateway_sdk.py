"""The unmodified Tinker SDK against an in-process gateway on real Kafka and Redis.

No scheduler or worker runs here: the test itself consumes the requests topic and
answers each call the way a worker does (completion recorded in Redis, then published
on the completions topic). Everything between the SDK and that edge is real.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import tinker
from gateway_support import (
    TINY_MODEL,
    canned_output,
    completion_for,
    drop_cluster_keys,
    free_port,
    unique_cluster,
)

from plexrl.kafka import Delivery, MessageConsumer, Publisher
from plexrl.messages import Function, PhaseRequest
from plexrl.settings import GatewaySettings
from plexrl.stores import Stores
from plexrl.topics import Topics
from plexrl_gateway.main import serve

pytestmark = pytest.mark.integration

API_KEY = "tml-integration"


@dataclass
class Cluster:
    base_url: str
    settings: GatewaySettings
    handled: list[PhaseRequest]


class FakeWorker:
    """Answers every phase request at once with a canned output of the right shape."""

    def __init__(self, stores: Stores, publisher: Publisher, topics: Topics) -> None:
        self._stores = stores
        self._publisher = publisher
        self._topics = topics
        self.handled: list[PhaseRequest] = []

    async def on_request(self, request: PhaseRequest, _: Delivery) -> None:
        self.handled.append(request)
        output = await canned_output(self._stores, request)
        completion = await self._stores.calls.record_completion(completion_for(request, output))
        await self._publisher.publish(self._topics.completions, request.job_id, completion)


@pytest_asyncio.fixture
async def cluster(infra: dict[str, str], tiny_registry: Path) -> AsyncIterator[Cluster]:
    port = free_port()
    settings = GatewaySettings(
        cluster_id=unique_cluster("gwsdk"),
        kafka_bootstrap=infra["kafka"],
        redis_url=infra["redis"],
        gateway_port=port,
        api_keys=f"{API_KEY}=integration",
        model_registry=tiny_registry,
        scheduler_url="http://127.0.0.1:9",
    )
    stop = asyncio.Event()
    gateway = asyncio.create_task(serve(settings, stop))
    base_url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base_url) as http:
        for _ in range(600):
            if gateway.done():
                gateway.result()
            try:
                if (await http.get("/healthz")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    topics = Topics(settings.cluster_id)
    stores = Stores.from_url(settings.redis_url, settings.cluster_id, settings.record_ttl_s)
    publisher = Publisher(settings.kafka_bootstrap, "fake-worker")
    worker = FakeWorker(stores, publisher, topics)
    requests = MessageConsumer[PhaseRequest](
        bootstrap=settings.kafka_bootstrap,
        topics=[topics.requests],
        group=None,
        message_type=PhaseRequest,
        handler=worker.on_request,
        dlq=(publisher, topics.dlq),
        name="fake-worker",
    )
    await publisher.start()
    await requests.start()
    await requests.wait_assigned()
    worker_stop = asyncio.Event()
    consuming = asyncio.create_task(requests.run(worker_stop))
    try:
        yield Cluster(base_url, settings, worker.handled)
    finally:
        worker_stop.set()
        await consuming
        await requests.stop()
        await publisher.stop()
        stop.set()
        await gateway
        await drop_cluster_keys(stores, settings.cluster_id)
        await stores.close()


def sdk_session(base_url: str) -> dict[str, Any]:
    """A user's script: train a LoRA, sample from it, save and resume. Runs in a thread."""
    client = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    out: dict[str, Any] = {}
    try:
        trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=8).result(
            timeout=30
        )
        out["info"] = trainer.get_info()
        inputs: list[dict[str, Any]] = [
            {"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 1.0, 1.0]},
            {"target_tokens": [7, 8]},
        ]
        data = [
            tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=given)
            for tokens, given in zip([[1, 2, 3, 4], [6, 7]], inputs, strict=True)
        ]
        fb = trainer.forward_backward(data, "cross_entropy")
        optim = trainer.optim_step(tinker.AdamParams(learning_rate=1e-3))
        out["fb"], out["optim"] = fb.result(timeout=30), optim.result(timeout=30)
        out["forward"] = trainer.forward(data, "cross_entropy").result(timeout=30)
        sampler = trainer.save_weights_and_get_sampling_client().result(timeout=30)
        out["sample"] = sampler.sample(
            prompt=tinker.ModelInput.from_ints([1, 2, 3]),
            num_samples=2,
            sampling_params=tinker.SamplingParams(max_tokens=3, stop=["\n"]),
        ).result(timeout=30)
        out["logprobs"] = sampler.compute_logprobs(tinker.ModelInput.from_ints([1, 2, 3])).result(
            timeout=30
        )
        out["saved"] = trainer.save_state("ckpt1").result(timeout=30)
        resumed = client.create_training_client_from_state_with_optimizer(out["saved"].path)
        out["resumed"] = resumed.result(timeout=30).get_info()
        rest = tinker.RestClient(base_url=base_url, api_key=API_KEY)
        out["checkpoints"] = rest.list_checkpoints(trainer.model_id).result(timeout=30)
        out["run"] = rest.get_training_run(trainer.model_id).result(timeout=30)
    finally:
        client.close("success").result(timeout=30)
    return out


async def test_the_sdk_trains_samples_saves_and_resumes(cluster: Cluster) -> None:
    out = await asyncio.wait_for(asyncio.to_thread(sdk_session, cluster.base_url), 60)
    info = out["info"]
    assert info.model_data.model_name == TINY_MODEL and info.is_lora and info.lora_rank == 8
    assert out["fb"].metrics == {"loss:sum": 9.0}
    assert [d["logprobs"].tolist() for d in out["fb"].loss_fn_outputs] == [[-1.5] * 4, [-1.5] * 2]
    assert out["optim"].metrics == {"grad_norm:mean": 0.5, "lr:mean": 1e-4}
    assert out["forward"].metrics == {"loss:sum": 9.0}
    sequences = out["sample"].sequences
    assert [s.tokens for s in sequences] == [[10, 11, 12], [11, 11, 12]]
    assert [s.stop_reason for s in sequences] == ["length", "stop"]
    assert out["logprobs"] == [None, -2.0, -2.0]
    model_id = info.model_id
    assert out["saved"].path == f"tinker://{model_id}/weights/ckpt1"
    assert out["resumed"].model_id.endswith(":train:1") and out["resumed"].lora_rank == 8
    assert [c.checkpoint_id for c in out["checkpoints"].checkpoints] == [
        "sampler_weights/ephemeral-0",
        "weights/ckpt1",
    ]
    assert out["run"].training_run_id == model_id
    functions = [r.function for r in cluster.handled if r.job_id == model_id]
    assert functions == [
        Function.CREATE,
        Function.FORWARD_BACKWARD,
        Function.OPTIM_STEP,
        Function.FORWARD,
        Function.SAVE,
        Function.SAMPLE,
        Function.SAMPLE,
        Function.SAVE,
        Function.UNLOAD,
    ]


def sdk_after_an_unserved_call(base_url: str) -> float:
    """A training-client call to a route the gateway does not serve (as a method of a
    newer SDK would be), sent the way the SDK sends every call: it takes a seq_id and
    its turn. Returns how long the next call, a forward_backward, took."""
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.types.shared.untyped_api_future import UntypedAPIFuture

    client = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    try:
        trainer = client.create_lora_training_client(base_model=TINY_MODEL, rank=8).result(
            timeout=30
        )
        request_id = trainer._get_request_id()

        async def unserved() -> None:
            body = {"model_id": trainer.model_id, "seq_id": request_id + 1, "type": "future"}
            async with trainer._take_turn(request_id):
                with trainer.holder.aclient(ClientConnectionPoolType.TRAIN) as http:
                    await http.weights._post(
                        "/api/v1/a_method_of_a_newer_sdk",
                        body=body,
                        options={"max_retries": 0},
                        cast_to=UntypedAPIFuture,
                    )

        with pytest.raises(tinker.NotFoundError):
            trainer.holder.run_coroutine_threadsafe(unserved()).result(timeout=30)
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": tinker.TensorData(data=[2, 3, 4], dtype="int64")},
        )
        start = time.monotonic()
        trainer.forward_backward([datum], "cross_entropy").result(timeout=60)
        return time.monotonic() - start
    finally:
        client.close("success").result(timeout=30)


async def test_a_call_to_an_unserved_route_does_not_hold_up_the_next(cluster: Cluster) -> None:
    took = await asyncio.wait_for(
        asyncio.to_thread(sdk_after_an_unserved_call, cluster.base_url), 90
    )
    gap = cluster.settings.sequence_gap_timeout_s
    assert took < gap / 3, f"the next call took {took:.1f}s: it waited for the refused seq_id"


async def test_echo_round_trip_through_kafka(cluster: Cluster) -> None:
    """The control-plane call the benchmark measures; prints its latency here."""
    headers = {"X-API-Key": API_KEY}
    async with httpx.AsyncClient(base_url=cluster.base_url, headers=headers) as http:
        latencies = []
        for _ in range(50):
            start = time.perf_counter()
            response = await http.post("/plexrl/v1/echo")
            assert response.status_code == 200, response.text
            latencies.append(time.perf_counter() - start)
        assert response.json()["status"] == "ok"
    p50 = statistics.median(latencies)
    p95 = sorted(latencies)[int(0.95 * len(latencies)) - 1]
    print(
        f"\necho round trip over HTTP+Kafka+Redis: p50 {p50 * 1e3:.1f} ms, p95 {p95 * 1e3:.1f} ms"
    )
    assert p50 < 1.0
