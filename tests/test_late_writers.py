"""Late writers and deletes against the real state-store (its app over real Redis and a
blob directory): a write whose lease is gone leaves nothing; a delete lasts across a
state-store outage and restart; a chosen name addresses only its own object; a full
disk or a refused request is told apart from a transient fault.

The live counterpart, a worker SIGSTOPped inside `save_state` past its heartbeat
timeout through the tinker SDK, is in tests/test_hung_worker.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from gateway_support import free_port

from plexrl.ledger import Ledger
from plexrl.messages import ErrorCode, Function, NoopInput, PhaseRequest
from plexrl.names import BadNameError, check_name
from plexrl.retry import is_transient, retrying
from plexrl.state_store_client import (
    Fence,
    StateStoreClient,
    StateStoreError,
    StateStoreFenced,
    StateStoreFull,
    StateStoreRefused,
    blob_url,
)
from plexrl.stores import CheckpointRecord, FencedWriteError, Stores
from plexrl_state_store.app import build_app
from plexrl_state_store.blobs import BlobDir
from plexrl_state_store.records import CheckpointRecords
from plexrl_worker.runner import _error, checkpoint_blob_key

TENANT, JOB = "alice", "job-1"


@pytest.fixture
def ledger(stores: Stores, cluster_id: str) -> Ledger:
    return Ledger(stores.keys.redis, cluster_id)


def client_over(blobs: BlobDir, stores: Stores) -> StateStoreClient:
    """The worker's own client, talking to the state-store's app in process."""
    client = StateStoreClient("http://store")
    app = build_app(blobs, stores.checkpoints, stores.residency)
    client._http._transport = httpx.ASGITransport(app=app)  # the app, not a socket
    return client


@pytest_asyncio.fixture
async def store(stores: Stores, tmp_path: Path) -> AsyncIterator[StateStoreClient]:
    client = client_over(BlobDir(tmp_path), stores)
    yield client
    await client.close()


def record(blob_key: str, name: str = "ck") -> CheckpointRecord:
    return CheckpointRecord(
        path=f"tinker://{JOB}/weights/{name}",
        tenant=TENANT,
        job_id=JOB,
        kind="weights",
        blob_key=blob_key,
        size_bytes=3,
        created_at=0.0,
        base_model="tiny",
    )


def key_of(epoch: int, name: str = "ck") -> str:
    return checkpoint_blob_key(
        TENANT, JOB, "weights", f"tinker://{JOB}/weights/{name}", Fence(JOB, epoch)
    )


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# A late writer leaves nothing ---------------------------------------------------------


async def test_a_save_under_a_lease_that_is_gone_leaves_no_blob_and_no_record(
    store: StateStoreClient, stores: Stores, ledger: Ledger, tmp_path: Path
) -> None:
    old = await ledger.bump_epoch(JOB, "worker-0")
    new = await ledger.bump_epoch(JOB, "worker-1")  # re-homed: the old lease is gone
    late = key_of(old)
    with pytest.raises(StateStoreFenced, match="no longer stands"):
        await store.put_blob(late, b"old", TENANT, Fence(JOB, old))
    assert files_under(tmp_path) == []
    # The blob got in before the re-home, its record after: the record is refused and
    # the blob deleted with it.
    await stores.keys.redis.hset(f"{stores.keys.key('ledger', JOB)}", "epoch", old)
    await store.put_blob(late, b"old", TENANT, Fence(JOB, old))
    await ledger.bump_epoch(JOB, "worker-1")
    with pytest.raises(StateStoreFenced):
        await store.put_checkpoint(record(late), Fence(JOB, old))
    assert await stores.checkpoints.get_checkpoint(record(late).path) is None
    assert files_under(tmp_path) == []
    # The new home's save under the standing lease is kept.
    current = (await ledger.head(JOB)).epoch
    assert current == new
    kept = key_of(current)
    await store.put_blob(kept, b"new", TENANT, Fence(JOB, current))
    await store.put_checkpoint(record(kept), Fence(JOB, current))
    assert (tmp_path / kept).read_bytes() == b"new"
    assert (await stores.checkpoints.get_checkpoint(record(kept).path)) == record(kept)


async def test_a_blob_written_while_its_lease_went_is_deleted_again(
    store: StateStoreClient, stores: Stores, ledger: Ledger, tmp_path: Path
) -> None:
    epoch = await ledger.bump_epoch(JOB, "worker-0")
    key = key_of(epoch)
    # Named in the job's blob book before the write, out of it once recorded.
    await store.put_blob(key, b"x", TENANT, Fence(JOB, epoch))
    assert (await ledger.unreferenced(JOB)) == {}
    await ledger.bump_epoch(JOB, "worker-1")
    # A writer that never recorded it leaves it to the job's next owner's sweep.
    assert (await ledger.unreferenced(JOB)) == {key: f"w{epoch}"}
    await store.delete_blob(key, TENANT)
    assert files_under(tmp_path) == []


async def test_a_record_takes_its_blob_out_of_the_book_and_a_replaced_one_is_deleted(
    store: StateStoreClient, stores: Stores, ledger: Ledger, tmp_path: Path
) -> None:
    epoch = await ledger.bump_epoch(JOB, "worker-0")
    first, second = key_of(epoch), key_of(epoch)
    assert first != second  # unique per save
    for key, data in ((first, b"one"), (second, b"two")):
        await store.put_blob(key, data, TENANT, Fence(JOB, epoch))
        await store.put_checkpoint(record(key), Fence(JOB, epoch))
    await ledger.bump_epoch(JOB, "worker-1")
    assert await ledger.unreferenced(JOB) == {}  # no sweep can take a recorded blob
    assert files_under(tmp_path) == sorted([second, f"#records/{second}.json"])
    assert (await stores.checkpoints.get_checkpoint(record(second).path)) == record(second)


async def test_a_delete_by_a_worker_whose_lease_is_gone_is_refused(
    store: StateStoreClient, stores: Stores, ledger: Ledger
) -> None:
    epoch = await ledger.bump_epoch(JOB, "worker-0")
    key = key_of(epoch)
    await store.put_blob(key, b"x", TENANT, Fence(JOB, epoch))
    await store.put_checkpoint(record(key), Fence(JOB, epoch))
    await ledger.bump_epoch(JOB, "worker-1")
    with pytest.raises(StateStoreFenced):
        await store.delete_checkpoint(record(key).path, TENANT, Fence(JOB, epoch))
    assert await stores.checkpoints.get_checkpoint(record(key).path) is not None


# Deletes last ---------------------------------------------------------------------------


async def test_a_delete_made_while_the_state_store_was_away_lasts_after_it_restarts(
    stores: Stores, ledger: Ledger, tmp_path: Path
) -> None:
    epoch = await ledger.bump_epoch(JOB, "worker-0")
    key = key_of(epoch)
    blobs = BlobDir(tmp_path)
    client = client_over(blobs, stores)
    await client.put_blob(key, b"x", TENANT, Fence(JOB, epoch))
    await client.put_checkpoint(record(key), Fence(JOB, epoch))
    await client.close()
    # The state-store is away: the gateway removes the record and tombstones the blob.
    await stores.checkpoints.delete_checkpoint(record(key))
    assert await stores.checkpoints.get_checkpoint(record(key).path) is None
    # It comes back (a new process over the same directory): its first round finishes
    # the delete instead of restoring the record from the copy beside the blob.
    restarted = CheckpointRecords(BlobDir(tmp_path), stores.checkpoints)
    assert await restarted.rebuild() == 0
    assert await stores.checkpoints.get_checkpoint(record(key).path) is None
    assert files_under(tmp_path) == []
    assert await stores.checkpoints.tombstones() == {}
    # Its record cannot be written again: the blob is gone.
    client = client_over(blobs, stores)
    with pytest.raises(StateStoreRefused, match="must be stored first"):
        await client.put_checkpoint(record(key), Fence(JOB, epoch))
    await client.close()


async def test_a_tombstoned_blob_is_never_recorded_again(stores: Stores, ledger: Ledger) -> None:
    epoch = await ledger.bump_epoch(JOB, "worker-0")
    key = key_of(epoch)
    await stores.checkpoints.put_checkpoint(record(key), epoch)
    await stores.checkpoints.delete_checkpoint(record(key))
    # A rebuild racing the delete (it read the copy before the tombstone) is refused.
    with pytest.raises(FencedWriteError, match="was deleted"):
        await stores.checkpoints.put_checkpoint(record(key))


async def test_a_record_redis_lost_comes_back_but_a_deleted_one_does_not(
    store: StateStoreClient, stores: Stores, ledger: Ledger, tmp_path: Path
) -> None:
    epoch = await ledger.bump_epoch(JOB, "worker-0")
    lost, deleted = key_of(epoch, "lost"), key_of(epoch, "gone")
    for key, name in ((lost, "lost"), (deleted, "gone")):
        await store.put_blob(key, b"x", TENANT, Fence(JOB, epoch))
        await store.put_checkpoint(record(key, name), Fence(JOB, epoch))
    await store.delete_checkpoint(record(deleted, "gone").path, TENANT)
    # Redis loses the other record (a restart without its append-only file).
    await stores.keys.redis.delete(stores.keys.key("ckpt", record(lost, "lost").path))
    rebuilt = CheckpointRecords(BlobDir(tmp_path), stores.checkpoints)
    assert await rebuilt.rebuild() == 1
    assert await stores.checkpoints.get_checkpoint(record(lost, "lost").path) is not None
    assert await stores.checkpoints.get_checkpoint(record(deleted, "gone").path) is None
    assert not (tmp_path / deleted).exists()


# Names address only themselves ---------------------------------------------------------


@pytest.mark.parametrize("name", ["ck#x", "ck?x", "a b", ".", "..", ".hidden", "a/b", "", "é"])
def test_a_chosen_name_outside_the_alphabet_is_refused_saying_what_is_allowed(name: str) -> None:
    with pytest.raises(BadNameError, match="letters, digits"):
        check_name(name)


def test_allowed_names_pass() -> None:
    for name in ("ck", "step-3", "000010", "final_v2.1", "_x", "a" * 200):
        assert check_name(name) == name
    with pytest.raises(BadNameError):
        check_name("a" * 201)


def test_blob_keys_escape_any_name_into_one_part_of_their_own(tmp_path: Path) -> None:
    blobs = BlobDir(tmp_path)
    keys = set()
    for name in ("ck", "ck#x", "ck_x", "ck=23x", "..", "a/b", "a@e1", "é"):
        key = key_of(1, name)
        blobs.path(key)  # inside the key alphabet: the state-store takes it
        parts = key.split("/")
        assert parts[:4] == ["ckpt", TENANT, JOB, "weights"] and len(parts) == 5
        keys.add(parts[4].rpartition("@")[0])
    assert len(keys) == 8  # no two names share a blob prefix


def test_blob_urls_are_escaped_so_no_key_ends_the_path_early() -> None:
    assert blob_url("ckpt/a/j/weights/ck#x") == "/v1/blobs/ckpt/a/j/weights/ck%23x"
    assert blob_url("a?b c") == "/v1/blobs/a%3Fb%20c"


async def test_a_key_with_a_fragment_reaches_the_store_whole_and_is_refused(
    store: StateStoreClient, tmp_path: Path
) -> None:
    await store.put_blob("ckpt/alice/j/weights/ck", b"mine", TENANT)
    with pytest.raises(StateStoreRefused, match="400"):
        await store.put_blob("ckpt/alice/j/weights/ck#x", b"theirs", TENANT)
    assert (tmp_path / "ckpt/alice/j/weights/ck").read_bytes() == b"mine"


# Errors by cause -----------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB file system of its own (tmpfs), so a write can really fill it."""
    root = tmp_path / "small"
    root.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)])
    if done.returncode != 0:
        pytest.skip("this machine cannot mount a tmpfs")
    try:
        yield root
    finally:
        subprocess.run(["umount", str(root)], check=False)


