"""A call's life in Redis: its future, its completion, the client's retry key, its job's
seq cursor; and payloads too big to travel inline."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from plexrl import tracing
from plexrl.messages import CompletionNotice, PayloadRef, PhaseCompletion, decode, encode
from plexrl.stores.redis import RedisStore, raw_bytes, text


class FutureRecord(msgspec.Struct, frozen=True):
    request_id: str
    tenant: str
    job_id: str
    function: str
    created_at: float
    """Wall-clock seconds when the gateway accepted it."""
    response_kind: str = ""
    """How the gateway renders the result for the client (API-specific)."""
    response_context: dict[str, str] = {}
    traceparent: str = ""
    """W3C traceparent of the API call's span: `retrieve_future` spans link to it."""


_RECORD = """
if ARGV[4] ~= '' and tonumber(redis.call('HGET', KEYS[3], 'epoch') or '0') > tonumber(ARGV[4]) then
  return -1
end
if ARGV[5] ~= '' and tonumber(redis.call('GET', KEYS[4]) or '0') > tonumber(ARGV[5]) then
  return -1
end
if redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2], 'NX') then
  if ARGV[3] ~= '' then redis.call('PUBLISH', KEYS[2], ARGV[3]) end
  return 1
end
return 0
"""
"""A completion's record, unless its fence refuses it (-1): the job moved on to a newer
epoch, or a newer scheduler term began; if it stands (1, else 0: one stood already),
its notice with it, where one is passed (a store that waits for replicas announces only
once they hold the record)."""


@dataclass(frozen=True)
class RecordFence:
    """What a call's record stands on: the lease it ran under (the job's ledger head,
    `Ledger.head_key`, holds no newer epoch) and the scheduler term that sent it (the
    `scheduler` lease's token key holds no newer token); an empty key checks nothing."""

    ledger_key: str = ""
    epoch: int = 0
    token_key: str = ""
    token: int = 0


FENCED = -1
"""`queue_completion`'s reply when its fence refused the record."""


def _notice(completion: PhaseCompletion) -> bytes:
    """The encoded `CompletionNotice` of a completion, in the current span's trace."""
    return encode(CompletionNotice(completion, tracing.traceparent_of() or ""))


def completions_of(request_ids: list[str], reply: list[Any]) -> dict[str, PhaseCompletion]:
    """The completions recorded for these calls, from the reply of
    `CallStore.queue_get_completions`."""
    return {
        i: decode(raw_bytes(r), PhaseCompletion)
        for i, r in zip(request_ids, reply, strict=True)
        if r
    }


