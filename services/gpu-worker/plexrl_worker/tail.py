"""The rollout-tail release, as one rule both sample loops (torch and SGLang) follow.

A running sample batch is released — the worker takes its next dispatch while the
batch finishes in the background — once fewer than `threshold` of its sequences still
decode (its straggling tail), or as soon as the scheduler preempts it. The simulator's
`tail_threshold` means the same fraction.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from plexrl.messages import TailReleased

TailHook = Callable[[list[int], int, int], Awaitable[None]]
"""Told once, when a sample batch is down to its tail: the indices of the calls still
running, their sequences still decoding, and the batch's sequences in all."""


@dataclass(frozen=True)
class TailRelease:
    """The worker's setting: the fraction of a batch's sequences still decoding below
    which it takes its next dispatch (0: never), and how it tells the scheduler."""

    threshold: float
    announce: Callable[[TailReleased], Awaitable[None]]


class TailWatch:
    """One batch's watch: `check` after each step (or finished call) calls `on_tail`
    once, the first time the batch is down to its tail or `release` is set."""

    def __init__(
        self,
        threshold: float,
        total: int,
        on_tail: TailHook | None,
        release: asyncio.Event | None,
    ) -> None:
        self._threshold = threshold
        self._total = total
        self._on_tail = on_tail
        self._release = release
        self.released_at: float | None = None
        """When the batch was released (None: not yet); calls finishing after carry it."""

    @property
    def asked(self) -> bool:
        """The scheduler asked the batch to yield (a preemption)."""
        return self._release is not None and self._release.is_set()

    async def check(self, running: list[int], remaining: int) -> None:
        """`running`: indices of the calls still going; `remaining`: their sequences."""
        if self._on_tail is None or self.released_at is not None or not running:
            return
        if self.asked or remaining < self._threshold * self._total:
            self.released_at = time.time()
            await self._on_tail(running, remaining, self._total)