async def test_a_full_disk_is_answered_as_such_and_leaves_no_temp_file(
    stores: Stores, small_disk: Path
) -> None:
    client = client_over(BlobDir(small_disk), stores)
    try:
        with pytest.raises(StateStoreFull, match="disk is full") as full:
            await client.put_blob("offload/w/j/v1.safetensors", b"x" * (2 << 20))
    finally:
        await client.close()
    assert full.value.status_code == 507 and "PLEXRL_STATE_STORE_DIR" in str(full.value)
    assert not is_transient(full.value)
    assert files_under(small_disk) == []


async def test_a_record_whose_copy_does_not_fit_is_not_recorded_either(
    stores: Stores, ledger: Ledger, small_disk: Path
) -> None:
    epoch = await ledger.bump_epoch(JOB, "worker-0")
    client = client_over(BlobDir(small_disk), stores)
    try:
        key = key_of(epoch)
        stat = os.statvfs(small_disk)
        # The blob takes every page left: the record's copy beside it has no room.
        await client.put_blob(key, b"x" * (stat.f_bavail * stat.f_frsize - 64), TENANT)
        with pytest.raises(StateStoreFull, match="disk is full"):
            await client.put_checkpoint(record(key), Fence(JOB, epoch))
    finally:
        await client.close()
    assert await stores.checkpoints.get_checkpoint(record(key).path) is None
    assert files_under(small_disk) == []


