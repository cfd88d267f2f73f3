"""Per-model call order: a model's calls are published in seq_id order.

The Tinker SDK numbers a training model's calls (create is the implicit 0) and sends
each once the previous one was accepted, except for the chunks of a big
forward_backward, which arrive together with the lowest last. The sequencer holds an
early call until every lower seq_id has been published or refused; Kafka's keying by
job id then keeps that order all the way to the worker.

The cursor (the next seq_id to publish) is kept in Redis, so a restarted gateway
resumes where it stopped. The submitter moves it in the same Redis transaction that
accepts the call (and settles the turn as stored), so no crash can leave a call
accepted with the cursor behind it; the sequencer itself writes it only for a seq_id
used up by a refusal.

Several gateways may take one model's calls (any gateway answers any call): a call that
waits for a lower seq_id also reads the cursor in Redis every `poll_s`, so a lower call
accepted by another gateway lets it go. The order on Kafka still follows seq_id, since
a call is accepted only once the cursor reached it, and the job's outbox (a Redis list
every gateway publishes from its head) keeps that order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from plexrl_gateway import metrics


class CursorStore(Protocol):
    """Where each job's next seq_id is remembered (`plexrl.stores.CallStore` in production)."""

    async def get_next_seq(self, job_id: str) -> int | None: ...

    async def set_next_seq(self, job_id: str, next_seq: int) -> None: ...


class SequenceGapError(Exception):
    """A call waited too long for a lower seq_id of its model."""


class Turn:
    """A call's turn in its model's order; `settle()` says its seq_id is used up."""

    def __init__(self) -> None:
        self.settled = False
        self.stored = False

    def settle(self, stored: bool = False) -> None:
        """`stored`: the body already wrote the moved cursor to the store (with the call
        it accepted), so the turn only moves it in memory."""
        self.settled = True
        self.stored = self.stored or stored


@dataclass
class _Line:
    """One job's queue: a condition guarding its cursor, and who is in it."""

    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    next_seq: int | None = None
    loaded: bool = False
    users: int = 0


class Sequencer:
    def __init__(self, cursors: CursorStore, gap_timeout_s: float, poll_s: float = 0.05) -> None:
        """`poll_s`: how often a waiting call reads the cursor in Redis (another gateway
        may have moved it)."""
        if gap_timeout_s <= 0:
            raise ValueError(
                f"gap_timeout_s is {gap_timeout_s}; it must be positive "
                "(PLEXRL_SEQUENCE_GAP_TIMEOUT_S)"
            )
        self._cursors = cursors
        self._gap_timeout_s = gap_timeout_s
        self._poll_s = poll_s
        self._lines: dict[str, _Line] = {}

    @contextlib.asynccontextmanager
    async def turn(self, job_id: str, seq_id: int | None) -> AsyncIterator[Turn]:
        """Hold the job's turn for `seq_id` while the body validates and publishes.

        Waits until every lower seq_id is settled. A seq_id below the cursor (a client's
        retry, or a call that outlived a gap) goes at once. `seq_id=None` appends after
        whatever was settled so far, without moving the cursor. The cursor moves past
        `seq_id` when the body returns, or when it raises after `Turn.settle()` (a call
        refused for good still used up its seq_id: the client numbers the next one
        after it). A body that raises unsettled (a publish failure the client will
        re-send) leaves the cursor where it was.
        """
        line = self._lines.setdefault(job_id, _Line())
        line.users += 1
        turn = Turn()
        try:
            async with line.cond:
                if not line.loaded:
                    line.next_seq = await self._cursors.get_next_seq(job_id)
                    line.loaded = True
                if seq_id is not None:
                    await self._wait_for(line, job_id, seq_id)
                try:
                    yield turn
                    turn.settle()
                finally:
                    if turn.settled and seq_id is not None:
                        await self._advance(line, job_id, seq_id, store=not turn.stored)
                    line.cond.notify_all()
        finally:
            line.users -= 1
            if line.users == 0:
                # Nobody waits: forget the line; the cursor lives on in the store.
                del self._lines[job_id]

    async def release(self, job_id: str, seq_id: int, wait_s: float) -> bool:
        """Use up `seq_id` of a call refused before it reached its turn (a route the
        gateway does not serve, a body it cannot read, admission), so the client's next
        call need not wait for it. Waits at most `wait_s` for the lower seq_ids; False
        when they did not come, and the cursor stays (the gap fails the next call as it
        would have). A seq_id already used up changes nothing."""
        line = self._lines.setdefault(job_id, _Line())
        line.users += 1
        try:
            async with line.cond:
                if not line.loaded:
                    line.next_seq = await self._cursors.get_next_seq(job_id)
                    line.loaded = True
                if not await self._until_ready(line, job_id, seq_id, wait_s):
                    return False
                await self._advance(line, job_id, seq_id, store=True)
                line.cond.notify_all()
                return True
        finally:
            line.users -= 1
            if line.users == 0:
                del self._lines[job_id]

    async def _advance(self, line: _Line, job_id: str, seq_id: int, store: bool) -> None:
        if line.next_seq is None or seq_id >= line.next_seq:
            line.next_seq = seq_id + 1
            if store:
                await self._cursors.set_next_seq(job_id, seq_id + 1)

    async def _wait_for(self, line: _Line, job_id: str, seq_id: int) -> None:
        def ready() -> bool:
            return _ready(line, seq_id)

        if ready():
            return
        metrics.SEQUENCER_WAITING.inc()
        try:
            if await self._until_ready(line, job_id, seq_id, self._gap_timeout_s):
                return
            raise SequenceGapError(
                f"model {job_id}: call seq_id {seq_id} waited {self._gap_timeout_s:g}s for "
                f"seq_id {line.next_seq}, which never arrived; calls of one model must all be "
                "sent (seq_ids without gaps), so this call was not run"
            )
        finally:
            metrics.SEQUENCER_WAITING.dec()

    async def _until_ready(self, line: _Line, job_id: str, seq_id: int, wait_s: float) -> bool:
        """Wait (holding the line's condition) until every lower seq_id is settled, here or
        by another gateway (the cursor in Redis moved); False after `wait_s`."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while not _ready(line, seq_id):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    line.cond.wait_for(lambda: _ready(line, seq_id)), min(left, self._poll_s)
                )
            if not _ready(line, seq_id):
                stored = await self._cursors.get_next_seq(job_id)
                if stored is not None and (line.next_seq is None or stored > line.next_seq):
                    line.next_seq = stored
        return True


def _ready(line: _Line, seq_id: int) -> bool:
    """Every seq_id below `seq_id` is settled (or nothing was ever numbered)."""
    return line.next_seq is None or seq_id <= line.next_seq
