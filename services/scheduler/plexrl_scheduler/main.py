"""The scheduler's entry point: ingest → decide → act, on one screen."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from plexrl.dead_letters import DeadLetters
from plexrl.direct import DirectLeases
from plexrl.health import HttpServer, health_app
from plexrl.kafka import FetchTuning, MessageConsumer, ensure_topics
from plexrl.ledger import Ledger
from plexrl.messages import Event, PhaseCompletion, PhaseRequest
from plexrl.policy import PolicyConfig, decide
from plexrl.service import join_cluster
from plexrl.settings import SchedulerSettings
from plexrl.stores import JobStore
from plexrl.topics import Topics
from plexrl_scheduler import metrics
from plexrl_scheduler.actuator import Actuator
from plexrl_scheduler.direct import DirectConfig, DirectPath
from plexrl_scheduler.liveness import Liveness, LivenessConfig
from plexrl_scheduler.loop import ControlLoop, Step
from plexrl_scheduler.pipeline import FollowUps, PipelineConfig
from plexrl_scheduler.receiver import Receiver
from plexrl_scheduler.state import ClusterState

log = logging.getLogger("plexrl.scheduler")

COMPLETIONS_FETCH = FetchTuning(max_wait_ms=5, min_bytes=16 * 1024)
"""The scheduler's completions: a fetch waits up to 5 ms for 16 KiB (some 40 completions)
of records, so at thousands of calls a second it fetches a few hundred times a second,
not once per record; a dispatch's end is seen at most 5 ms later."""


async def serve(settings: SchedulerSettings, stop: asyncio.Event) -> None:
    topics, stores, publisher = await join_cluster(settings, "plexrl-scheduler")
    state = ClusterState(worker_timeout_s=settings.worker_timeout_s, burst_gap_s=settings.hold_s)
    await restore(state, stores.jobs)
    policy = PolicyConfig(
        name=settings.policy,
        max_calls_per_run=settings.max_calls_per_run,
        pack=settings.pack_groups,
        hold_s=settings.hold_s,
        preempt_ratio=settings.preempt_ratio,
        fair_share=settings.fair_share,
        roam=settings.roam_samples,
    )
    direct = DirectPath(
        state,
        DirectLeases(stores.keys.redis, settings.cluster_id),
        DirectConfig(ttl_s=settings.direct_lease_s, grace_s=settings.lease_grace_s),
    )
    await direct.restore(list(state.jobs))  # leases this scheduler knows nothing of
    receiver = Receiver(state, stores.jobs, stores.usage, direct)
    ledger = Ledger(stores.keys.redis, settings.cluster_id)
    actuator = Actuator(
        state,
        publisher,
        stores.jobs,
        stores.calls,
        topics,
        finished=receiver.finished,
        ledger=ledger,
        direct=direct,
    )
    liveness = Liveness(state, ledger, LivenessConfig(lease_grace_s=settings.lease_grace_s), direct)
    follow_ups = FollowUps(
        state,
        actuator,
        PipelineConfig(depth=settings.dispatch_depth, max_calls=settings.max_calls_per_run),
    )
    receiver.use(actuator)
    # Dispatches and answers must go out: wait out a broker that is away.
    publisher.retry_until(stop)

    dead_letters = DeadLetters(stores.calls, stores.keys, publisher, topics.completions)

    def consumer(topic: str, group: str | None, type_: Any, handler: Any, **kw: Any) -> Any:
        return MessageConsumer(
            bootstrap=settings.kafka_bootstrap,
            topics=[topic],
            group=group,
            message_type=type_,
            handler=handler,
            dlq=(publisher, topics.dlq),
            name=f"scheduler-{topic}",
            answer=dead_letters,
            **kw,
        )

    consumers = [
        requests := consumer(
            topics.requests,
            topics.group("scheduler-requests"),
            PhaseRequest,
            receiver.on_request,
            commit_after_handler=False,
            skipped=receiver.finished,
        ),
        consumer(
            topics.completions,
            topics.group("scheduler-completions"),
            PhaseCompletion,
            receiver.on_completion,
            after_batch=receiver.flush_usage,  # one Redis round trip per poll
            # Fuller fetches, fewer of them: the gateways answer calls from their own
            # consumers; the scheduler may see a completion a few milliseconds late.
            fetch=COMPLETIONS_FETCH,
        ),
        consumer(topics.events, None, Event, receiver.on_event, from_latest=True),
    ]
    receiver.attach(requests)

    pace = Pace()

    async def record() -> None:
        metrics.observe(state)

    loop = ControlLoop(  # each step guarded: a failure is logged, the next pass retries
        [
            Step("topics", lambda: ensure_worker_topics(settings, topics, receiver)),
            # Dead workers and lost dispatches give calls back (timeouts of seconds).
            Step("reap", liveness.reap, every_s=0.1),
            Step("decide and act", lambda: decide_and_act(state, policy, actuator, pace)),
            # A running job's next calls behind its dispatch, when no other job waits there.
            Step("follow-ups", follow_ups.step),
            # Grants where a job's dispatch just ended, renewals, revocations on demand.
            Step("direct leases", direct.step),
            Step("record", record, every_s=0.5),
        ]
    )
    health = HttpServer(
        health_app(
            "scheduler",
            lambda: status(state, actuator, liveness, loop) | {"direct": direct.status()},
            consumers,
            detail=lambda: status(state, actuator, liveness, loop) | inflight(state),
            token=settings.service_token,
        ),
        settings.scheduler_host,
        settings.scheduler_port,
    )
    await publisher.start()
    for c in consumers:
        await c.start()
    await health.start()
    tasks = [asyncio.create_task(c.run(stop)) for c in consumers]
    log.info("scheduler up: policy=%s cluster=%s", policy.name, settings.cluster_id)
    try:
        # ingest: the consumers, in their tasks; a pass when they changed something
        await loop.run(stop, lambda: state.wait_changed(pace.wait_s(state.everything_due)))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in consumers:
            with contextlib.suppress(Exception):
                await c.stop()
        await health.stop()
        await publisher.stop()
        await stores.close()
        log.info("scheduler stopped")