async def test_a_state_store_whose_redis_is_away_answers_retry_not_a_bug(
    tmp_path: Path,
) -> None:
    away = Stores.from_url(f"redis://127.0.0.1:{free_port()}/0", "away", ttl_s=60)
    client = client_over(BlobDir(tmp_path), away)
    try:
        with pytest.raises(StateStoreError) as answered:
            await client.put_blob(key_of(1), b"x", TENANT, Fence(JOB, 1))
    finally:
        await client.close()
        await away.close()
    assert answered.value.status_code == 503 and "Redis is away" in str(answered.value)
    assert is_transient(answered.value)  # the worker waits for it, within its bound
    assert files_under(tmp_path) == []


def test_temp_files_of_writes_that_died_are_swept(tmp_path: Path) -> None:
    blobs = BlobDir(tmp_path)
    (tmp_path / "ckpt" / "a").mkdir(parents=True)
    (tmp_path / "ckpt" / "a" / ".tmp-dead").write_bytes(b"half")
    blobs.write("ckpt/a/j/k", b"whole")
    assert blobs.sweep_temp(3600.0) == 0  # too young: maybe still being written
    assert blobs.sweep_temp(0.0) == 1
    assert files_under(tmp_path) == ["ckpt/a/j/k"]


def test_only_faults_that_may_pass_are_transient() -> None:
    assert is_transient(StateStoreError("away", 503))
    assert is_transient(httpx.ConnectError("refused"))
    for refused in (
        StateStoreRefused("bad key", 400),
        StateStoreFull("full", 507),
        StateStoreFenced("fenced", 409),
        StateStoreError("bug", 500),
    ):
        assert not is_transient(refused)


