"""End to end: the unmodified `tinker` SDK against all four services over real Kafka and Redis."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from plexrl.settings import WorkerSettings
from plexrl_tools.cluster import LocalCluster

pytestmark = pytest.mark.integration

BASE = "plexrl/tiny-qwen3"
KEY = "tml-e2e-alpha"
EPHEMERAL_KEEP = WorkerSettings.model_fields["ephemeral_keep"].default
OTHER_KEY = "tml-e2e-beta"


@pytest.fixture(scope="session")
def cluster(shared_services: LocalCluster) -> LocalCluster:
    """The session's shared cluster (tests/conftest.py): traces go to its OTLP receiver,
    and its services must each exit 0 on SIGTERM at the end of the session."""
    return shared_services


@pytest.fixture(scope="session")
def service(cluster: LocalCluster) -> tinker.ServiceClient:
    os.environ["HF_HUB_OFFLINE"] = "1"
    return tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "weights": types.TensorData(data=weights or [1.0] * (len(tokens) - 1), dtype="float32"),
        },
    )


BATCH = [datum([5, 6, 7, 8, 9, 10, 11]), datum([20, 21, 22, 23, 24])]
ADAM = types.AdamParams(learning_rate=5e-3)


def train_steps(client: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = client.forward_backward(BATCH, "cross_entropy")
        opt = client.optim_step(ADAM)
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def forward_loss(client: Any) -> float:
    return float(client.forward(BATCH, "cross_entropy").result().metrics["loss:sum"])


def sample_tokens(sampler: Any, seed: int = 7) -> list[list[int]]:
    if hasattr(sampler, "result"):
        sampler = sampler.result()
    response = sampler.sample(
        types.ModelInput.from_ints([5, 6, 7]),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=6, seed=seed, temperature=1.0),
    ).result()
    return [list(s.tokens) for s in response.sequences]


def test_lora_training_loss_decreases_and_sampler_sees_new_weights(
    service: tinker.ServiceClient,
) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    info = client.get_info()
    assert info.is_lora and info.model_data.model_name == BASE
    assert client.get_tokenizer().encode("12", add_special_tokens=False)  # offline tokenizer

    before = client.save_weights_and_get_sampling_client()
    first = sample_tokens(before)
    assert sample_tokens(before) == first  # seeded: reproducible

    losses = train_steps(client, 6)
    assert losses[-1] < losses[0] * 0.9, losses

    after = client.save_weights_and_get_sampling_client()
    assert sample_tokens(after) != first  # the new sampler reads the trained weights
    assert sample_tokens(before) == first  # the old one still reads its own snapshot

    named = client.save_weights_for_sampler("named").result()
    assert named.path.endswith("/sampler_weights/named")
    by_path = service.create_sampling_client(model_path=named.path)
    assert sample_tokens(by_path) == sample_tokens(after)


def test_ephemeral_sampler_snapshots_are_retired(
    cluster: LocalCluster, service: tinker.ServiceClient
) -> None:
    """Each RL step's `save_weights_and_get_sampling_client` leaves a snapshot; a job
    keeps its newest few (PLEXRL_EPHEMERAL_KEEP), and none once it is unloaded."""
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    named = client.save_weights_for_sampler("kept").result().path
    samplers = []
    for _ in range(EPHEMERAL_KEEP + 2):
        train_steps(client, 1)
        samplers.append(client.save_weights_and_get_sampling_client())
    rest = service.create_rest_client()

    def ephemeral() -> list[str]:
        listed = rest.list_checkpoints(client.model_id).result().checkpoints
        return sorted(c.checkpoint_id for c in listed if "ephemeral-" in c.checkpoint_id)

    assert len(ephemeral()) == EPHEMERAL_KEEP
    for sampler in samplers[-EPHEMERAL_KEEP:]:
        assert sample_tokens(sampler)
    with pytest.raises(Exception, match="PLEXRL_EPHEMERAL_KEEP"):
        sample_tokens(samplers[0])  # retired: a 404 that says why and what to do

    with httpx.Client(base_url=cluster.config.gateway_url, headers={"X-API-Key": KEY}) as http:

        def sessions() -> list[str]:
            listed = http.get("/plexrl/v1/jobs").json()
            return [j["job_id"] for j in listed if j.get("owner_job") == client.model_id]

        # the sampling sessions opened over retired snapshots are retired with them
        assert len(sessions()) == EPHEMERAL_KEEP
        unloaded = http.post("/api/v1/unload_model", json={"model_id": client.model_id})
        assert unloaded.status_code == 200, unloaded.text
        request_id = unloaded.json()["request_id"]
        deadline = time.monotonic() + 60
        while ephemeral() and time.monotonic() < deadline:
            time.sleep(0.2)
        http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert ephemeral() == []
        assert sessions() == []
        # Its recovery snapshots go too (the ledger's blob book); its results archive stays.
        snapshots = cluster.config.state_dir / "blobs" / "snapshot" / client.model_id
        while any(snapshots.glob("*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(snapshots.glob("*"))
        results = cluster.config.state_dir / "blobs" / "results" / client.model_id
        assert any(results.glob("*.msgpack"))
    # A named sampler save is the user's to delete: it outlives the model.
    assert sample_tokens(service.create_sampling_client(model_path=named))


def test_save_and_load_state_round_trip_is_exact(service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=8, seed=2).result()
    train_steps(client, 3)
    saved_loss = forward_loss(client)
    path = client.save_state("ckpt").result().path
    assert path.endswith("/weights/ckpt")

    continued = train_steps(client, 3)
    assert forward_loss(client) != saved_loss

    restored = service.create_training_client_from_state_with_optimizer(path).result()
    assert forward_loss(restored) == saved_loss  # bit-identical weights
    assert train_steps(restored, 3) == continued  # and optimizer state: same trajectory


def test_full_fine_tuning_model(service: tinker.ServiceClient) -> None:
    """`create_model` with no LoRA config (the wire allows it; the SDK's public API does not)."""
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    holder = service.holder
    seq = holder.get_training_client_id()
    model_id = f"{holder.get_session_id()}:train:{seq}"

    async def create() -> TrainingClient:
        request = types.CreateModelRequest(
            session_id=holder.get_session_id(), model_seq_id=seq, base_model=BASE
        )
        with holder.aclient(ClientConnectionPoolType.TRAIN) as http:
            future = await http.models.create(request=request)
        created = await _APIFuture(
            types.CreateModelResponse, holder, future, time.time(), "CreateModel"
        ).result_async()
        assert created.model_id == model_id
        return TrainingClient(
            holder,
            model_seq_id=seq,
            model_id=model_id,
            info=await fetch_training_info(holder, model_id),
        )

    client = holder.run_coroutine_threadsafe(create()).result()
    assert client.get_info().is_lora is False
    losses = train_steps(client, 4)
    assert losses[-1] < losses[0], losses


def test_tenants_are_isolated(cluster: LocalCluster, service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    url = cluster.config.gateway_url
    with httpx.Client(base_url=url, timeout=30) as http:
        body = {"model_id": client.model_id, "type": "get_info"}
        assert http.post("/api/v1/get_info", json=body).status_code == 401
        assert (
            http.post(
                "/api/v1/get_info", json=body, headers={"X-API-Key": "tml-nobody"}
            ).status_code
            == 401
        )
        foreign = http.post("/api/v1/get_info", json=body, headers={"X-API-Key": OTHER_KEY})
        assert (foreign.status_code == 404 and "error" in foreign.text.lower()) or foreign.json()
        mine = http.post("/api/v1/get_info", json=body, headers={"X-API-Key": KEY})
        assert mine.status_code == 200


def test_bad_input_gets_a_clear_4xx(cluster: LocalCluster, service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.APIStatusError) as unknown_model:
        service.create_lora_training_client(base_model="no/such-model", rank=4).result()
    assert unknown_model.value.status_code in (400, 404)
    assert BASE in str(unknown_model.value)  # says what is available

    with pytest.raises(tinker.APIStatusError) as bad_loss:
        client.forward_backward(BATCH, "no_such_loss").result()  # type: ignore[arg-type]
    assert bad_loss.value.status_code == 400 and "cross_entropy" in str(bad_loss.value)

    mismatched = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[2, 3], dtype="int64"),
            "weights": types.TensorData(data=[1.0, 1.0], dtype="float32"),
        },
    )
    with pytest.raises(tinker.APIStatusError) as lengths:
        client.forward_backward([mismatched], "cross_entropy").result()
    assert lengths.value.status_code == 400 and "tokens" in str(lengths.value)

    with pytest.raises(tinker.APIStatusError) as vocab:
        client.forward_backward([datum([1, 2, 10_000_000])], "cross_entropy").result()
    assert vocab.value.status_code == 400 and "vocab" in str(vocab.value).lower()

    # The services are still up and serving after all of that.
    assert train_steps(client, 1)