class Pace:
    """How long the loop waits for news before deciding again: half a second, or until
    the earliest hold on a group ends (`plexrl.policy.Decision.wake_at`); and when a
    decision looks at every group rather than only those events touched.

    A decision on the whole cluster costs time in its size (tens of milliseconds at a
    thousand jobs): a scheduler that made one per event would spend itself on them at
    thousands of calls a second. So whole decisions take at most `whole_share` of the
    loop's time, and between them a decision reads only the groups events touched
    (`ClusterState.take_touched`). On a small cluster a whole decision costs less than
    an event's other work and every decision is whole, as before; on a large one, what
    changes only with the clock (a batch turning preemptible, a job turning dormant, a
    waiting job's admission) is seen at the next whole decision, at most
    `took / whole_share` after the last one."""

    def __init__(
        self,
        idle_s: float = 0.5,
        whole_share: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s = idle_s
        self.whole_share = whole_share
        self.wake_at: float | None = None
        self._clock = clock
        self._next_whole = 0.0

    def wait_s(self, whole_due: bool = False) -> float:
        """Seconds to wait for news; `whole_due`: a change waits for a whole decision."""
        wait = self.idle_s
        if self.wake_at is not None:
            wait = min(wait, max(self.wake_at - time.time(), 0.0))
        if whole_due:
            wait = min(wait, max(self._next_whole - self._clock(), 0.0))
        return wait

    def whole_now(self) -> bool:
        return self._clock() >= self._next_whole

    def decided(self, whole: bool, took_s: float) -> None:
        """A decision took `took_s` (snapshot and policy); `whole`: on every group."""
        if whole:
            self._next_whole = self._clock() + took_s / self.whole_share


async def decide_and_act(
    state: ClusterState, policy: PolicyConfig, actuator: Actuator, pace: Pace
) -> None:
    started = time.perf_counter()
    groups = state.take_touched(pace.whole_now())
    if groups is not None and not groups:
        pace.wake_at = None
        return  # nothing touched since the last decision
    decision = decide(state.snapshot(groups), policy)
    pace.wake_at = decision.wake_at
    state.touch_again(decision.held)  # decided again at the next pass, when its hold may end
    pace.decided(groups is None, time.perf_counter() - started)
    await actuator.carry_out(decision.plan)
    if decision.held:
        metrics.HOLDING_PASSES.inc()


async def restore(state: ClusterState, jobs: JobStore) -> None:
    """After a restart: the jobs and homes recorded in Redis (tiers come with heartbeats)."""
    homes = await jobs.homes()
    for job in await jobs.all_jobs():
        if not job.unloaded and job.owner_job is None:
            added = state.add_job(job.job_id, job.tenant, job.spec, homes.get(job.job_id))
            added.staleness = job.staleness


async def ensure_worker_topics(
    settings: SchedulerSettings, topics: Topics, receiver: Receiver
) -> None:
    if receiver.new_workers:
        wanted = {topics.dispatch(w): 1 for w in receiver.new_workers}
        wanted |= {topics.control(w): 1 for w in receiver.new_workers}
        await ensure_topics(settings.kafka_bootstrap, wanted)
        receiver.new_workers.clear()  # only once created: a failure is retried next pass


def status(
    state: ClusterState, actuator: Actuator, liveness: Liveness, loop: ControlLoop
) -> dict[str, Any]:
    return {
        "ok": True,
        "loop": loop.health(),
        "workers": {w: state.healthy(w) for w in state.workers},
        "jobs": len(state.jobs),
        "pending": len(state.pending),
        # A count: /healthz is open inside the cluster and job ids are tenants' (which
        # job each worker runs is on the token-guarded /status, for the gateway).
        "inflight_dispatches": len(state.inflight),
        "dispatches": actuator.dispatches,
        "rehomed": liveness.rehomed,
        "requeued": liveness.requeued,
    }


def inflight(state: ClusterState) -> dict[str, Any]:
    """Which job each busy worker runs: on /status (beside the health body), for the
    gateway to show each tenant its own."""
    return {"inflight": {w: r.job_id for w, r in state.inflight.items()} | state.held}