def test_a_failed_call_answers_by_cause() -> None:
    request = PhaseRequest(
        request_id="r",
        job_id=JOB,
        tenant=TENANT,
        function=Function.SAVE,
        payload=NoopInput(),
        arrival_time=0.0,
    )
    assert _error(request, StateStoreRefused("no", 400)).code == ErrorCode.BAD_REQUEST
    full = _error(request, StateStoreFull("state-store failed: 507 disk full", 507))
    assert full.code == ErrorCode.UNAVAILABLE and "no effect" in full.message
    assert _error(request, StateStoreFenced("gone", 409)).code == ErrorCode.CANCELLED
    assert _error(request, RuntimeError("bug")).code == ErrorCode.INTERNAL


async def test_waiting_on_a_service_that_is_away_is_bounded() -> None:
    attempts = 0

    async def away() -> None:
        nonlocal attempts
        attempts += 1
        raise ConnectionError("away")

    with pytest.raises(ConnectionError):
        await retrying(away, what="a call", within_s=0.3)
    assert 2 <= attempts <= 12


async def test_a_fence_that_names_no_whole_epoch_is_refused(stores: Stores, tmp_path: Path) -> None:
    app = build_app(BlobDir(tmp_path), stores.checkpoints, stores.residency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://store") as http:
        for headers in ({"x-plexrl-job": JOB}, {"x-plexrl-job": JOB, "x-plexrl-epoch": "x"}):
            answer = await http.put(blob_url("offload/w/j/v1"), content=b"x", headers=headers)
            assert answer.status_code == 400 and "whole number" in answer.json()["detail"]
    assert files_under(tmp_path) == []
