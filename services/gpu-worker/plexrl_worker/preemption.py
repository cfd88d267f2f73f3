"""The worker's side of preemption (`PreemptBatch`): which running sample batch may be
asked to yield, and the pause that holds a preempted batch while the dispatch it
yielded to runs.

A preempted batch is released as a tail is (the consumer takes the next dispatch) and
then paused: the torch decode loop waits at `wait_open` before each step, and SGLang's
generation is paused (`retract`: its running requests wait, their KV cache freed, and
finish with the same tokens once continued). The pause lifts when the next dispatch
reaches its sample calls (they join the batch) or ends, or after `grace_s` if no
dispatch comes, so a preempted job waits for one dispatch at most; after that it runs
beside whatever comes next, like a tail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]


class Preemption:
    def __init__(
        self, *, pause: Hook | None = None, resume: Hook | None = None, grace_s: float = 2.0
    ) -> None:
        self._pause = pause
        self._resume = resume
        self._grace_s = grace_s
        self._asks: dict[str, asyncio.Event] = {}
        """By dispatch id: the running batches that may be asked to yield."""
        self._open = asyncio.Event()
        self._open.set()
        self._timer: asyncio.TimerHandle | None = None
        self._lock = asyncio.Lock()
        self._holds = 0
        """Holds so far: a dispatch lets go only of the hold it claimed."""
        self._paused_s = 0.0
        self._paused_at: float | None = None
        self.preempted = 0

    def yieldable(self, dispatch_id: str) -> asyncio.Event:
        """Register a running batch that may yield; the event is set when it is asked."""
        return self._asks.setdefault(dispatch_id, asyncio.Event())

    def finished(self, dispatch_id: str) -> None:
        """The batch was released (or ended): a later ask finds nothing."""
        self._asks.pop(dispatch_id, None)

    async def ask(self, dispatch_id: str) -> bool:
        """The scheduler asks the batch to yield; False when it is not running (it
        finished, or was released at its tail first)."""
        event = self._asks.get(dispatch_id)
        if event is None:
            log.info("preempt for %s: nothing to yield (finished or released)", dispatch_id)
            return False
        event.set()
        return True

    async def hold(self) -> None:
        """Pause the released batches until the next dispatch claims the pause and lets
        go of it (`open`), or for `grace_s` if none comes."""
        async with self._lock:
            self.preempted += 1
            self._holds += 1
            if self._open.is_set():
                if self._pause is not None:
                    await self._pause()
                self._open.clear()
                self._paused_at = time.monotonic()
            self._restart_timer()

    def claim(self) -> int | None:
        """A dispatch starts: a pause in force lasts until it lets go (`open` with what
        this returns); None when no pause is in force."""
        if not self.paused:
            return None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return self._holds

    async def open(self, claimed: int | None = None) -> None:
        """Lift the pause, if any; with `claimed` (from `claim`), only if no newer hold
        came since (a batch preempted during the claiming dispatch waits for the next)."""
        async with self._lock:
            if claimed is not None and claimed != self._holds:
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._open.is_set():
                return
            if self._resume is not None:
                await self._resume()
            self._open.set()
            if self._paused_at is not None:
                self._paused_s += time.monotonic() - self._paused_at
                self._paused_at = None

    async def wait_open(self) -> None:
        await self._open.wait()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def paused_seconds(self) -> float:
        """Seconds spent paused so far (monotonic clock): what a call's wall time held in
        the pause, which no job should be charged for."""
        current = time.monotonic() - self._paused_at if self._paused_at is not None else 0.0
        return self._paused_s + current

    def _restart_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._grace_s, self._expire)

    def _expire(self) -> None:
        self._timer = None
        task = asyncio.get_running_loop().create_task(self.open())
        task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("lifting a preemption's pause failed", exc_info=task.exception())
