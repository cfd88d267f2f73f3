"""Late writers, outages and hostile names against a live cluster, through the tinker SDK.

Two workers (a worker silent for 3 s is declared lost), the four services as processes
on the real Kafka and Redis, the tiny Qwen3 with LoRA jobs:

- a job's home is SIGSTOPped inside `save_state`, past its heartbeat timeout; the save
  completes on the new home; the client deletes the checkpoint; the old worker is
  continued — and the checkpoint stays deleted, record, copy and blob;
- a checkpoint deleted while the state-store is down stays deleted after it restarts;
- a name that could address another object is refused at once and changes nothing;
- a save that meets a full disk fails at once with a message that says so, and the
  worker goes on serving other jobs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import tinker
from tinker import types

from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_worker.runner import key_part

pytestmark = pytest.mark.integration

KEY, TENANT = "tml-late", "late"
BASE = "plexrl/tiny-qwen3"
TIMEOUT_S = 3
START_TIMEOUT_S = 600.0
DISK_BYTES = 256 << 20


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, bool]]:
    """The cluster's state directory; its blob directory on a tmpfs of its own where this
    machine allows (so a test can fill it for real), else a plain directory."""
    state = tmp_path_factory.mktemp("late-writers")
    blobs = state / "blobs"
    blobs.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(blobs)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield state, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(blobs)], check=False)


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str], tiny_registry: Path, disk: tuple[Path, bool]
) -> Iterator[LocalCluster]:
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        disk[0],
        "lw",
        workers=2,
        api_keys=f"{KEY}={TENANT}",
        worker_threads=1,
        env={"PLEXRL_WORKER_TIMEOUT_S": str(TIMEOUT_S)},
    )
    running = LocalCluster(config)
    running.start(timeout_s=START_TIMEOUT_S)
    try:
        yield running
    finally:
        for name in running.names():  # a test failing half way may leave one stopped
            with contextlib.suppress(ProcessLookupError, RuntimeError):
                os.kill(running.pid(name), signal.SIGCONT)
        running.stop()


@pytest.fixture(scope="module")
def service(cluster: LocalCluster) -> tinker.ServiceClient:
    os.environ["HF_HUB_OFFLINE"] = "1"
    return tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)


@pytest.fixture(scope="module")
def meta(cluster: LocalCluster, infra: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(infra["redis"])
    yield client
    client.close()


def key(cluster: LocalCluster, *parts: str) -> str:
    return ":".join((cluster.config.cluster_id, *parts))


def trained(service: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
    step(client)
    return client


def step(client: tinker.TrainingClient) -> float:
    """One training step; returns its seconds."""
    tokens = [3, 5, 7, 9, 11, 13]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32"),
        },
    )
    start = time.monotonic()
    client.forward_backward([datum], "cross_entropy").result(timeout=120)
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    return time.monotonic() - start


def blobs_of(cluster: LocalCluster, model_id: str, name: str) -> list[Path]:
    """The blobs and record copies of a job's checkpoint `name` on disk."""
    root = cluster.config.state_dir / "blobs"
    job = key_part(model_id)
    found = list((root / "ckpt" / TENANT / job / "weights").glob(f"{name}@*"))
    found += list((root / "#records" / "ckpt" / TENANT / job / "weights").glob(f"{name}@*"))
    return found


def listed(service: tinker.ServiceClient, model_id: str) -> set[str]:
    rest = service.create_rest_client()
    answer = rest.list_checkpoints(model_id).result(timeout=60)
    return {c.checkpoint_id for c in answer.checkpoints}


def wait_for(what: str, done: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.2)


