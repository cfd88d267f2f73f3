"""What the live re-homing tests share: their two-worker cluster, a LoRA job's training
step through the SDK, where a job's training ran (the timeline), the scheduler's
re-homes (its log), and a job's run alone with the same seed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import tinker
from tinker import types

from plexrl_tools.cluster import ClusterConfig, LocalCluster

DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
    loss_fn_inputs={
        "target_tokens": types.TensorData(data=[6, 7, 8, 9, 10], dtype="int64"),
        "weights": types.TensorData(data=[1.0] * 5, dtype="float32"),
    },
)


@contextmanager
def two_workers(
    registry: Path, state_dir: Path, id_prefix: str, key: str, env: dict[str, str]
) -> Iterator[LocalCluster]:
    """A cluster of two one-thread workers under `plexrl`, `key` its one API key, with
    the scheduler settings in `env`."""
    config = ClusterConfig.on_free_ports(
        registry,
        state_dir,
        id_prefix,
        workers=2,
        api_keys=f"{key}=t",
        policy="plexrl",
        worker_threads=1,
        env=env,
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    with LocalCluster(config) as running:
        yield running


def create(service: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    return service.create_lora_training_client(
        base_model="plexrl/tiny-qwen3", rank=4, seed=seed
    ).result()


def step(client: tinker.TrainingClient) -> float:
    fb = client.forward_backward([DATUM], "cross_entropy")
    optim = client.optim_step(types.AdamParams(learning_rate=1e-2))
    loss = float(fb.result().metrics["loss:sum"])
    optim.result()
    return loss


def ran_on(cluster: LocalCluster, key: str, job_id: str) -> list[str]:
    """The workers the job's training ran on, in order (the timeline)."""
    entries = httpx.get(
        f"{cluster.config.gateway_url}/plexrl/v1/timeline",
        headers={"X-API-Key": key},
        params={"limit": 10000},
    ).json()
    mine = [e for e in entries if e["job_id"] == job_id and e["function"] == "forward_backward"]
    return [e["worker_id"] for e in sorted(mine, key=lambda e: e["started_at"])]


def scheduler_log(cluster: LocalCluster) -> list[str]:
    return cluster.logs()["scheduler"].read_text(errors="replace").splitlines()


def homes(cluster: LocalCluster) -> dict[str, str]:
    """Where the scheduler admitted each job (its log's "admitted <job> on <worker>")."""
    lines = [line.split("admitted ", 1) for line in scheduler_log(cluster)]
    admitted = [words[1].split() for words in lines if len(words) == 2]
    return {words[0]: words[2] for words in admitted if len(words) == 3 and words[1] == "on"}


def rehomed(cluster: LocalCluster) -> list[str]:
    return [line for line in scheduler_log(cluster) if "re-homed " in line]


def alone(cluster: LocalCluster, key: str, seed: int, steps: int) -> list[float]:
    """The job of `seed` run alone for `steps` steps: its losses."""
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=key)
    client = create(service, seed)
    return [step(client) for _ in range(steps)]


def kept_apart(
    cluster: LocalCluster,
    ids: dict[str, str],
    losses: dict[str, list[float]],
    train: Callable[[str, int], None],
    homes_of: dict[str, str],
) -> None:
    """Train the jobs (by name, on the workers `homes_of` names) a step each in turn
    until each has been reviewed as a newcomer and kept where it is, bounded in steps
    and time; fails unless every one was."""
    kept = [f"reviewed {ids[n]} (newcomer): it stays on {home}" for n, home in homes_of.items()]
    first = next(iter(homes_of))
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and len(losses[first]) < 200:
        if all(any(k in line for line in scheduler_log(cluster)) for k in kept):
            break
        for name in homes_of:
            train(name, 1)
    log = scheduler_log(cluster)
    assert all(any(k in line for line in log) for k in kept), kept
