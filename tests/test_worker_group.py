"""A worker group of 2 CPU ranks (gloo) behind the four services, through the unmodified
tinker SDK.

One cluster for the module: one worker of 2 ranks, each rank with device memory for
0.6 of a full fine-tuning job's state of the tiny model, so a full job fits the group
(half of it on each rank) and no single rank. In order, the tests: train a LoRA job and
full jobs on the group, each alone (the references); run two full jobs at once, which
the device tier cannot hold together (their shards swap out and in); kill -9 the
non-leading rank in the middle of a forward_backward (the worker exits, is restarted
with the same id, and the job goes on from its snapshot); then restart the worker as a
single rank, where a full job is refused with a 400 and the LoRA job trained on two
ranks is restored onto one.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from plexrl.models import ModelRegistry
from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_tools.faults import checkpoint_sha256, random_data

KEY, TENANT = "tml-group", "group"
BASE = "plexrl/tiny-qwen3"
STEPS = 3
PER_RANK = 0.6
"""Each rank's device memory, as a fraction of a full job's state."""


@dataclass
class Outcome:
    model_id: str = ""
    losses: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    checkpoint: str = ""
    """sha256 of the bytes of its final `save_state` checkpoint."""
    client: Any = None


def batch(seed: int) -> list[types.Datum]:
    """A job's data, the same at every step (so its loss falls), enough of it that a
    forward_backward keeps each rank busy for a while (a kill lands inside one)."""
    return random_data(seed, 32, (80, 120))


def full_client(service: tinker.ServiceClient) -> Any:
    """A full fine-tuning training client (`create_model` without a LoRA config, which
    the wire allows and the SDK's public API does not offer)."""
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
        await _APIFuture(
            types.CreateModelResponse, holder, future, time.time(), "CreateModel"
        ).result_async()
        info = await fetch_training_info(holder, model_id)
        return TrainingClient(holder, model_seq_id=seq, model_id=model_id, info=info)

    return holder.run_coroutine_threadsafe(create()).result()


def train(
    service: tinker.ServiceClient, blobs: Path, kind: str, seed: int, during: Any = None
) -> Outcome:
    """STEPS of forward_backward + optim_step, then `save_state`; `during(step)` is
    called once the step's forward_backward is sent."""
    if kind == "lora":
        client = service.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
    else:
        client = full_client(service)
    out = Outcome(client.model_id, client=client)
    adam = types.AdamParams(learning_rate=5e-3)
    data = batch(seed)
    for step in range(STEPS):
        fb = client.forward_backward(data, "cross_entropy")
        if during is not None:
            during(step)
        opt = client.optim_step(adam)
        out.losses.append(float(fb.result().metrics["loss:sum"]))
        metrics = opt.result().metrics
        assert metrics is not None
        out.steps.append(int(metrics["step:max"]))
    client.save_state(f"final-{seed}").result()
    out.checkpoint = checkpoint_sha256(blobs, TENANT, client.model_id, f"final-{seed}")
    return out


@pytest.fixture(scope="module")
def full_state_bytes(tiny_registry: Path) -> int:
    return ModelRegistry(tiny_registry).info(BASE).state_bytes(None)


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str],
    tiny_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
    full_state_bytes: int,
) -> Iterator[LocalCluster]:
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path_factory.mktemp("group-cluster"),
        "grp",
        api_keys=f"{KEY}={TENANT}",
        worker_ranks=2,
        worker_threads=1,
        worker_device_bytes=int(PER_RANK * full_state_bytes),
        env={
            "PLEXRL_WORKER_TIMEOUT_S": "3",
            # A snapshot after every other mutating call: a job's last optim_step is in
            # its snapshot, so a restore onto one rank replays nothing.
            "PLEXRL_SNAPSHOT_EVERY_CALLS": "2",
        },
    )
    with LocalCluster(config) as running:
        yield running


@pytest.fixture(scope="module")
def service(cluster: LocalCluster) -> tinker.ServiceClient:
    os.environ["HF_HUB_OFFLINE"] = "1"
    return tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)


@pytest.fixture(scope="module")
def alone(service: tinker.ServiceClient, blobs: Path) -> dict[tuple[str, int], Outcome]:
    """Each job alone on the group: a LoRA job and two full jobs, one after another."""
    return {key: train(service, blobs, *key) for key in (("lora", 1), ("full", 2), ("full", 3))}


def workers(cluster: LocalCluster) -> list[dict[str, Any]]:
    with httpx.Client(base_url=cluster.config.gateway_url, headers={"X-API-Key": KEY}) as http:
        answer = http.get("/plexrl/v1/workers")
        answer.raise_for_status()
        listed: list[dict[str, Any]] = answer.json()
    return listed


