"""The scheduler's control loop: each pass runs its steps in order, each one guarded.

Like Ray Serve's controller, a pass moves the actual state toward the desired one and
the next pass starts from whatever is true then. So one failed step (a publish Kafka
refused, a Redis write that timed out, a bug meeting an odd state) is logged with its
duration and the pass ends there; the loop waits a little (longer after each failure
in a row) and tries again. Nothing a step raises stops the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from plexrl.retry import Backoff

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One named part of a pass (ingest, decide and act, record)."""

    name: str
    run: Callable[[], Awaitable[None]]
    every_s: float = 0.0
    """Run at most this often (0: every pass): for steps that watch clocks of seconds
    (liveness, gauges), which need not run on every event of a busy scheduler."""


class ControlLoop:
    def __init__(
        self,
        steps: list[Step],
        *,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._steps = steps
        self._backoff = backoff or Backoff(first_s=0.05, max_s=2.0)
        self._clock = clock
        self.passes = 0
        self._last_run: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        """Failed runs per step name, since start."""
        self.failing = 0
        """Passes in a row that ended in a failure (0: the last one went through)."""
        self.last_error = ""

    async def run_pass(self) -> bool:
        """Run the steps in order; False (after logging) at the first that raises: later
        steps build on earlier ones, and the next pass starts over from fresh state."""
        self.passes += 1
        for step in self._steps:
            started = self._clock()
            if step.every_s > 0:
                if started - self._last_run.get(step.name, -float("inf")) < step.every_s:
                    continue
                self._last_run[step.name] = started
            try:
                await step.run()
            except Exception as exc:
                self.failures[step.name] = self.failures.get(step.name, 0) + 1
                self.last_error = f"{step.name}: {type(exc).__name__}: {exc}"
                log.warning(
                    "scheduler step %r failed after %.3fs (%d in a row); the loop goes on",
                    step.name,
                    self._clock() - started,
                    self.failing + 1,
                    exc_info=True,
                )
                return False
        return True

    async def run(
        self, stop: asyncio.Event, wait_for_change: Callable[[], Awaitable[object]]
    ) -> None:
        """Pass after pass until `stop` is set; `wait_for_change` paces the passes."""
        while not stop.is_set():
            await wait_for_change()
            if await self.run_pass():
                self.failing = 0
                continue
            self.failing += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._backoff.delay(self.failing))

    def health(self) -> dict[str, object]:
        return {
            "passes": self.passes,
            "failing_passes_in_a_row": self.failing,
            "step_failures": dict(self.failures),
            **({"last_error": self.last_error} if self.last_error else {}),
        }
