"""What happens to a message that cannot be read: its callers are answered, and it is kept.

A dead letter must never leave a client polling forever. Most unreadable messages
still name the calls they carried (a PhaseRequest's `request_id`, a Dispatch's
`calls`), even when they do not decode as their type; `salvage` digs those out of the
raw msgpack. `DeadLetters` then records an error completion for each (first write
wins, so a result that already stands is never overwritten), publishes it so waiting
clients and the scheduler hear of it, and indexes the letter in Redis under the
caller's tenant for `GET /plexrl/v1/dlq`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec

from plexrl.messages import (
    CompletionStatus,
    DeadLetter,
    DeadLetterReason,
    ErrorCode,
    ErrorInfo,
    Function,
    PhaseCompletion,
    Timings,
    decode,
    encode,
)
from plexrl.retry import retrying
from plexrl.stores import CallStore, RedisKeys

_MAX_ENTRIES = 10_000
"""Dead-letter index entries kept in Redis (oldest trimmed first); Kafka keeps them all."""


class CallRef(msgspec.Struct, frozen=True):
    """A call named inside an unreadable message, as far as the bytes tell."""

    request_id: str
    job_id: str = ""
    tenant: str = ""
    function: str = ""


class DeadLetterEntry(msgspec.Struct, frozen=True):
    """One dead letter as `GET /plexrl/v1/dlq` shows it to the tenant of its calls."""

    at: float
    source_topic: str
    partition: int
    offset: int
    reason: DeadLetterReason
    detail: str
    consumer: str
    tenant: str
    """The tenant of the calls it carried; "" when the bytes named none."""
    request_ids: list[str] = []
    job_ids: list[str] = []


def salvage(value: bytes) -> tuple[list[CallRef], str]:
    """The calls an unreadable message names, and its dispatch id ("" if none); best effort."""
    try:
        raw = msgspec.msgpack.decode(value)
    except (msgspec.DecodeError, ValueError, TypeError):
        return [], ""
    if not isinstance(raw, dict):
        return [], ""
    calls = raw.get("calls")
    items = calls if isinstance(calls, list) else [raw]
    refs = [ref for ref in (_call_ref(item) for item in items) if ref is not None]
    dispatch_id = raw.get("dispatch_id") if isinstance(calls, list) else ""
    return refs, dispatch_id if isinstance(dispatch_id, str) else ""


def _call_ref(item: Any) -> CallRef | None:
    if not isinstance(item, dict) or not isinstance(item.get("request_id"), str):
        return None

    def text(name: str) -> str:
        value = item.get(name)
        return value if isinstance(value, str) else ""

    return CallRef(item["request_id"], text("job_id"), text("tenant"), text("function"))


class CompletionPublisher(Protocol):
    """The part of plexrl.kafka.Publisher used here."""

    async def publish(self, topic: str, key: str | bytes | None, message: Any) -> None: ...


class DeadLetters:
    """Answers the calls of dead-lettered messages and keeps a tenant-scoped index."""

    def __init__(
        self,
        calls: CallStore,
        keys: RedisKeys,
        publisher: CompletionPublisher,
        completions_topic: str,
    ) -> None:
        """`calls`: the future records it trusts and where the error completions go;
        `keys`: the connection its own index (`<cluster>:dlq`, a stream) lives on."""
        self._calls = calls
        self._redis = keys.redis
        self._publisher = publisher
        self._completions_topic = completions_topic
        self._index = keys.key("dlq")

    async def __call__(self, letter: DeadLetter) -> None:
        """Answer every call the letter names, then index it; retries Redis and Kafka."""
        refs, dispatch_id = salvage(letter.value)
        answered: list[CallRef] = []
        for i, ref in enumerate(refs):
            answered.append(await self._answer(ref, letter, dispatch_id, last=i == len(refs) - 1))
        tenants = sorted({r.tenant for r in answered if r.tenant})
        entry = DeadLetterEntry(
            at=letter.at,
            source_topic=letter.source_topic,
            partition=letter.partition,
            offset=letter.offset,
            reason=letter.reason,
            detail=letter.detail[:1000],
            consumer=letter.consumer,
            tenant=tenants[0] if len(tenants) == 1 else "",
            request_ids=[r.request_id for r in answered],
            job_ids=sorted({r.job_id for r in answered if r.job_id}),
        )
        await retrying(
            lambda: self._redis.xadd(
                self._index, {"e": encode(entry)}, maxlen=_MAX_ENTRIES, approximate=True
            ),
            what=f"indexing the dead letter {letter.source_topic}@{letter.offset}",
        )

    async def _answer(
        self, ref: CallRef, letter: DeadLetter, dispatch_id: str, last: bool
    ) -> CallRef:
        # The gateway's future record is the trusted source of who owns the call.
        future = await retrying(
            lambda: self._calls.get_future(ref.request_id), what="reading a future record"
        )
        if future is not None:
            ref = CallRef(ref.request_id, future.job_id, future.tenant, future.function)
        try:
            function = Function(ref.function)
        except ValueError:
            function = Function.NOOP
        completion = PhaseCompletion(
            request_id=ref.request_id,
            job_id=ref.job_id,
            tenant=ref.tenant,
            worker_id="",
            function=function,
            status=CompletionStatus.ERROR,
            timings=Timings(),
            error=ErrorInfo(
                ErrorCode.INTERNAL,
                f"the call's message on {letter.source_topic} could not be read "
                f"({letter.reason}: {letter.detail[:300]}); it was set aside in the "
                "dead-letter topic and not run. Send the call again.",
            ),
            finished_at=time.time(),
            dispatch_id=dispatch_id,
            last_in_dispatch=last,
        )
        standing = await retrying(
            lambda: self._calls.record_completion(completion), what="recording an error completion"
        )
        await retrying(
            lambda: self._publisher.publish(self._completions_topic, standing.job_id, standing),
            what="publishing an error completion",
        )
        return ref

    async def entries(self, tenant: str, limit: int = 100) -> list[DeadLetterEntry]:
        """The tenant's most recent dead letters, newest first."""
        rows: Any = await self._redis.xrevrange(self._index, count=_MAX_ENTRIES)
        mine: list[DeadLetterEntry] = []
        for _, fields in rows or []:
            entry: DeadLetterEntry = decode(bytes(fields[b"e"]), DeadLetterEntry)
            if entry.tenant == tenant:
                mine.append(entry)
                if len(mine) >= limit:
                    break
        return mine
