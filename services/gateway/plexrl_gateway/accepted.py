"""The calls this gateway accepted, known without asking Redis while its notices held.

A call's future record is written by this gateway's acceptance, and its completion is
announced to every gateway once recorded (`plexrl_gateway.notices`). So for a call it
accepted, a gateway whose subscription has held since the acceptance has heard every
notice of it: the call's future record is the one it wrote, and either the completion
came with a notice (held here until asked for) or the call has not completed. Its
`retrieve_future` then needs no Redis read, one round trip for the future record and
one for the completion fewer per call.

What holds this: a call is noted before its acceptance is sent to Redis (no flush can
publish it, nor a worker finish it, before), in the listener's current subscription
(`generation`). Each new subscription, or a connection redis-py opened again, starts a
new generation: what was noted before is read from Redis again, as is everything when no
subscription holds. Bounded by count, age and the bytes of held completions; what falls
out is read from Redis as before. A waiter for a call noted here still has the sweeps
behind it (`FutureWaiter`), so nothing depends on this alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from plexrl.messages import PhaseCompletion
from plexrl.stores import FutureRecord

MAX_CALLS = 65_536
"""Calls noted at most (the oldest fall out)."""
MAX_HELD_BYTES = 64 * 1024 * 1024
"""Bytes of completions (as announced) held at most (the oldest fall out)."""
MAX_AGE_S = 600.0
"""A call noted longer ago than this is read from Redis (the records there expire)."""


@dataclass
class _Noted:
    future: FutureRecord
    generation: int
    at: float
    completion: PhaseCompletion | None = None
    size: int = 0


class AcceptedCalls:
    def __init__(
        self,
        max_calls: int = MAX_CALLS,
        max_held_bytes: int = MAX_HELD_BYTES,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_calls = max_calls
        self._max_held_bytes = max_held_bytes
        self._max_age_s = max_age_s
        self._clock = clock
        self._calls: OrderedDict[str, _Noted] = OrderedDict()
        self._held: OrderedDict[str, None] = OrderedDict()
        """The calls with a completion held, oldest first."""
        self._held_bytes = 0
        self._generation: int | None = None
        """The listener's subscription now; None while none holds."""

    def listening(self, generation: int | None) -> None:
        """The listener subscribed (a new `generation`), or lost its subscription
        (None): what was noted before is no longer known from notices alone."""
        self._generation = generation

    def note(self, futures: Iterable[FutureRecord]) -> None:
        """Calls about to be accepted by this gateway (before their acceptance is sent)."""
        if self._generation is None:
            return
        now = self._clock()
        for future in futures:
            self._drop(future.request_id)
            self._calls[future.request_id] = _Noted(future, self._generation, now)
        while self._calls and (
            len(self._calls) > self._max_calls
            or now - next(iter(self._calls.values())).at > self._max_age_s
        ):
            self._drop(next(iter(self._calls)))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Calls whose acceptance failed or did not write them."""
        for request_id in request_ids:
            self._drop(request_id)

    def knows(self, request_id: str) -> bool:
        """Whether every notice of this call since its acceptance reached this gateway."""
        return self._current(request_id) is not None

    def future(self, request_id: str) -> FutureRecord | None:
        """The future record this gateway wrote, if it `knows` the call."""
        noted = self._current(request_id)
        return None if noted is None else noted.future

    def completion(self, request_id: str) -> PhaseCompletion | None:
        """The call's completion as announced, if it `knows` the call and it completed."""
        noted = self._current(request_id)
        return None if noted is None else noted.completion

    def hold(self, completion: PhaseCompletion, size: int) -> None:
        """An announced completion (`size`: its notice's bytes) of a call noted here,
        kept until asked for or pushed out."""
        noted = self._current(completion.request_id)
        if noted is None or noted.completion is not None:
            return
        noted.completion, noted.size = completion, size
        self._held[completion.request_id] = None
        self._held_bytes += size
        while self._held_bytes > self._max_held_bytes:
            self._drop(next(iter(self._held)))

    def __len__(self) -> int:
        return len(self._calls)

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def _current(self, request_id: str) -> _Noted | None:
        noted = self._calls.get(request_id)
        if noted is None or self._generation is None:
            return None
        if noted.generation != self._generation or self._clock() - noted.at > self._max_age_s:
            self._drop(request_id)
            return None
        return noted

    def _drop(self, request_id: str) -> None:
        noted = self._calls.pop(request_id, None)
        if noted is not None and noted.completion is not None:
            del self._held[request_id]
            self._held_bytes -= noted.size
