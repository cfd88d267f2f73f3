"""The exactly-once rule (pure) and the job ledger against the real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from plexrl.ledger import Committed, Ledger, Verdict, blob_unreferenced, verdict
from plexrl.messages import (
    CompletionStatus,
    Function,
    NoopInput,
    OptimStepInput,
    PhaseCompletion,
    PhaseRequest,
    Timings,
)
from plexrl.messages.requests import AdamParams


def test_only_the_next_call_applies() -> None:
    assert verdict(1, 0) == Verdict.APPLY
    assert verdict(11, 10) == Verdict.APPLY


def test_an_older_call_is_answered_never_rerun() -> None:
    assert verdict(10, 10) == Verdict.ANSWERED
    assert verdict(1, 10) == Verdict.ANSWERED


def test_a_call_past_a_gap_waits() -> None:
    assert verdict(12, 10) == Verdict.AHEAD
    assert verdict(2, 0) == Verdict.AHEAD


def test_the_rule_refuses_impossible_numbers() -> None:
    with pytest.raises(ValueError, match="count from 1"):
        verdict(0, 0)
    with pytest.raises(ValueError, match="negative"):
        verdict(1, -1)


def request(rid: str, fn: Function = Function.OPTIM_STEP) -> PhaseRequest:
    payload = OptimStepInput(AdamParams()) if fn == Function.OPTIM_STEP else NoopInput()
    return PhaseRequest(
        request_id=rid, job_id="j", tenant="t", function=fn, payload=payload, arrival_time=1.0
    )


def completion(rid: str) -> PhaseCompletion:
    return PhaseCompletion(
        request_id=rid,
        job_id="j",
        tenant="t",
        worker_id="w",
        function=Function.OPTIM_STEP,
        status=CompletionStatus.OK,
        timings=Timings(),
    )


@pytest.fixture()
async def ledger(infra: dict[str, str], cluster_id: str) -> AsyncIterator[Ledger]:
    client = aioredis.Redis.from_url(infra["redis"])
    yield Ledger(client, cluster_id)
    keys = [k async for k in client.scan_iter(match=f"{cluster_id}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.mark.integration
async def test_a_replayed_request_keeps_its_number(ledger: Ledger) -> None:
    assert await ledger.assign("j", ["a", "b"]) == [1, 2]
    assert await ledger.assign("j", ["b", "c"]) == [2, 3]
    assert await ledger.assign("other", ["c"]) == [1]


@pytest.mark.integration
async def test_commits_go_in_order_under_the_current_epoch_only(ledger: Ledger) -> None:
    epoch = await ledger.bump_epoch("j", "w0")
    assert await ledger.commit("j", epoch, 2, completion("b"), None) == Committed.OUT_OF_ORDER
    assert await ledger.commit("j", epoch, 1, completion("a"), request("a")) == Committed.OK
    newer = await ledger.bump_epoch("j", "w1")  # re-homed: w0 is fenced off
    assert await ledger.commit("j", epoch, 2, completion("b"), None) == Committed.FENCED
    assert await ledger.commit("j", newer, 2, completion("b"), None) == Committed.OK
    head = await ledger.head("j")
    assert (head.applied, head.epoch, head.owner) == (2, newer, "w1")
    stored = await ledger.result("j", 1)
    assert stored is not None and stored.request_id == "a"
    head, both = await ledger.head_and_result("j", 2)  # one read of one server
    assert head.applied == 2 and both is not None and both.request_id == "b"
    assert (await ledger.head_and_result("j", 3))[1] is None


@pytest.mark.integration
async def test_a_snapshot_trims_the_log_it_covers(ledger: Ledger) -> None:
    epoch = await ledger.bump_epoch("j", "w0")
    for seq in (1, 2, 3):
        rid = f"r{seq}"
        assert await ledger.commit("j", epoch, seq, completion(rid), request(rid)) == Committed.OK
    point = await ledger.recovery_point("j")
    assert [r.request_id for r in point.log] == ["r1", "r2", "r3"]
    assert await ledger.record_snapshot("j", epoch, 2, "blob-2") == ""
    # An older snapshot finishing late is not taken: its own blob is handed back.
    assert await ledger.record_snapshot("j", epoch, 1, "blob-1") == "blob-1"
    point = await ledger.recovery_point("j")
    assert (point.state.snap_seq, point.state.snap_blob) == (2, "blob-2")
    assert [r.request_id for r in point.log] == ["r3"]
    assert await ledger.record_snapshot("j", epoch, 3, "blob-3") == "blob-2"
    await ledger.close("j")
    # An upload in flight when the job ended is refused, and marked to delete.
    assert await ledger.record_snapshot("j", epoch, 4, "blob-4") == "blob-4"
    assert sorted(await ledger.unreferenced("j")) == ["blob-1", "blob-2", "blob-3", "blob-4"]
    point = await ledger.recovery_point("j")
    assert point.log == [] and point.state.applied == 3  # results outlive the job's state


@pytest.mark.integration
async def test_archived_results_leave_redis_and_are_found_by_seq(ledger: Ledger) -> None:
    epoch = await ledger.bump_epoch("j", "w0")
    for seq in range(1, 6):
        assert await ledger.commit("j", epoch, seq, completion(f"r{seq}"), None) == Committed.OK
    lo, results = await ledger.archive_range("j", 3)
    assert lo == 1 and sorted(results) == [1, 2, 3]
    assert not await ledger.record_archive("j", epoch - 1, 1, 3, "stale")  # fenced
    assert await ledger.record_archive("j", epoch, 1, 3, "arch-1-3")
    assert not await ledger.record_archive("j", epoch, 1, 3, "again")  # got there first
    assert [await ledger.result("j", s) for s in (1, 2, 3)] == [None, None, None]
    kept = await ledger.result("j", 4)
    assert kept is not None and kept.request_id == "r4"
    assert [await ledger.archive_of("j", s) for s in (1, 3, 4)] == ["arch-1-3", "arch-1-3", None]
    assert await ledger.archive_range("j", 5, at_least=3) == (4, {})  # two: not yet
    lo, results = await ledger.archive_range("j", 5, at_least=2)
    assert lo == 4 and sorted(results) == [4, 5]
    assert await ledger.record_archive("j", epoch, 4, 5, "arch-4-5")
    assert await ledger.archive_of("j", 4) == "arch-4-5"
    assert await ledger.archive_range("j", 5) == (6, {})


def test_a_blob_is_deleted_once_marked_or_left_by_an_earlier_epoch() -> None:
    assert blob_unreferenced("d", 1)
    assert blob_unreferenced("w1", 2)  # its writer was fenced or killed
    assert not blob_unreferenced("w2", 2)  # may be being written now
    assert not blob_unreferenced("junk", 9)


@pytest.mark.integration
async def test_the_blob_book_names_what_a_killed_or_fenced_writer_left(ledger: Ledger) -> None:
    first = await ledger.bump_epoch("j", "w0")
    await ledger.writing("j", first, "snap-killed")  # w0 dies before recording it
    await ledger.writing("j", first, "arch-killed")
    assert await ledger.unreferenced("j") == {}  # w0 may still be writing them
    second = await ledger.bump_epoch("j", "w1")  # re-homed
    await ledger.writing("j", second, "snap-new")
    assert await ledger.record_snapshot("j", second, 1, "snap-new") == ""
    await ledger.writing("j", second, "arch-new")
    assert await ledger.record_archive("j", second, 1, 0, "arch-new")
    await ledger.writing("j", second, "arch-failed")
    await ledger.abandon("j", "arch-failed")  # its write failed
    found = await ledger.unreferenced("j")
    assert found == {"arch-failed": "d", "arch-killed": f"w{first}", "snap-killed": f"w{first}"}
    # The fenced w0 finishes one of them late: refused, and marked to delete again.
    assert await ledger.record_snapshot("j", first, 1, "snap-killed") == "snap-killed"
    await ledger.deleted("j", found)
    assert await ledger.unreferenced("j") == {"snap-killed": "d"}
    await ledger.deleted("j", {"snap-killed": "d"})
    assert await ledger.unreferenced("j") == {}
