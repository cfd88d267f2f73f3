"""The simulator's clock: a queue of timed events, and what the policy must be asked
about once an event has been handled."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from heapq import heappop, heappush


class Event(IntEnum):
    """What happens at a time; simultaneous events are handled in this order."""

    RUN_DONE = 0
    """A Run's calls ended: the group is free, the job's calls advance."""
    TAIL_DONE = 1
    """A rollout's stragglers finished decoding: the reward / tool stall begins."""
    TRAIN_CALLS = 2
    """The stall ended: the step's training calls arrive."""
    NEXT_STEP = 3
    """The host-side gap ended: the next step's sample arrives."""
    FINISH = 4
    """The job's last step ended: its state is dropped."""
    ARRIVE = 5
    """A job arrives: its create call waits for admission."""
    WAKE = 6
    """A group's decision is due again: a hold for a bursting job ends, or a batch just
    started may be preempted (`plexrl.policy.Decision.wake_at`)."""


class EventQueue:
    """Timed events, popped in (time, kind, insertion) order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._seq = 0
        self._heap: list[tuple[float, Event, int, object]] = []

    def push(self, at: float, kind: Event, obj: object) -> None:
        self._seq = seq = self._seq + 1
        heappush(self._heap, (at, kind, seq, obj))

    def __bool__(self) -> bool:
        return bool(self._heap)

    def peek_time(self) -> float:
        return self._heap[0][0]

    def pop(self) -> tuple[Event, object]:
        """The next event; the clock moves to its time."""
        at, kind, _, obj = heappop(self._heap)
        self.now = at
        return kind, obj

    def until(self, until: float) -> Iterator[tuple[Event, object]]:
        """Every event at or before `until`, in order, including those pushed meanwhile
        (the clock moves to each one's time as it is taken)."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            at, kind, _, obj = heappop(heap)
            self.now = at
            yield kind, obj


@dataclass
class Attention:
    """What changed since the policy was last asked: the groups where something
    happened, and whether a job arrived or left (admission is due)."""

    groups: set[str] = field(default_factory=set)
    admission_due: bool = False
    left_alone: list[str] = field(default_factory=list)
    """Jobs whose last neighbour left their group since (`plexrl.policy.rehome`)."""

    def group(self, group_id: str | None) -> None:
        if group_id is not None:
            self.groups.add(group_id)
