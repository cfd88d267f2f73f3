"""Every registered policy runs the live cluster, and none changes what a job learns.

Three jobs share two workers under each policy; their losses must be bit-identical
from one policy to the next (and so to any placement or interleaving of their calls).
One cluster serves every policy: between runs only the scheduler is restarted with the
next PLEXRL_POLICY (the jobs of earlier runs stay, idle, and take room on the workers).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tinker
from tinker import types

from plexrl.cluster import ClusterConfig, LocalCluster

pytestmark = pytest.mark.integration

KEY = "tml-policies"


def run_jobs(cluster: LocalCluster, policy: str) -> list[list[float]]:
    config = cluster.config
    if policy != config.policy:  # a new scheduler over the same cluster
        cluster.kill("scheduler", graceful=True)
        cluster.restart("scheduler", env={"PLEXRL_POLICY": policy})
        ups = [x for x in cluster.logs()["scheduler"].read_text().splitlines() if "up: " in x]
        assert f"policy={policy} " in ups[-1], ups
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
        # A job no worker can ever hold is refused with what to change, not an OOM.
        with pytest.raises(tinker.RequestFailedError, match="PLEXRL_WORKER_DEVICE_BYTES"):
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


def test_policies_place_differently_but_never_change_results(
    infra: dict[str, str], tiny_registry: Path, tmp_path: Path
) -> None:
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path,
        "pol",
        workers=2,
        api_keys=f"{KEY}=t",
        policy="fifo",
        worker_threads=1,
        # Room for one job state per worker: the worker with two jobs swaps.
        worker_device_bytes=400_000,
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    with LocalCluster(config) as cluster:
        reference = run_jobs(cluster, "fifo")
        assert all(job[-1] < job[0] for job in reference)  # they learn
        for policy in ("plexrl", "spread-backfill"):
            assert run_jobs(cluster, policy) == reference, policy