class CallStore(RedisStore):
    """Futures, completions, retry keys and seq cursors; each lives `ttl_s`. Keys:
    `future:<request>`, `done:<request>`, `idem:<retry key>`, `seq:<job>`."""

    # Futures and results ------------------------------------------------------

    async def put_future(self, future: FutureRecord) -> None:
        await self._redis.set(
            self._k("future", future.request_id), encode(future), ex=self._keys.ttl_s
        )

    async def get_future(self, request_id: str) -> FutureRecord | None:
        return await self._get(self._k("future", request_id), FutureRecord)

    async def record_completion(self, completion: PhaseCompletion) -> PhaseCompletion:
        """Record a call's completion once and announce the record that stands (first
        wins), which it returns.

        Announces it once the Redis replicas asked for (PLEXRL_REDIS_WAIT_REPLICAS) hold
        it, and with it everything written before (the call's ledger commit, its
        payload): a failover must not take back what a client or the scheduler was told.
        The caller publishes it on the completions topic next."""
        key = self._k("done", completion.request_id)
        if await self._redis.set(key, encode(completion), ex=self._keys.ttl_s, nx=True):
            stands = completion
        else:
            stands = await self.get_completion(completion.request_id) or completion
        await self._keys.replicated()  # a first writer may have died before waiting
        await self.announce(stands)
        return stands

    def queue_completion(
        self, pipe: Any, completion: PhaseCompletion, fence: RecordFence | None = None
    ) -> bool:
        """`record_completion` on a pipeline (`RedisStore.pipeline`), and only while
        `fence` stands: its reply is 1 if this record stands, 0 if one stood already
        (then read it: `get_completion`), `FENCED` if the fence refused it. Returns
        whether the record, if it stands, is announced with it (only where no replica
        is waited for); otherwise the caller announces the record that stands
        (`announce`) once the replicas hold it."""
        key = self._k("done", completion.request_id)
        announced = not self._keys.waits_for_replicas
        fence = fence or RecordFence()
        pipe.eval(
            _RECORD,
            4,
            key,
            self.completed_channel,
            fence.ledger_key or key,
            fence.token_key or key,
            encode(completion),
            self._keys.ttl_s,
            _notice(completion) if announced else b"",
            str(fence.epoch) if fence.ledger_key else "",
            str(fence.token) if fence.token_key else "",
        )
        return announced

    @property
    def completed_channel(self) -> str:
        """The pub/sub channel of `CompletionNotice`s (every gateway subscribes)."""
        return self._k("completed")

    async def announce(self, completion: PhaseCompletion) -> None:
        """Wake the gateways' waiters for a completion recorded (and replicated) already:
        a `CompletionNotice` carrying it and the current span's trace context."""
        await self._redis.publish(self.completed_channel, _notice(completion))

    async def get_completion(self, request_id: str) -> PhaseCompletion | None:
        return await self._get(self._k("done", request_id), PhaseCompletion)

    async def get_completions(self, request_ids: Iterable[str]) -> dict[str, PhaseCompletion]:
        ids = list(request_ids)
        if not ids:
            return {}
        return completions_of(ids, await self._redis.mget([self._k("done", i) for i in ids]))

    def queue_get_completions(self, pipe: Any, request_ids: list[str]) -> None:
        """`get_completions` (of at least one call) on a pipeline (`RedisStore.pipeline`);
        its reply is read with `completions_of`."""
        pipe.mget([self._k("done", i) for i in request_ids])

    # Client retries and per-job call order -----------------------------------

    async def claim_request(self, key: str, request_id: str) -> str:
        """Bind a client's retry key to a request id once; returns the id that stands."""
        k = self._k("idem", key)
        if await self._redis.set(k, request_id, ex=self._keys.ttl_s, nx=True):
            return request_id
        existing = await self._redis.get(k)
        return request_id if existing is None else text(existing)

    async def claimed_request(self, key: str) -> str | None:
        raw = await self._redis.get(self._k("idem", key))
        return None if raw is None else text(raw)

    async def release_request(self, key: str, request_id: str) -> None:
        """Undo a claim that was never published, so a retry can claim the key again."""
        if await self.claimed_request(key) == request_id:
            await self._redis.delete(self._k("idem", key))

    async def get_next_seq(self, job_id: str) -> int | None:
        """The next seq_id the gateway will publish for a job (None: never recorded)."""
        raw = await self._redis.get(self._k("seq", job_id))
        return None if raw is None else int(raw)

    async def set_next_seq(self, job_id: str, next_seq: int) -> None:
        await self._redis.set(self._k("seq", job_id), next_seq, ex=self._keys.ttl_s)


class PayloadStore(RedisStore):
    """Payloads sent by reference (`payload:<uuid>`), each stored once for `ttl_s`."""

    async def put_payload(self, data: bytes) -> PayloadRef:
        key = uuid.uuid4().hex
        await self._redis.set(self._k("payload", key), data, ex=self._keys.ttl_s)
        return PayloadRef(key=key, size=len(data))

    async def get_payload(self, ref: PayloadRef) -> bytes:
        data = await self._redis.get(self._k("payload", ref.key))
        if data is None:
            raise KeyError(f"payload {ref.key} expired or never stored")
        return raw_bytes(data)
