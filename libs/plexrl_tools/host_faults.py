"""Host and link faults on the host bed, Jepsen style: a fixed workload runs while a host
is cut off, killed, or its link made lossy and slow, and is compared with an undisturbed
run (plexrl_tools.faults: calls lost, optimizer steps applied twice, jobs not bit-identical).

The kinds (`KINDS`):

- `worker-partition`: the host of the worker the first job runs on is cut off for
  `hold_s` (longer than the heartbeat timeout), then healed: its jobs are re-homed and
  their epochs bumped, so whatever it finishes late is refused;
- `leader-partition`: the leading scheduler's host is cut off until another scheduler
  leads (and a little longer), then healed; the old leader steps down to a standby;
- `broker-host-kill`: every process of a Kafka broker's host killed at once (the host
  is also cut off: a dead machine answers nothing), then the host revived;
- `redis-primary-host-kill`: the same for the Redis primary's host; the Sentinels
  promote a replica (the other follows it), and the host comes back as a replica;
- `redis-primary-partition`: the Redis primary's host cut off until the Sentinels
  promote a replica (and a little longer), then healed: the old primary rejoins as a
  replica, and what it alone took meanwhile (nothing confirmed) is dropped;
- `lossy-link`: `loss` of the packets in and out of the first job's worker host
  dropped and those it sends held `delay_ms`, for `lossy_s`.

Each run reports the stall the jobs saw (the longest gap between a job's steps after the
fault began, less an undisturbed step), and per kind how long the cluster took to
recover what it lost: a new leader, a new primary, the workers' jobs re-homed.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from plexrl_tools.faults import (
    Checkpoints,
    Comparison,
    JobOutcome,
    Workload,
    compare,
    differences,
    run_workload,
)
from plexrl_tools.hostbed import HostBed

KINDS = (
    "worker-partition",
    "leader-partition",
    "lossy-link",
    "broker-host-kill",
    "redis-primary-host-kill",
    "redis-primary-partition",
)


@dataclass(frozen=True)
class FaultConfig:
    """How long each fault lasts."""

    hold_s: float = 8.0
    """A worker's host stays cut off this long: above the bed's heartbeat timeout."""
    leader_grace_s: float = 2.0
    """A leader's host stays cut off this long after another scheduler leads."""
    lossy_s: float = 20.0
    """How long the link stays lossy and slow."""
    loss: float = 0.1
    delay_ms: float = 50.0
    failover_limit_s: float = 120.0
    """Longest the runner waits for a failover it measures."""


@dataclass
class FaultRun:
    kind: str
    host: str
    comparison: Comparison
    stall_s: float
    """The longest a job waited for a step after the fault began, less an ordinary step."""
    failover_s: float | None = None
    """Per kind: until another scheduler led, the Sentinels named a new primary, the
    worker's jobs were re-homed (None: nothing to fail over, or it never did)."""
    notes: dict[str, Any] = field(default_factory=dict)


def home_of(bed: HostBed, model_id: str) -> str | None:
    """The worker a job is homed on (from Redis, through the Sentinels)."""
    with bed.redis_target().connect_sync() as redis:
        raw = redis.get(f"{bed.cluster_id}:home:{model_id}")
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


def epoch_of(bed: HostBed, model_id: str) -> int:
    with bed.redis_target().connect_sync() as redis:
        raw = redis.hget(f"{bed.cluster_id}:ledger:{model_id}", "epoch")
    return int(raw) if raw is not None else 0


def health(url: str) -> dict[str, Any]:
    try:
        body: dict[str, Any] = httpx.get(f"{url}/healthz", timeout=2.0).json()
        return body
    except (httpx.HTTPError, ValueError):
        return {}


