"""The sequencer publishes a model's calls in seq_id order, whatever order they arrive in."""

from __future__ import annotations

import asyncio

import pytest

from plexrl_gateway.sequencer import SequenceGapError, Sequencer


class MemoryCursors:
    def __init__(self) -> None:
        self.next: dict[str, int] = {}

    async def get_next_seq(self, job_id: str) -> int | None:
        return self.next.get(job_id)

    async def set_next_seq(self, job_id: str, next_seq: int) -> None:
        self.next[job_id] = next_seq


async def _publish(
    seq: Sequencer, job: str, seq_id: int | None, log: list[object], delay: float = 0
) -> None:
    await asyncio.sleep(delay)
    async with seq.turn(job, seq_id):
        log.append(seq_id)


async def test_out_of_order_chunks_are_published_lowest_first() -> None:
    cursors = MemoryCursors()
    seq = Sequencer(cursors, gap_timeout_s=5)
    published: list[object] = []
    await _publish(seq, "m", 0, published)  # create
    # The SDK sends chunks 2..4 together and chunk 1 last.
    await asyncio.gather(
        _publish(seq, "m", 3, published),
        _publish(seq, "m", 4, published),
        _publish(seq, "m", 2, published),
        _publish(seq, "m", 1, published, delay=0.05),
    )
    assert published == [0, 1, 2, 3, 4]
    assert cursors.next["m"] == 5


async def test_models_do_not_wait_for_each_other() -> None:
    seq = Sequencer(MemoryCursors(), gap_timeout_s=5)
    published: list[object] = []
    await _publish(seq, "a", 0, published)
    waiting = asyncio.create_task(_publish(seq, "a", 2, published))
    await _publish(seq, "b", 0, published)
    await _publish(seq, "b", 1, published)
    assert published == [0, 0, 1]
    await _publish(seq, "a", 1, published)
    await waiting
    assert published == [0, 0, 1, 1, 2]


async def test_a_duplicate_or_late_seq_goes_at_once_without_moving_the_cursor() -> None:
    cursors = MemoryCursors()
    seq = Sequencer(cursors, gap_timeout_s=5)
    published: list[object] = []
    for i in range(3):
        await _publish(seq, "m", i, published)
    await asyncio.wait_for(_publish(seq, "m", 1, published), 1)
    assert published == [0, 1, 2, 1]
    assert cursors.next["m"] == 3


async def test_two_sends_of_the_same_waiting_seq_both_pass_in_turn() -> None:
    seq = Sequencer(MemoryCursors(), gap_timeout_s=5)
    published: list[object] = []
    await _publish(seq, "m", 0, published)
    retries = [asyncio.create_task(_publish(seq, "m", 2, published)) for _ in range(2)]
    await asyncio.sleep(0.02)
    assert published == [0]
    await _publish(seq, "m", 1, published)
    await asyncio.gather(*retries)
    assert published == [0, 1, 2, 2]


async def test_a_gap_that_never_fills_fails_the_waiting_call() -> None:
    cursors = MemoryCursors()
    seq = Sequencer(cursors, gap_timeout_s=0.05)
    published: list[object] = []
    await _publish(seq, "m", 0, published)
    with pytest.raises(SequenceGapError, match=r"seq_id 3 waited 0\.05s for seq_id 1"):
        await _publish(seq, "m", 3, published)
    assert published == [0] and cursors.next["m"] == 1
    # The model goes on once the missing call arrives.
    await _publish(seq, "m", 1, published)
    assert published == [0, 1]


async def test_a_failed_publish_does_not_move_the_cursor() -> None:
    cursors = MemoryCursors()
    seq = Sequencer(cursors, gap_timeout_s=5)
    await _publish(seq, "m", 0, [])
    with pytest.raises(ConnectionError):
        async with seq.turn("m", 1):
            raise ConnectionError("broker down")
    assert cursors.next["m"] == 1
    published: list[object] = []
    await asyncio.wait_for(_publish(seq, "m", 1, published), 1)
    assert published == [1]


async def test_an_append_goes_after_what_was_published_and_keeps_the_cursor() -> None:
    cursors = MemoryCursors()
    seq = Sequencer(cursors, gap_timeout_s=5)
    published: list[object] = []
    await _publish(seq, "m", 0, published)
    await _publish(seq, "m", None, published)
    assert published == [0, None] and cursors.next["m"] == 1


async def test_a_restarted_gateway_resumes_from_the_stored_cursor() -> None:
    cursors = MemoryCursors()
    cursors.next["m"] = 7
    seq = Sequencer(cursors, gap_timeout_s=5)
    published: list[object] = []
    waiting = asyncio.create_task(_publish(seq, "m", 8, published))
    await asyncio.sleep(0.02)
    assert published == []
    await _publish(seq, "m", 7, published)
    await waiting
    assert published == [7, 8]


def test_a_non_positive_timeout_is_refused_with_the_setting_to_change() -> None:
    with pytest.raises(ValueError, match="PLEXRL_SEQUENCE_GAP_TIMEOUT_S"):
        Sequencer(MemoryCursors(), gap_timeout_s=0)


async def test_a_settled_refusal_uses_up_its_seq_id() -> None:
    """The SDK numbers the next call after one the gateway refused with a 4xx."""
    cursors = MemoryCursors()
    seq = Sequencer(cursors, gap_timeout_s=5)
    await _publish(seq, "m", 0, [])
    with pytest.raises(ValueError, match="bad loss"):
        async with seq.turn("m", 1) as turn:
            turn.settle()
            raise ValueError("bad loss")
    published: list[object] = []
    await asyncio.wait_for(_publish(seq, "m", 2, published), 1)
    assert published == [2] and cursors.next["m"] == 3


async def test_a_release_uses_up_a_seq_id_in_turn_and_gives_up_on_a_gap() -> None:
    """A call refused before its turn (an unserved route) still uses up its seq_id,
    after the lower ones; a release whose lower seq_ids never come moves nothing."""
    cursors = MemoryCursors()
    seq = Sequencer(cursors, gap_timeout_s=5)
    await _publish(seq, "m", 0, [])
    published: list[object] = []
    late = asyncio.create_task(_publish(seq, "m", 1, published, delay=0.1))
    assert await seq.release("m", 2, wait_s=2)  # waits for 1, then uses 2 up
    await late
    assert published == [1] and cursors.next["m"] == 3
    assert await seq.release("m", 1, wait_s=0.1)  # already used up: nothing moves
    assert cursors.next["m"] == 3
    assert not await seq.release("m", 5, wait_s=0.1)  # 3 and 4 never came
    assert cursors.next["m"] == 3
    await asyncio.wait_for(_publish(seq, "m", 3, published), 1)
    assert published == [1, 3]
