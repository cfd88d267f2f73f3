"""Commit a request's offset only once its effect is recorded, so a restart loses nothing."""

from __future__ import annotations

from aiokafka import TopicPartition


class OffsetTracker:
    """Per partition: offsets seen but not finished; the commit point is the lowest of them."""

    def __init__(self) -> None:
        self._open: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def seen(self, tp: TopicPartition, offset: int) -> None:
        # The first offset seen is where the group's committed position already is.
        self._committed.setdefault(tp, offset)
        self._open.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def finished(self, tp: TopicPartition, offset: int) -> int | None:
        """Mark one offset done; returns a new commit point when it moved, else None."""
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        opened = self._open.setdefault(tp, set())
        opened.discard(offset)
        point = min(opened) if opened else self._next[tp]
        if point > self._committed.get(tp, -1):
            self._committed[tp] = point
            return point
        return None
