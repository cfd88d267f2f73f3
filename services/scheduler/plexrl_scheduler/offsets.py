"""Commit a request's offset only once its effect is recorded, so a restart loses nothing."""

from __future__ import annotations

import heapq

from aiokafka import TopicPartition


class OffsetTracker:
    """Per partition: offsets seen but not finished; the commit point is the lowest of them.

    The open offsets are a set with a heap beside it (an entry leaves the heap only once
    it reaches the top), so finishing a call costs O(log n) however many wait."""

    def __init__(self) -> None:
        self._open: dict[TopicPartition, set[int]] = {}
        self._heap: dict[TopicPartition, list[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def seen(self, tp: TopicPartition, offset: int) -> None:
        # The first offset seen is where the group's committed position already is.
        self._committed.setdefault(tp, offset)
        opened = self._open.setdefault(tp, set())
        if offset not in opened:
            opened.add(offset)
            heapq.heappush(self._heap.setdefault(tp, []), offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def finished(self, tp: TopicPartition, offset: int) -> int | None:
        """Mark one offset done; returns a new commit point when it moved, else None."""
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        opened = self._open.setdefault(tp, set())
        opened.discard(offset)
        heap = self._heap.setdefault(tp, [])
        while heap and heap[0] not in opened:
            heapq.heappop(heap)
        point = heap[0] if heap else self._next[tp]
        if point > self._committed.get(tp, -1):
            self._committed[tp] = point
            return point
        return None
