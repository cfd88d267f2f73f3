"""Every registered policy runs the live cluster, and none changes what a job learns.

Three jobs share two workers under each policy; their losses must be bit-identical
from one policy to the next (and so to any placement or interleaving of their calls).
One cluster serves every policy: between runs only the scheduler is restarted with the
next PLEXRL_POLICY (the jobs of earlier runs stay, idle, and take room on the workers).
The same cluster first runs an asynchronous job whose samples roam to the idle worker
while it trains at home, against the same job with roaming off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from plexrl_tools.cluster import ClusterConfig, LocalCluster

pytestmark = pytest.mark.integration

KEY = "tml-policies"


def run_jobs(cluster: LocalCluster, policy: str) -> list[list[float]]:
    config = cluster.config
    if policy != config.policy:  # a new scheduler over the same cluster
        cluster.kill("scheduler", graceful=True)
        cluster.restart("scheduler", env={"PLEXRL_POLICY": policy})
        # Healthy as a standby first: it leads once it holds the lease.
        deadline = time.monotonic() + 30.0
        while True:
            log = cluster.logs()["scheduler"].read_text().splitlines()
            ups = [x for x in log if "scheduler leads (token" in x]
            if (ups and f"policy={policy} " in ups[-1]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert ups and f"policy={policy} " in ups[-1], ups
    service = tinker.ServiceClient(base_url=config.gateway_url, api_key=KEY)
    clients = [
        service.create_lora_training_client(base_model="plexrl/tiny-qwen3", rank=4, seed=i).result()
        for i in range(3)
    ]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[6, 7, 8, 9, 10], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * 5, dtype="float32"),
        },
    )
    if policy == "fifo":
        # A job no worker can ever hold is refused at once (a 400 at create_model) with
        # what to change, not an OOM.
        with pytest.raises(tinker.BadRequestError, match="PLEXRL_WORKER_DEVICE_BYTES"):
            service.create_lora_training_client(base_model="plexrl/tiny-qwen3", rank=64).result()
    losses: list[list[float]] = [[] for _ in clients]
    for _ in range(3):
        calls = [
            (
                c.forward_backward([datum], "cross_entropy"),
                c.optim_step(types.AdamParams(learning_rate=1e-2)),
            )
            for c in clients
        ]
        for i, (fb, optim) in enumerate(calls):
            losses[i].append(fb.result().metrics["loss:sum"])
            optim.result()
    return losses


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str], tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path_factory.mktemp("policies"),
        "pol",
        workers=2,
        api_keys=f"{KEY}=t",
        policy="fifo",
        worker_threads=1,
        # Room for one job state per worker: the worker with two jobs swaps.
        worker_device_bytes=400_000,
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    with LocalCluster(config) as running:
        yield running


def restart_scheduler(cluster: LocalCluster, env: dict[str, str]) -> None:
    cluster.kill("scheduler", graceful=True)
    cluster.restart("scheduler", env=env)


def training_at_home(cluster: LocalCluster, job_id: str) -> None:
    """Wait (a few seconds at most) until the scheduler says the job runs on a worker:
    the SDK sends a job's calls concurrently, so a sample sent after a training call may
    reach the scheduler first; the test's sample is to come while the job trains."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        status = httpx.get(
            f"{cluster.config.gateway_url}/plexrl/v1/cluster", headers={"X-API-Key": KEY}
        ).json()
        if job_id in status["scheduler"].get("inflight", {}).values():
            return
        time.sleep(0.005)


def async_job(cluster: LocalCluster, steps: int = 3) -> tuple[str, list[float], list[object]]:
    """An asynchronous GRPO-like loop on the SDK (staleness 1): rollout k + 1 is sampled
    with the weights saved before step k trains, while step k trains on rollout k; the
    sample is sent once the job's training runs (on enough data to take a while), so
    the job's home is busy when its sample comes."""
    config = cluster.config
    service = tinker.ServiceClient(base_url=config.gateway_url, api_key=KEY)
    client = service.create_lora_training_client(
        base_model="plexrl/tiny-qwen3", rank=4, seed=11
    ).result()
    declared = httpx.post(
        f"{config.gateway_url}/plexrl/v1/jobs/{client.model_id}/options",
        json={"staleness": 1, "steps": steps},
        headers={"X-API-Key": KEY},
    )
    assert declared.status_code == 200, declared.text
    assert declared.json()["steps"] == steps
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])

    def sample(sampler: tinker.SamplingClient, seed: int) -> object:
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
        return sampler.sample(prompt=prompt, num_samples=4, sampling_params=params)

    sampler = client.save_weights_and_get_sampling_client().result()
    pending = sample(sampler, 0)
    losses: list[float] = []
    rollouts: list[object] = []
    for k in range(steps):
        rollout = [list(s.tokens) for s in pending.result().sequences]  # type: ignore[attr-defined]
        rollouts.append(rollout)
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints([5, 6, 7, 8, *seq[:-1]]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=[6, 7, 8, *seq], dtype="int64"),
                    "weights": types.TensorData(data=[1.0] * (3 + len(seq)), dtype="float32"),
                },
            )
            for seq in rollout
            if seq
        ] * 64
        trained = client.forward_backward(data, "cross_entropy")
        stepped = client.optim_step(types.AdamParams(learning_rate=1e-2))
        training_at_home(cluster, str(client.model_id))
        pending = sample(sampler, k + 1)  # the weights before this step: staleness 1
        losses.append(trained.result().metrics["loss:sum"])
        stepped.result()
        sampler = client.save_weights_and_get_sampling_client().result()
    rollouts.append([list(s.tokens) for s in pending.result().sequences])  # type: ignore[attr-defined]
    return str(client.model_id), losses, rollouts


def ran_on(cluster: LocalCluster, job_id: str) -> dict[str, set[str]]:
    """Per function, the workers the job's calls ran on (the timeline)."""
    entries = httpx.get(
        f"{cluster.config.gateway_url}/plexrl/v1/timeline",
        headers={"X-API-Key": KEY},
        params={"limit": 10000},
    ).json()
    out: dict[str, set[str]] = {}
    for e in entries:
        if e["job_id"] == job_id:
            out.setdefault(e["function"], set()).add(e["worker_id"])
    return out


def test_an_asynchronous_jobs_samples_roam_while_it_trains_and_it_learns_as_alone(
    cluster: LocalCluster,
) -> None:
    restart_scheduler(cluster, {"PLEXRL_POLICY": "plexrl", "PLEXRL_ROAM_SAMPLES": "true"})
    job, losses, rollouts = async_job(cluster)
    workers = ran_on(cluster, job)
    home = workers["forward_backward"]
    assert len(home) == 1, workers  # it trains at home
    assert workers["sample"] - home, workers  # and some of its samples ran elsewhere
    restart_scheduler(cluster, {"PLEXRL_POLICY": "plexrl", "PLEXRL_ROAM_SAMPLES": "false"})
    alone, alone_losses, alone_rollouts = async_job(cluster)
    assert ran_on(cluster, alone)["sample"] == ran_on(cluster, alone)["forward_backward"]
    assert (losses, rollouts) == (alone_losses, alone_rollouts)
    restart_scheduler(cluster, {"PLEXRL_POLICY": "fifo", "PLEXRL_ROAM_SAMPLES": "true"})


def test_policies_place_differently_but_never_change_results(cluster: LocalCluster) -> None:
    reference = run_jobs(cluster, "fifo")
    assert all(job[-1] < job[0] for job in reference)  # they learn
    for policy in ("plexrl", "spread-backfill"):
        assert run_jobs(cluster, policy) == reference, policy
