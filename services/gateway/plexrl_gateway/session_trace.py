"""A session's calls as a Perfetto trace (`tinker session export-trace`).

`GET /api/v1/sessions/{id}/trace_export` (the SDK's `RestClient.export_session_trace`)
answers at once with a signed, expiring URL; the URL's file is built when it is read,
from the cluster's timeline (every call as it ran: which job, on which worker, when,
its queueing, swap and compute seconds). The file is a Perfetto protobuf trace
(`.pftrace`, open it in ui.perfetto.dev): a track for the session, under it one per job
(training run or sampler) with its calls as they ran, swap in first, and one with their
waits from arrival at the gateway to start (Kafka, the scheduler, and the device busy
with other calls); where a job's calls overlapped (a rollout's tail beside the next
call, a sample on another group) or their waits did (calls sent together), another
lane.

The timeline keeps about its last 100,000 calls cluster-wide, so an old session's
earliest calls may be gone from it; the trace says how many calls it holds.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from plexrl.stores.jobs import JobKind, JobRecord
from plexrl.stores.timeline import TimelineEntry, TimelineStore
from plexrl_gateway.errors import ApiError
from plexrl_gateway.registry import Registry
from plexrl_gateway.signing import BadSignature, Expired, UrlSigner

TRACES_ROUTE = "/api/v1/session_traces"
TRACE_FILE = "trace.pftrace"
TIMELINE_READ_MAX = 100_000
"""As many entries as the timeline keeps (`TimelineStore.append_timeline`)."""

# Perfetto's field numbers (protos/perfetto/trace/: trace.proto, trace_packet.proto,
# track_event/track_descriptor.proto, track_event.proto, debug_annotation.proto).
_TRACE_PACKET = 1
_PACKET_TIMESTAMP = 8
_PACKET_SEQUENCE_ID = 10
_PACKET_TRACK_EVENT = 11
_PACKET_TRACK_DESCRIPTOR = 60
_TRACK_UUID = 1
_TRACK_NAME = 2
_TRACK_PARENT = 5
_EVENT_ANNOTATIONS = 4
_EVENT_TYPE = 9
_EVENT_TRACK = 11
_EVENT_CATEGORIES = 22
_EVENT_NAME = 23
_ANNOTATION_BOOL = 2
_ANNOTATION_UINT = 3
_ANNOTATION_DOUBLE = 5
_ANNOTATION_STRING = 6
_ANNOTATION_NAME = 10
SLICE_BEGIN = 1
SLICE_END = 2
_SEQUENCE = 1
"""Every packet's `trusted_packet_sequence_id`: one writer, no interned state."""
CATEGORY = "plexrl"
RENEW = "export_session_trace (tinker session export-trace)"
"""What gives a fresh URL, as an expired or altered one's error says."""


# Protobuf's wire format, for the few field kinds a trace needs --------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _uint(field: int, n: int) -> bytes:
    return _varint(field << 3) + _varint(n)


def _message(field: int, body: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(body)) + body


def _text(field: int, s: str) -> bytes:
    return _message(field, s.encode())


def _double(field: int, x: float) -> bytes:
    return _varint(field << 3 | 1) + struct.pack("<d", x)


Value = str | float | bool | int


def _annotation(name: str, value: Value) -> bytes:
    body = _text(_ANNOTATION_NAME, name)
    if isinstance(value, bool):
        body += _uint(_ANNOTATION_BOOL, int(value))
    elif isinstance(value, int):
        body += _uint(_ANNOTATION_UINT, value)
    elif isinstance(value, float):
        body += _double(_ANNOTATION_DOUBLE, value)
    else:
        body += _text(_ANNOTATION_STRING, value)
    return _message(_EVENT_ANNOTATIONS, body)


# The trace ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Track:
    uuid: int
    name: str
    parent: int = 0


@dataclass(frozen=True)
class Slice:
    track: int
    name: str
    start_ns: int
    end_ns: int
    args: tuple[tuple[str, Value], ...] = ()