def test_a_two_rank_group_trains_lora_and_full_jobs_bigger_than_a_rank(
    cluster: LocalCluster, alone: dict[tuple[str, int], Outcome], full_state_bytes: int
) -> None:
    per_rank = int(PER_RANK * full_state_bytes)
    assert full_state_bytes > per_rank  # one rank cannot hold a full job; two can
    for key, out in alone.items():
        assert out.steps == list(range(1, STEPS + 1)), key
        assert out.losses[-1] < out.losses[0], (key, out.losses)
        assert out.checkpoint, key
    (group,) = workers(cluster)
    assert group["devices"] == 2 and [r["rank"] for r in group["ranks"]] == [0, 1]
    assert group["device_bytes"] == 2 * per_rank
    for rank in group["ranks"]:
        # Every rank holds its share of what is on the device, within its own memory.
        assert rank["device_bytes"] == per_rank and rank["device_used"] <= per_rank
    used = [r["device_used"] for r in group["ranks"]]
    # Equal shares on both ranks (none at all if the heartbeat came while every job was
    # off the device).
    assert used[0] == used[1]


def test_two_jobs_multiplexed_on_the_group_match_each_alone(
    cluster: LocalCluster,
    service: tinker.ServiceClient,
    blobs: Path,
    alone: dict[tuple[str, int], Outcome],
) -> None:
    together: dict[int, Outcome] = {}

    def one(seed: int) -> None:
        together[seed] = train(service, blobs, "full", seed)

    threads = [threading.Thread(target=one, args=(seed,)) for seed in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in (2, 3):
        assert together[seed].losses == alone[("full", seed)].losses
        assert together[seed].checkpoint == alone[("full", seed)].checkpoint
    # The two did not fit the device tier at once: their shards went to host and back.
    with httpx.Client(base_url=cluster.config.gateway_url, headers={"X-API-Key": KEY}) as http:
        entries = http.get("/plexrl/v1/timeline", params={"limit": 10000}).json()
    ids = {together[s].model_id for s in (2, 3)}
    assert any(e["job_id"] in ids and e["swap_s"] > 0 for e in entries)


def _busy(pid: int) -> float:
    """CPU seconds the process has used (a rank waiting for its next call uses none)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_killing_a_non_leading_rank_mid_forward_backward_loses_nothing(
    cluster: LocalCluster,
    service: tinker.ServiceClient,
    blobs: Path,
    alone: dict[tuple[str, int], Outcome],
) -> None:
    health = f"http://127.0.0.1:{cluster.config.worker_port(0)}/healthz"
    leader, follower = httpx.get(health).json()["rank_pids"]
    killed: list[float] = []
    lost: list[int] = []

    def kill_mid_call(step: int) -> None:
        if step != 1:
            return
        # The follower computes only while a call runs: kill it once it starts to.
        start, deadline = _busy(follower), time.monotonic() + 30
        while _busy(follower) - start < 0.1 and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(follower, 9)
        killed.append(time.monotonic())
        # The leader notices, stops (its heartbeats too), and is restarted as a
        # supervisor would, with the same id; the job goes on from its snapshot.
        lost.append(cluster.wait_exit("worker-0", timeout_s=60))
        cluster.restart("worker-0")

    got = train(service, blobs, "full", 2, during=kill_mid_call)
    assert killed, "the follower was never seen computing"
    assert lost == [3]  # the worker stopped on its own: it lost a rank of its group
    assert cluster.exit_code("worker-0") is None  # the restarted one runs
    assert got.steps == list(range(1, STEPS + 1))  # nothing lost, nothing applied twice
    assert got.losses == alone[("full", 2)].losses
    assert got.checkpoint == alone[("full", 2)].checkpoint
    with pytest.raises(ProcessLookupError):
        os.kill(leader, 0)  # the old leader is gone, not left running beside the new one


def test_one_rank_workers_refuse_a_job_bigger_than_a_rank_and_restore_a_two_rank_job(
    cluster: LocalCluster,
    service: tinker.ServiceClient,
    blobs: Path,
    alone: dict[tuple[str, int], Outcome],
    full_state_bytes: int,
) -> None:
    cluster.kill("worker-0", graceful=True)
    cluster.restart("worker-0", env={"PLEXRL_WORKER_RANKS": "1"})
    deadline = time.monotonic() + 60
    while workers(cluster)[0]["devices"] != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(tinker.BadRequestError) as refused:
        full_client(service)
    message = str(refused.value)
    assert str(full_state_bytes) in message and "1 rank(s)" in message
    assert "PLEXRL_WORKER_RANKS" in message and "PLEXRL_WORKER_DEVICE_BYTES" in message
    # The LoRA job trained on two ranks, restored onto one from its sharded snapshot: the
    # same whole state, so the same checkpoint bytes.
    lora = alone[("lora", 1)]
    lora.client.save_state("on-one-rank").result()
    assert checkpoint_sha256(blobs, TENANT, lora.model_id, "on-one-rank") == lora.checkpoint
