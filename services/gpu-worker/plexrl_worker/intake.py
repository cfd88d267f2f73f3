"""The worker's intake, a poll of its dispatch topic at a time.

Dispatches queue on the worker's topic while it runs one (direct calls arrive one per
dispatch, `plexrl.direct`; the scheduler's follow each other), and the Kafka consumer
fetches them ahead. The intake takes what one poll brought together:

- before the first of them runs, the completions already recorded for any of their
  calls (a replay is answered, not run again) are read in one round trip for all of
  them, instead of one per dispatch;
- after the last, their completions are awaited together: each dispatch queues its
  completions on the producer and goes on to the next, and the poll's offsets are
  committed only once every completion of it is acknowledged (`settle`), as before.

The hooks are the consumer's `before_batch` / `after_batch`; the dispatch handler
asks `recorded` instead of the recorder, and leaves settling to the intake.
"""

from __future__ import annotations

from plexrl.messages import Dispatch, PhaseCompletion, PhaseRequest
from plexrl_worker.recorder import ResultRecorder


class DispatchIntake:
    def __init__(self, recorder: ResultRecorder) -> None:
        self._recorder = recorder
        self._read: set[str] = set()
        """Calls of this poll whose record was read ahead and not asked for yet."""
        self._recorded: dict[str, PhaseCompletion] = {}

    async def read_ahead(self, dispatches: list[Dispatch]) -> None:
        """Before a poll's dispatches run: their calls' recorded completions, at once."""
        self._read, self._recorded = set(), {}
        calls = [c for d in dispatches for c in d.calls]
        if calls:
            self._recorded = await self._recorder.recorded(calls)
            self._read = {c.request_id for c in calls}

    async def recorded(self, calls: list[PhaseRequest]) -> dict[str, PhaseCompletion]:
        """Completions recorded for any of these calls: read ahead once per call (a call
        delivered twice in one poll is read again the second time, after the first ran),
        else from Redis."""
        ids = [c.request_id for c in calls]
        if not all(i in self._read for i in ids):
            return await self._recorder.recorded(calls)
        self._read.difference_update(ids)
        return {i: self._recorded[i] for i in ids if i in self._recorded}

    async def settle(self) -> None:
        """After a poll's dispatches ran: until each of their completions is in Kafka."""
        self._read, self._recorded = set(), {}
        await self._recorder.settle()