def wait_until(check: Callable[[], bool], limit_s: float, every_s: float = 0.1) -> float | None:
    """Seconds until `check()` holds (None: not within `limit_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if check():
            return time.monotonic() - start
        time.sleep(every_s)
    return None


class HostFaults:
    """Runs the workload once per fault on one bed, against one reference run."""

    def __init__(
        self,
        bed: HostBed,
        service: Any,
        checkpoints: Checkpoints,
        tenant: str,
        workload: Workload,
        reference: list[JobOutcome],
        config: FaultConfig | None = None,
    ) -> None:
        self.bed = bed
        self.service = service
        self.checkpoints = checkpoints
        self.tenant = tenant
        self.workload = workload
        self.reference = reference
        self.config = config or FaultConfig()
        self.step_s = statistics.median(s for o in reference for s in o.call_s)

    def run(
        self, kind: str, at_step: int = 1, delay_s: float = 0.0, revive: bool = True
    ) -> FaultRun:
        """One disturbed run: the fault begins `delay_s` after the first job's step
        `at_step` (the lossy link: before the run), and is undone before this returns (a
        killed host revived, unless `revive` is False: the bed's last fault)."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; the kinds are {', '.join(KINDS)}")
        done_at: dict[int, list[float]] = {s: [] for s in self.workload.seeds}
        lock = threading.Lock()
        injected: dict[str, Any] = {}

        def inject(model_id: str) -> None:
            time.sleep(delay_s)
            with lock:
                injected["at"] = time.monotonic()
                injected["before"] = {s: len(t) for s, t in done_at.items()}
            injected.update(self._inject(kind, model_id))

        def on_step(job: JobOutcome, step: int) -> None:
            with lock:
                done_at[job.seed].append(time.monotonic())
            if kind != "lossy-link" and job.seed == self.workload.seeds[0] and step == at_step:
                injected["thread"] = threading.Thread(target=inject, args=(job.model_id,))
                injected["thread"].start()

        undo: Callable[[], None] = lambda: None  # noqa: E731
        if kind == "lossy-link":
            host = self.bed.host_of("worker-0")
            self.bed.degrade(host, self.config.loss, self.config.delay_ms)
            injected.update(at=time.monotonic(), host=host, before={s: 0 for s in done_at})
            undo = lambda: self.bed.heal(host)  # noqa: E731
        try:
            outcomes = run_workload(
                self.service, self.workload, self.checkpoints, self.tenant, on_step
            )
            if kind == "lossy-link":
                left = self.config.lossy_s - (time.monotonic() - injected["at"])
                time.sleep(max(0.0, left))
        finally:
            if "thread" in injected:
                injected["thread"].join()
            undo()
            self._undo(kind, injected, revive)
        stall = self._stall(done_at, injected)
        notes = {
            k: v
            for k, v in injected.items()
            if k in ("leader", "primary", "worker", "fenced", "revive_s")
        }
        errors = [e for o in outcomes for e in o.errors]
        if errors:  # what the client saw: a lost call says why
            notes["errors"] = errors
        differ = differences(self.reference, outcomes)
        if differ:
            notes["differ"] = differ
        return FaultRun(
            kind=kind,
            host=str(injected.get("host", "")),
            comparison=compare(self.reference, outcomes),
            stall_s=stall,
            failover_s=injected.get("failover_s"),
            notes=notes,
        )

    def _stall(self, done_at: dict[int, list[float]], injected: dict[str, Any]) -> float:
        if "at" not in injected:
            return 0.0
        at, before = injected["at"], injected["before"]
        stalls = []
        for seed, times in done_at.items():
            marks = [at, *times[before[seed] :]]
            stalls += [b - a for a, b in itertools.pairwise(marks)]
        return max(0.0, max(stalls, default=0.0) - self.step_s)

    def _inject(self, kind: str, model_id: str) -> dict[str, Any]:
        """Begin the fault; a partition is also healed here, after its hold (the run may
        need the host back to finish); a killed host is revived after the run."""
        bed, config = self.bed, self.config
        if kind == "worker-partition":
            worker = home_of(bed, model_id) or "worker-0"
            host = bed.host_of(worker)
            epoch = epoch_of(bed, model_id)
            bed.partition(host)
            try:
                failover = wait_until(lambda: epoch_of(bed, model_id) > epoch, config.hold_s)
                time.sleep(max(0.0, config.hold_s - (failover or config.hold_s)))
            finally:
                bed.heal(host)
            url = bed.url_of(worker)
            # Back: the worker answers again, and finds (by the ledger) its jobs moved.
            wait_until(lambda: bool(health(url)), 60.0)
            fenced = health(url).get("fenced_calls")
            return {"host": host, "worker": worker, "failover_s": failover, "fenced": fenced}
        if kind == "leader-partition":
            leader = bed.scheduler_leader() or "scheduler-a"
            host = bed.host_of(leader)
            others = [n for n, _ in bed.layout.of_kind("scheduler") if n != leader]
            bed.partition(host)
            try:
                failover = wait_until(
                    lambda: any(health(bed.url_of(n)).get("role") == "leader" for n in others),
                    config.failover_limit_s,
                )
                time.sleep(config.leader_grace_s)
            finally:
                bed.heal(host)
            url = bed.url_of(leader)
            wait_until(lambda: health(url).get("role") == "standby", 60.0)
            return {"host": host, "leader": leader, "failover_s": failover}
        if kind == "broker-host-kill":
            host = next(
                h
                for h in reversed(bed.layout.brokers)
                if h not in (bed.redis_primary(), bed.host_of(bed.scheduler_leader() or ""))
            )
            bed.kill_host(host)
            return {"host": host}
        if kind == "redis-primary-partition":
            host = bed.redis_primary()
            bed.partition(host)
            try:
                failover = wait_until(
                    lambda: _primary_or_none(bed) not in (None, host),
                    config.failover_limit_s,
                    0.2,
                )
                time.sleep(config.leader_grace_s)
            finally:
                bed.heal(host)
            return {"host": host, "failover_s": failover, "primary": host}
        # redis-primary-host-kill
        host = bed.redis_primary()
        bed.kill_host(host)
        failover = wait_until(lambda: _primary_or_none(bed) not in (None, host), 60.0, 0.2)
        return {"host": host, "failover_s": failover, "primary": host}

    def _undo(self, kind: str, injected: dict[str, Any], revive: bool) -> None:
        """After the run: a killed host revived (unless `revive` is False)."""
        host = injected.get("host")
        if host and kind.endswith("-host-kill") and revive:
            started = time.monotonic()
            self.bed.revive_host(host)
            injected["revive_s"] = time.monotonic() - started


def _primary_or_none(bed: HostBed) -> str | None:
    try:
        return bed.redis_primary()
    except RuntimeError:
        return None