def test_a_hung_workers_late_save_does_not_bring_back_a_deleted_checkpoint(
    cluster: LocalCluster, service: tinker.ServiceClient, meta: redis.Redis
) -> None:
    client = trained(service, seed=1)
    model_id = client.model_id
    home = meta.get(key(cluster, "home", model_id))
    assert isinstance(home, bytes)
    victim = cluster.pid(home.decode())
    book = key(cluster, "ledger", model_id, "blobs")
    path = f"tinker://{model_id}/weights/ck"

    future = client.save_state("ck")
    # Stopped as soon as its save reaches the state-store: the blob named in the job's
    # book (being written) or its record written, before the call is committed.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        names = [k.decode() if isinstance(k, bytes) else k for k in meta.hkeys(book)]
        writing = any(n.startswith("ckpt/") for n in names)
        if writing or meta.exists(key(cluster, "ckpt", path)):
            break
        time.sleep(0.0005)
    os.kill(victim, signal.SIGSTOP)
    try:
        # The job is re-homed after the heartbeat timeout and the save runs there.
        saved = future.result(timeout=120).path
        assert saved == path
        # The new home's record (its copy beside the blobs); the stopped worker's blob
        # may be there too, written before its lease went, never recorded.
        assert len([p for p in blobs_of(cluster, model_id, "ck") if p.suffix == ".json"]) == 1
        rest = service.create_rest_client()
        rest.delete_checkpoint_from_tinker_path(path).result(timeout=60)
        assert "weights/ck" not in listed(service, model_id)
    finally:
        os.kill(victim, signal.SIGCONT)
    # The old worker finishes what it was doing under its old lease: all refused.
    time.sleep(3 * TIMEOUT_S)
    assert "weights/ck" not in listed(service, model_id)
    assert not meta.exists(key(cluster, "ckpt", path))
    assert blobs_of(cluster, model_id, "ck") == []
    with pytest.raises(Exception, match=r"(?i)checkpoint|not found"):
        client.load_state(path).result(timeout=60)
    step(client)  # the job goes on on its new home


def test_a_checkpoint_deleted_while_the_state_store_is_down_stays_deleted(
    cluster: LocalCluster, service: tinker.ServiceClient, meta: redis.Redis
) -> None:
    client = trained(service, seed=2)
    model_id = client.model_id
    gone = client.save_state("gone").result(timeout=120).path
    kept = client.save_state("kept").result(timeout=120).path
    rest = service.create_rest_client()
    cluster.kill("state-store")
    try:
        rest.delete_checkpoint_from_tinker_path(gone).result(timeout=60)
        assert listed(service, model_id) == {"weights/kept"}
    finally:
        cluster.restart("state-store", START_TIMEOUT_S)
    # Its first round finishes the delete (the tombstone goes once the blob is gone).
    wait_for("the tombstone buried", lambda: not meta.hlen(key(cluster, "ckpt-deleted")))
    time.sleep(2.0)  # and a later round would have restored a record it missed
    assert listed(service, model_id) == {"weights/kept"}
    assert blobs_of(cluster, model_id, "gone") == []
    assert len(blobs_of(cluster, model_id, "kept")) == 2  # the blob and its record's copy
    with pytest.raises(Exception, match=r"(?i)checkpoint|not found"):
        client.load_state(gone).result(timeout=60)
    client.load_state(kept).result(timeout=120)


@pytest.mark.parametrize("name", ["ck#x", "ck?x", "a b", ".", "..", "../x", "ck%2Fx"])
def test_a_name_that_could_address_another_object_is_refused_and_changes_nothing(
    name: str, cluster: LocalCluster, service: tinker.ServiceClient
) -> None:
    client = trained(service, seed=3)
    client.save_state("ck").result(timeout=120)
    assert len(blobs_of(cluster, client.model_id, "ck")) == 2
    before = sorted((p.name, p.read_bytes()) for p in blobs_of(cluster, client.model_id, "ck"))
    start = time.monotonic()
    with pytest.raises(Exception, match="not allowed"):
        client.save_state(name).result(timeout=60)
    assert time.monotonic() - start < 10.0  # refused at the door, no worker held
    after = sorted((p.name, p.read_bytes()) for p in blobs_of(cluster, client.model_id, "ck"))
    assert after == before
    assert listed(service, client.model_id) == {"weights/ck"}


def test_a_save_on_a_full_disk_fails_at_once_and_frees_the_worker(
    cluster: LocalCluster, service: tinker.ServiceClient, disk: tuple[Path, bool]
) -> None:
    if not disk[1]:
        pytest.skip("needs root to mount a tmpfs to fill")
    saver, other = trained(service, seed=4), trained(service, seed=5)
    alone = min(step(other) for _ in range(3))
    blobs = cluster.config.state_dir / "blobs"
    filler = blobs / "filler"
    free = os.statvfs(blobs).f_bavail * os.statvfs(blobs).f_frsize
    with filler.open("wb") as f:  # leave less than any checkpoint needs
        os.posix_fallocate(f.fileno(), 0, max(1, free - 4096))
    try:
        start = time.monotonic()
        with pytest.raises(Exception, match="disk is full"):
            saver.save_state("full").result(timeout=120)
        failed_in = time.monotonic() - start
        beside = step(other)
    finally:
        filler.unlink()
    assert failed_in < 15.0, f"the full disk held the call {failed_in:.1f} s"
    assert beside < alone + 15.0
    assert "weights/full" not in listed(service, saver.model_id)
    assert blobs_of(cluster, saver.model_id, "full") == []
    saver.save_state("full").result(timeout=120)  # room again: it saves