def track_uuid(*names: str) -> int:
    """A stable, non-zero 63-bit id for a track (0 is Perfetto's global track)."""
    digest = hashlib.blake2b("\0".join(names).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


def encode_trace(tracks: Sequence[Track], slices: Iterable[Slice]) -> bytes:
    """A Perfetto `Trace`: the tracks' descriptors, then each slice as a begin and an end
    event, in time order (at one instant, ends before begins)."""
    out = bytearray()
    for track in tracks:
        body = _uint(_TRACK_UUID, track.uuid) + _text(_TRACK_NAME, track.name)
        if track.parent:
            body += _uint(_TRACK_PARENT, track.parent)
        packet = _uint(_PACKET_SEQUENCE_ID, _SEQUENCE) + _message(_PACKET_TRACK_DESCRIPTOR, body)
        out += _message(_TRACE_PACKET, packet)
    events: list[tuple[int, int, int, bytes]] = []
    for n, s in enumerate(slices):
        begin = (
            _uint(_EVENT_TYPE, SLICE_BEGIN)
            + _uint(_EVENT_TRACK, s.track)
            + _text(_EVENT_CATEGORIES, CATEGORY)
            + _text(_EVENT_NAME, s.name)
            + b"".join(_annotation(k, v) for k, v in s.args)
        )
        end = _uint(_EVENT_TYPE, SLICE_END) + _uint(_EVENT_TRACK, s.track)
        events.append((s.start_ns, 1, n, begin))
        events.append((max(s.end_ns, s.start_ns), 0, -n, end))
    for ts, _, _, event in sorted(events):
        packet = (
            _uint(_PACKET_TIMESTAMP, ts)
            + _uint(_PACKET_SEQUENCE_ID, _SEQUENCE)
            + _message(_PACKET_TRACK_EVENT, event)
        )
        out += _message(_TRACE_PACKET, packet)
    return bytes(out)


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


class _Lanes:
    """Tracks under one parent, one more wherever an interval overlaps all the others'
    (slices on a Perfetto track must nest)."""

    def __init__(self, tracks: list[Track], parent: int, name: str, *key: str) -> None:
        self._tracks, self._parent, self._name, self._key = tracks, parent, name, key
        self._until: list[tuple[int, float]] = []  # (track uuid, its last slice's end)

    def place(self, start: float, end: float) -> int:
        """The first lane free at `start`, taken until `end`."""
        for i, (uuid, until) in enumerate(self._until):
            if until <= start:
                self._until[i] = (uuid, end)
                return uuid
        n = len(self._until)
        uuid = track_uuid(*self._key, str(n)) if n else track_uuid(*self._key)
        self._tracks.append(Track(uuid, self._name + (f" {n + 1}" if n else ""), self._parent))
        self._until.append((uuid, end))
        return uuid


def session_trace(
    session_id: str, jobs: Sequence[JobRecord], entries: Iterable[TimelineEntry]
) -> bytes:
    """The session's calls in `entries` (the timeline) as a Perfetto trace: under the
    session's track, per job a track of its calls as they ran (the swap in, then the
    call, named by its function, with its request id, worker, outcome and seconds) and
    one of their waits from arrival to start ("queued"); a lane more wherever they
    overlapped."""
    root = track_uuid("session", session_id)
    kinds = {j.job_id: j.kind for j in jobs}
    seen: set[str] = set()
    calls: list[TimelineEntry] = []
    for e in entries:
        if e.job_id in kinds and e.request_id not in seen:  # a retried write appends twice
            seen.add(e.request_id)
            calls.append(e)
    calls.sort(key=lambda e: (e.started_at, e.request_id))
    tracks = [Track(root, f"session {session_id}: {len(calls)} calls")]
    ran: dict[str, _Lanes] = {}
    waited: dict[str, _Lanes] = {}
    for job in jobs:
        kind = "training run" if job.kind == JobKind.TRAINING else "sampler"
        ran[job.job_id] = _Lanes(tracks, root, f"{job.job_id} ({kind})", "job", job.job_id)
        ran[job.job_id].place(0.0, 0.0)  # every job's track, whether it called or not
        waited[job.job_id] = _Lanes(tracks, root, f"{job.job_id} queued", "queued", job.job_id)
    slices: list[Slice] = []
    for e in calls:
        end = e.started_at + e.swap_s + e.compute_s
        rid = (("request_id", e.request_id),)
        if e.queue_s > 0:
            arrived = e.started_at - e.queue_s
            track = waited[e.job_id].place(arrived, e.started_at)
            slices.append(Slice(track, "queued", _ns(arrived), _ns(e.started_at), rid))
        track = ran[e.job_id].place(e.started_at, end)
        args: list[tuple[str, Value]] = [
            ("request_id", e.request_id),
            ("worker", e.worker_id),
            ("ok", e.ok),
            ("queue_s", e.queue_s),
            ("swap_s", e.swap_s),
            ("compute_s", e.compute_s),
        ]
        if e.slices:
            args.append(("slices", e.slices))
        if e.tail_released_at is not None:
            args.append(("tail_released_after_s", e.tail_released_at - e.started_at))
            args.append(("preempted", e.preempted))
        start = _ns(e.started_at)
        if e.swap_s > 0:
            swapped = _ns(e.started_at + e.swap_s)
            slices.append(Slice(track, "swap in", start, swapped, rid))
            start = swapped
        slices.append(Slice(track, str(e.function), start, _ns(end), tuple(args)))
    return encode_trace(tracks, slices)


class SessionTraces:
    """Finds a tenant's session, signs its trace's URL and builds the file a signed URL
    names. A session's jobs outlive its record (which ends a day after its last
    heartbeat), so its trace is built from them."""

    def __init__(
        self,
        registry: Registry,
        timeline: TimelineStore,
        signer: UrlSigner,
        url_ttl_s: float,
        public_url: str | None = None,
    ) -> None:
        self._registry = registry
        self._timeline = timeline
        self._signer = signer
        self._url_ttl_s = url_ttl_s
        self._public_url = public_url.rstrip("/") if public_url else None

    async def url(self, tenant: str, session_id: str, request_base_url: str) -> str:
        """The trace's download URL, valid for the configured lifetime, no key needed; 404
        for a session the tenant never had."""
        if not await self._jobs_of(tenant, session_id):
            await self._registry.session(tenant, session_id)  # 404 unless the tenant's
        expires = int(self._signer.now() + self._url_ttl_s)
        signature = self._signer.sign(_signed_path(tenant, session_id), TRACE_FILE, expires)
        base = (self._public_url or request_base_url.rstrip("/")) + TRACES_ROUTE
        query = urlencode({"tenant": tenant, "expires": expires, "signature": signature})
        return f"{base}/{quote(session_id, safe='')}/{TRACE_FILE}?{query}"

    async def build(self, session_id: str, tenant: str, expires: int, signature: str) -> bytes:
        """The trace a signed URL names: 403 for a signature that does not match (the
        tenant is signed too), 410 past its expiry."""
        path = _signed_path(tenant, session_id)
        try:
            self._signer.check(path, TRACE_FILE, expires, signature, renew=RENEW)
        except BadSignature as exc:
            raise ApiError(403, str(exc)) from None
        except Expired as exc:
            raise ApiError(410, str(exc)) from None
        jobs = await self._jobs_of(tenant, session_id)
        if not jobs:
            return session_trace(session_id, [], [])
        since = min(j.created_at for j in jobs)
        return session_trace(
            session_id, jobs, await self._timeline.timeline(since, TIMELINE_READ_MAX)
        )

    async def _jobs_of(self, tenant: str, session_id: str) -> list[JobRecord]:
        jobs = [j for j in await self._registry.jobs(tenant) if j.session_id == session_id]
        return sorted(jobs, key=lambda j: j.created_at)


def _signed_path(tenant: str, session_id: str) -> str:
    return f"session-trace/{tenant}/{session_id}"
