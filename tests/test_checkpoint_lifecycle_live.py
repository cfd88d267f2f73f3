"""A checkpoint's lifecycle on a live cluster, through the unmodified tinker SDK.

The four services as processes on the real Kafka and Redis, one worker, the tiny Qwen3
with LoRA jobs and two tenants' keys; TTLs may be as short as a second and the
state-store sweeps every second, so an expiry is seen through to the disk.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import tinker
from tinker import types

from plexrl_tools.cluster import LocalCluster
from plexrl_worker.runner import key_part

pytestmark = pytest.mark.integration

OWNER_KEY, OTHER_KEY = "tml-owner", "tml-other"
BASE = "plexrl/tiny-qwen3"
START_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def cluster(shared_services: LocalCluster) -> LocalCluster:
    return shared_services


@pytest.fixture(scope="module")
def owner(cluster: LocalCluster) -> tinker.ServiceClient:
    os.environ["HF_HUB_OFFLINE"] = "1"
    return tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=OWNER_KEY)


@pytest.fixture(scope="module")
def other(cluster: LocalCluster) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=OTHER_KEY)


@pytest.fixture(scope="module")
def trained(owner: tinker.ServiceClient) -> tinker.TrainingClient:
    client = owner.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    tokens = [3, 5, 7, 9, 11, 13]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32"),
        },
    )
    client.forward_backward([datum], "cross_entropy").result(timeout=120)
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    return client


def sample(future: Any) -> list[int]:
    """One seeded sample from the sampling client a future hands back."""
    client: tinker.SamplingClient = future.result(timeout=120)
    prompt = types.ModelInput.from_ints([3, 5, 7])
    params = types.SamplingParams(max_tokens=3, seed=1)
    answer = client.sample(prompt, num_samples=1, sampling_params=params).result(timeout=120)
    return list(answer.sequences[0].tokens)


class _Ready:
    """A sampling client already in hand, as the future `sample` takes."""

    def __init__(self, client: tinker.SamplingClient) -> None:
        self._client = client

    def result(self, timeout: float) -> tinker.SamplingClient:
        return self._client


def wait_for(what: str, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.2)


def on_disk(cluster: LocalCluster, model_id: str, name: str) -> list[Path]:
    """The blob and record copy of the owner's weights checkpoint `name`."""
    root = cluster.config.state_dir / "blobs"
    where = Path("ckpt") / "owner" / key_part(model_id) / "weights"
    return list((root / where).glob(f"{name}@*")) + list(
        (root / "#records" / where).glob(f"{name}@*")
    )


def test_a_published_checkpoint_is_loaded_and_sampled_by_another_tenant_until_unpublished(
    cluster: LocalCluster,
    owner: tinker.ServiceClient,
    other: tinker.ServiceClient,
    trained: tinker.TrainingClient,
) -> None:
    state = trained.save_state("shared").result(timeout=120).path
    weights = trained.save_weights_for_sampler("shared-s").result(timeout=120).path
    url = cluster.config.gateway_url
    mine = tinker.RestClient(base_url=url, api_key=OWNER_KEY)
    theirs = tinker.RestClient(base_url=url, api_key=OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        theirs.get_weights_info_by_tinker_path(state).result(timeout=60)

    mine.publish_checkpoint_from_tinker_path(state).result(timeout=60)
    mine.publish_checkpoint_from_tinker_path(weights).result(timeout=60)
    listed = {
        c.tinker_path: c for c in mine.list_checkpoints(trained.model_id).result().checkpoints
    }
    assert listed[state].public and listed[weights].public
    assert (listed[state].size_bytes or 0) > 0

    assert theirs.get_weights_info_by_tinker_path(state).result(timeout=60).lora_rank == 4
    expected = sample(trained.create_sampling_client(weights))
    loaded = other.create_training_client_from_state(state).result(timeout=120)
    assert sample(loaded.save_weights_and_get_sampling_client()) == expected
    sampler = other.create_sampling_client(model_path=weights).result(timeout=120)
    assert sample(_Ready(sampler)) == expected
    for change in (
        lambda: theirs.unpublish_checkpoint_from_tinker_path(weights).result(timeout=60),
        lambda: theirs.delete_checkpoint_from_tinker_path(state).result(timeout=60),
        lambda: theirs.set_checkpoint_ttl_from_tinker_path(state, 60).result(timeout=60),
    ):
        with pytest.raises(tinker.PermissionDeniedError, match="only its owner"):
            change()

    mine.unpublish_checkpoint_from_tinker_path(weights).result(timeout=60)
    with pytest.raises(tinker.NotFoundError):
        theirs.get_weights_info_by_tinker_path(weights).result(timeout=60)
    with pytest.raises(Exception, match=r"unpublished|no checkpoint"):
        sample(_Ready(sampler))
    with pytest.raises(Exception, match="no checkpoint"):
        sample(other.create_sampling_client(model_path=weights))
    assert sample(trained.create_sampling_client(weights))  # its owner still samples


def test_a_ttl_set_through_the_sdk_expires_the_checkpoint_for_good(
    cluster: LocalCluster,
    owner: tinker.ServiceClient,
    trained: tinker.TrainingClient,
    infra: dict[str, str],
) -> None:
    rest = tinker.RestClient(base_url=cluster.config.gateway_url, api_key=OWNER_KEY)
    kept = trained.save_state("kept").result(timeout=120).path

    def listed() -> dict[str, types.Checkpoint]:
        answer = rest.list_checkpoints(trained.model_id).result(timeout=60)
        return {c.tinker_path: c for c in answer.checkpoints}

    rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result(timeout=60)
    expires = listed()[kept].expires_at
    assert expires is not None and 3500 < expires.timestamp() - time.time() <= 3600
    rest.set_checkpoint_ttl_from_tinker_path(kept, 7200).result(timeout=60)
    renewed = listed()[kept].expires_at
    assert renewed is not None and renewed > expires
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result(timeout=60)
    assert listed()[kept].expires_at is None

    short = trained.save_state("short", ttl_seconds=2).result(timeout=120).path
    assert listed()[short].expires_at is not None
    assert len(on_disk(cluster, trained.model_id, "short")) == 2  # blob and record copy
    wait_for("the expired checkpoint to leave the listing", lambda: short not in listed())
    with pytest.raises(Exception, match="no checkpoint"):
        owner.create_training_client_from_state(short).result(timeout=60)
    wait_for("the sweep to delete it", lambda: not on_disk(cluster, trained.model_id, "short"))

    cluster.kill("state-store")
    cluster.restart("state-store", START_TIMEOUT_S)
    time.sleep(1.5)  # a rebuild round and a sweep after the restart
    meta = redis.Redis.from_url(infra["redis"])
    try:
        assert not meta.exists(f"{cluster.config.cluster_id}:ckpt:{short}")
    finally:
        meta.close()
    assert short not in listed() and kept in listed()
    assert not on_disk(cluster, trained.model_id, "short")