def test_metrics_and_plexrl_api(cluster: LocalCluster, service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(client, 2)
    url = cluster.config.gateway_url
    with httpx.Client(base_url=url, timeout=30, headers={"X-API-Key": KEY}) as http:
        assert "plexrl" in http.get("/metrics").text
        workers = http.get("/plexrl/v1/workers").json()
        assert workers and "worker-0" in str(workers)
        echo = http.post("/plexrl/v1/echo").json()
        assert echo["latency_s"] < 5
        job = http.get(f"/plexrl/v1/jobs/{client.model_id}").json()
        assert (job and "accounting" in str(job).lower()) or "device" in str(job)
        timeline = http.get("/plexrl/v1/timeline").json()
        assert any(client.model_id in str(entry) for entry in timeline)
        hint = http.post(f"/plexrl/v1/jobs/{client.model_id}/idle", json={"seconds": 2.0})
        assert hint.status_code in (200, 202)
    time.sleep(0)  # keep the cluster fixture alive through this test


def test_services_export_traces_over_otlp(
    service: tinker.ServiceClient, otlp_services: set[str]
) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(client, 1)
    deadline = time.monotonic() + 20
    wanted = {"plexrl-gateway", "plexrl-scheduler", "plexrl-worker-0"}
    while not wanted <= otlp_services and time.monotonic() < deadline:
        time.sleep(0.2)
    assert wanted <= otlp_services, otlp_services


def test_garbage_on_a_topic_is_dead_lettered_and_the_cluster_goes_on(
    cluster: LocalCluster, service: tinker.ServiceClient, infra: dict[str, str]
) -> None:
    from plexrl.kafka import Delivery, MessageConsumer, Publisher
    from plexrl.messages import DeadLetter, DeadLetterReason
    from plexrl.topics import Topics

    topics = Topics(cluster.config.cluster_id)

    async def poison_and_read() -> DeadLetter:
        publisher = Publisher(infra["kafka"], "e2e-poison")
        await publisher.start()
        letters: asyncio.Queue[DeadLetter] = asyncio.Queue()

        async def on_letter(letter: DeadLetter, _: Delivery) -> None:
            if letter.value == b"\x81\xa1?not a request":
                await letters.put(letter)

        reader = MessageConsumer[DeadLetter](
            bootstrap=infra["kafka"],
            topics=[topics.dlq],
            group=None,
            message_type=DeadLetter,
            handler=on_letter,
            dlq=(publisher, topics.dlq),
            name="e2e-dlq",
        )
        await reader.start()
        stop = asyncio.Event()
        task = asyncio.create_task(reader.run(stop))
        try:
            await publisher.publish_raw(topics.requests, b"x", b"\x81\xa1?not a request")
            return await asyncio.wait_for(letters.get(), 30)
        finally:
            stop.set()
            await task
            await reader.stop()
            await publisher.stop()

    letter = asyncio.run(poison_and_read())
    assert letter.reason == DeadLetterReason.UNDECODABLE and letter.detail
    assert letter.source_topic == topics.requests and "scheduler" in letter.consumer
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    assert train_steps(client, 1)  # the scheduler went on


def test_rl_losses_and_stop_sequences_through_the_sdk(service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    sampler = client.save_weights_and_get_sampling_client()
    prompt = [5, 6, 7]
    params = types.SamplingParams(max_tokens=8, seed=3, temperature=1.0)
    free = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    stop_at = int(free.tokens[3])
    stopped = (
        sampler.sample(
            types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(max_tokens=8, seed=3, temperature=1.0, stop=[stop_at]),
        )
        .result()
        .sequences[0]
    )
    assert stopped.stop_reason == "stop" and stopped.tokens[-1] == stop_at
    assert len(stopped.tokens) <= 4 and len(stopped.logprobs or []) == len(stopped.tokens)

    tokens = prompt + list(free.tokens)
    n = len(tokens) - 1
    pad = [0.0] * (len(prompt) - 1)
    rl = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "logprobs": types.TensorData(data=pad + list(free.logprobs or []), dtype="float32"),
            "advantages": types.TensorData(data=pad + [1.0] * len(free.tokens), dtype="float32"),
        },
    )
    for loss in ("importance_sampling", "ppo"):
        out = client.forward_backward([rl], loss).result()
        value = out.metrics["loss:sum"]
        # At the sampler's own weights every ratio is 1: the loss is -sum(advantages).
        assert abs(value + len(free.tokens)) < 1e-2, (loss, value)
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == n
    client.optim_step(ADAM).result()


def test_concurrent_samples_run_co_batched_and_match_one_at_a_time(
    cluster: LocalCluster, service: tinker.ServiceClient
) -> None:
    """Sample calls sent at once reach the worker together and run in one batch; each
    answers exactly what it answers sent alone."""
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=9).result()
    train_steps(client, 1)
    sampler = client.save_weights_and_get_sampling_client()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]

    def send(i: int, prompt: list[int]) -> Any:
        params = types.SamplingParams(max_tokens=10, seed=100 + i, temperature=1.0)
        return sampler.sample(types.ModelInput.from_ints(prompt), 2, params)

    futures = [send(i, p) for i, p in enumerate(prompts)]
    together = [f.result() for f in futures]
    alone = [send(i, p).result() for i, p in enumerate(prompts)]

    def seen(results: list[Any]) -> list[list[tuple[list[int], list[float]]]]:
        return [[(list(s.tokens), list(s.logprobs or [])) for s in r.sequences] for r in results]

    assert seen(together) == seen(alone)
    port = cluster.config.worker_port(0)
    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    assert "plexrl_worker_sample_batch_calls_count" in scraped
