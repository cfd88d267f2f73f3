"""The scheduler's entry point: ingest → decide → act, on one screen."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from fastapi import HTTPException

from plexrl.dead_letters import DeadLetters
from plexrl.direct import DirectLeases
from plexrl.health import HttpServer, health_app
from plexrl.kafka import (
    LOW_LATENCY,
    ConsumerTuning,
    FetchTuning,
    MessageConsumer,
    Publisher,
    ensure_topics,
)
from plexrl.lease import Fence, Term
from plexrl.ledger import Ledger
from plexrl.messages import Dispatch, Event, PhaseCompletion, PhaseRequest
from plexrl.policy import PolicyConfig, costs, decide, lone_pairs, reviews_alone
from plexrl.policy.costs import SharingCosts
from plexrl.retry import retrieved
from plexrl.service import join_cluster
from plexrl.settings import SchedulerSettings
from plexrl.stores import JobStore, Stores
from plexrl.topics import Topics
from plexrl_scheduler import metrics
from plexrl_scheduler.actuator import Actuator
from plexrl_scheduler.direct import DirectConfig, DirectPath
from plexrl_scheduler.leadership import SchedulerLeadership
from plexrl_scheduler.liveness import Liveness, LivenessConfig
from plexrl_scheduler.loop import ControlLoop, Step
from plexrl_scheduler.pipeline import FollowUps, PipelineConfig
from plexrl_scheduler.receiver import Receiver
from plexrl_scheduler.state import ClusterState

log = logging.getLogger("plexrl.scheduler")

COMPLETIONS_FETCH = FetchTuning(max_wait_ms=5, min_bytes=16 * 1024)
"""The scheduler's completions while direct leases carry every call: a fetch waits up
to 5 ms for 16 KiB (some 40 completions) of records, so at thousands of calls a second
it fetches a few hundred times a second, not once per record."""


def completions_fetch(queued: bool, running: bool, leased: bool) -> FetchTuning:
    """How the scheduler's completions consumer asks the broker: `queued`, calls wait in
    its queue; `running`, a dispatch of its own is in flight; `leased`, direct leases
    hold workers. Fuller fetches (`COMPLETIONS_FETCH`) only where the calls are all
    under leases, whose ends decide nothing at once; otherwise each fetch is answered
    at the first record: a dispatch's end seen 5 ms late idles its worker as long when
    a call waits for it or comes next, and a fetch held when nothing ran holds the
    first end after it (an idle consumer asks every half second, which costs nothing)."""
    return COMPLETIONS_FETCH if leased and not (queued or running) else LOW_LATENCY


async def serve(settings: SchedulerSettings, stop: asyncio.Event) -> None:
    """Join the cluster, then lead whenever this scheduler holds the lease (a standby
    meanwhile): each term is `lead`, from a fresh state."""
    topics, stores, publisher = await join_cluster(settings, "plexrl-scheduler")
    leadership = SchedulerLeadership(stores.keys, settings)
    # The leading term's view: counts for /healthz, which job runs where for /status.
    term_status: dict[str, Any] = {}
    term_inflight: dict[str, Any] = {}
    watched: list[Any] = []  # the leading term's consumers, for /healthz

    def role_status() -> dict[str, Any]:
        return {"ok": True, **leadership.status(), **term_status}

    def role_detail() -> dict[str, Any]:
        if not term_status:  # a standby: the leader has the state
            raise HTTPException(503, f"a standby scheduler; {leadership.status()}")
        return role_status() | term_inflight

    health = HttpServer(
        health_app(
            "scheduler", role_status, watched, detail=role_detail, token=settings.service_token
        ),
        settings.scheduler_host,
        settings.scheduler_port,
    )
    await publisher.start()
    await health.start()
    log.info("scheduler %s up (standby until it holds the lease)", leadership.name)

    async def term(held: Term, ended: asyncio.Event) -> None:
        await lead(
            settings,
            topics,
            stores,
            publisher,
            leadership.fence(held),
            held,
            ended,
            (term_status, term_inflight),
            watched,
        )

    try:
        await leadership.run(stop, term)
    finally:
        await health.stop()
        await publisher.stop()
        await stores.close()
        log.info("scheduler stopped")


def policy_config(settings: SchedulerSettings) -> PolicyConfig:
    """The scheduling policy's settings, as this scheduler's settings give them."""
    return PolicyConfig(
        name=settings.policy,
        max_calls_per_run=settings.max_calls_per_run,
        pack=settings.pack_groups,
        longest_first=settings.admit_longest_first,
        bound_newcomers=settings.bound_newcomers,
        budget_over_cluster=settings.budget_over_cluster,
        hold_s=settings.hold_s,
        preempt_ratio=settings.preempt_ratio,
        max_cosampled_calls=settings.max_cosampled_calls,
        prefetch=settings.prefetch,
        fair_share=settings.fair_share,
        roam=settings.roam_samples,
        rehome=settings.rehome,
        rehome_lone=settings.rehome_lone,
        review_alone=settings.review_alone,
        review_histories=settings.review_histories,
        sharing=settings.sharing(),
    )


def cluster_state(
    settings: SchedulerSettings, policy: PolicyConfig, clock: Callable[[], float] = time.time
) -> ClusterState:
    """A term's view of the cluster; it marks homes due for review only where the policy
    reviews them (the plexrl policy with re-homing on)."""
    reviews = policy.name == "plexrl" and policy.rehome
    return ClusterState(
        clock=clock,
        worker_timeout_s=settings.worker_timeout_s,
        burst_gap_s=settings.hold_s,
        review_histories=settings.review_histories,
        review_lone=policy.rehome_lone,
        dormant_s=settings.dormant_s,
        review=reviews,
    )


async def lead(
    settings: SchedulerSettings,
    topics: Topics,
    stores: Stores,
    publisher: Publisher,
    fence: Fence,
    held: Term,
    stop: asyncio.Event,
    shown: tuple[dict[str, Any], dict[str, Any]],
    watched: list[Any],
) -> None:
    """One term as leader: ingest → decide → act, until `stop` (the term ended)."""
    # The Kafka clients connect first: with a broker's host gone that takes seconds, and
    # the term's state (whose clock decides when a silent worker is dead) starts after.
    inbox = Inbox(settings, topics, publisher, stores)
    await inbox.start()
    policy = policy_config(settings)
    state = cluster_state(settings, policy)
    await restore(state, stores.jobs)
    direct = DirectPath(
        state,
        DirectLeases(stores.keys.redis, settings.cluster_id, fence),
        DirectConfig(ttl_s=settings.direct_lease_s, grace_s=settings.lease_grace_s),
    )
    await direct.restore(list(state.jobs))  # leases this scheduler knows nothing of
    receiver = Receiver(state, stores.jobs, stores.usage, direct)
    # Fenced: once a newer scheduler took the lease, this one numbers and fences nothing.
    ledger = Ledger(stores.keys.redis, settings.cluster_id, stores.keys.replicated, fence)
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
    follow_ups = FollowUps(state, actuator, PipelineConfig(depth=settings.dispatch_depth), policy)
    receiver.use(actuator)
    # Dispatches and answers must go out: wait out a broker that is away (for this term).
    publisher.retry_until(stop)
    # Every dispatch of this term carries its token: a worker skips a deposed leader's.
    publisher.stamp_with(functools.partial(stamp_dispatch, token=held.token))
    inbox.deliver_to(receiver)
    consumers = inbox.consumers

    pace = Pace()
    setting = settings.sharing()

    async def learn_costs() -> None:
        nonlocal policy
        policy = learn_costs_of(state, policy, settings.sharing_learn_samples)
        follow_ups.policy = policy
        metrics.observe_costs(policy.sharing, state.sharing)

    async def record() -> None:
        metrics.observe(state)

    async def review_alone() -> None:
        state.review_alone(lone_pairs(state.snapshot(), policy))

    async def fetch_completions() -> None:
        fetch = completions_fetch(bool(state.pending), bool(state.inflight), bool(state.held))
        inbox.completions.tune(fetch)

    steps = [
        Step("topics", lambda: ensure_worker_topics(settings, topics, receiver)),
        # Dead workers and lost dispatches give calls back (timeouts of seconds).
        Step("reap", liveness.reap, every_s=0.1),
        Step("decide and act", lambda: decide_and_act(state, policy, actuator, pace)),
        # A running job's next calls behind its dispatch, when no other job waits there.
        Step("follow-ups", follow_ups.step),
        # Grants where a job's dispatch just ended, renewals, revocations on demand.
        Step("direct leases", direct.step),
        # Fuller completions fetches only while direct leases carry every call.
        Step("completions fetch", fetch_completions),
        Step("record", record, every_s=0.5),
        # The costs of sharing the policy predicts with, as the workers measure them.
        Step("costs", learn_costs, every_s=2.0),
    ]
    if reviews_alone(policy):  # two jobs each alone that could share a worker: one reviewed
        steps.append(Step("jobs alone", review_alone, every_s=state.review_interval_s))
    loop = ControlLoop(steps)  # each step guarded: a failure is logged, the next pass retries
    watched[:] = consumers
    tasks = [asyncio.create_task(c.run(stop)) for c in consumers]

    status_out, inflight_out = shown

    def refresh() -> None:
        status_out.update(
            status(state, actuator, liveness, loop)
            | {
                "direct": direct.status(),
                "sharing": sharing_status(policy.sharing, setting, state.sharing),
            }
        )
        inflight_out.update(inflight(state))

    refresh()
    log.info(
        "scheduler leads (token %d): policy=%s cluster=%s",
        held.token,
        policy.name,
        settings.cluster_id,
    )
    learning = settings.sharing_learn_samples
    log_costs(
        "costs of sharing predicted, as set"
        + (f" (until the workers measured each {learning} times)" if learning else ""),
        policy.sharing,
    )
    try:
        # ingest: the consumers, in their tasks; a pass when they changed something
        await loop.run(stop, lambda: waited(state, pace, refresh))
    finally:
        stop.set()
        watched.clear()
        status_out.clear()
        inflight_out.clear()
        publisher.stamp_with(None)
        await _leave_groups(tasks, consumers)
        log.info("scheduler's term (token %d) ended", held.token)


_CONSUMERS_END_S = 4.0
"""How long a term's end waits for its consumers' loops (a message in hand, the last
commit: bounded by ConsumerTuning.final_commit_s), then as long for their stops: the
two inside the lease's 10 s for a term's end, with the control loop's pass before."""

_lingering: set[asyncio.Task[Any]] = set()
"""A term's consumer loops and stops still ending, held until they are done."""


async def _leave_groups(tasks: list[asyncio.Task[None]], consumers: list[Any]) -> None:
    """Out of the groups at once, all together: a consumer of a deposed leader left
    running would rejoin once its host is reachable again and take partitions.

    Each wait is bounded, so the scheduler can stand for the lease again: with a group's
    coordinator on a host that is gone, aiokafka's commits and stops can hang for
    minutes. A loop that outlasts the bound is cancelled; a stop that does is left to
    finish in the background (until then its consumer leaves its group once it has not
    polled for `max_poll_interval_ms`). The stops start even if the term's end is
    cancelled (the lease gives it `step_down_s`)."""
    try:
        if tasks:
            await asyncio.wait(tasks, timeout=_CONSUMERS_END_S)
    finally:
        for task in tasks:
            task.cancel()  # nothing, for a loop that ended
        stops = [asyncio.create_task(_stopped(c)) for c in consumers]
        for task in (*tasks, *stops):
            task.add_done_callback(retrieved)  # a loop's failure was logged where it happened
            if not task.done():
                _lingering.add(task)
                task.add_done_callback(_lingering.discard)
    if not stops:
        return
    _, unfinished = await asyncio.wait(stops, timeout=_CONSUMERS_END_S)
    if unfinished:
        log.warning(
            "%d of the term's consumers did not stop within %gs; they stop in the background",
            len(unfinished),
            _CONSUMERS_END_S,
        )


async def _stopped(consumer: MessageConsumer[Any], within_s: float = 10.0) -> None:
    """Stop a consumer, whatever its stop raises: aiokafka can end it with a cancellation
    of its own tasks, which must not end the scheduler (only its own cancellation does)."""
    try:
        await asyncio.wait_for(consumer.stop(), within_s)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
    except Exception:
        log.warning("stopping %s failed", consumer.name, exc_info=True)


class Inbox:
    """A term's three input topics (requests, completions, events), whose messages go to
    the receiver the term sets once its state exists (`deliver_to`)."""

    def __init__(
        self, settings: SchedulerSettings, topics: Topics, publisher: Publisher, stores: Stores
    ) -> None:
        self._receiver: Receiver | None = None
        dead_letters = DeadLetters(stores.calls, stores.keys, publisher, topics.completions)
        # A leader cut off stays in the groups until its session times out: the new
        # leader gets the partitions then. The brokers' least (6 s), not 10 s. A deposed
        # leader's consumer whose stop was cut short (its coordinator's host gone) leaves
        # once it has not polled for 10 s, not aiokafka's 5 minutes; a term's handlers
        # are short, so only an outage of Redis or Kafka makes a leader's consumer leave
        # and rejoin.
        tuning = ConsumerTuning(
            session_timeout_ms=6000, max_poll_interval_ms=10000, final_commit_s=3.0
        )

        def consumer(topic: str, group: str | None, type_: Any, handler: Any, **kw: Any) -> Any:
            return MessageConsumer(
                bootstrap=settings.kafka_bootstrap,
                security=settings.kafka_security(),
                topics=[topic],
                group=group,
                message_type=type_,
                handler=handler,
                dlq=(publisher, topics.dlq),
                name=f"scheduler-{topic}",
                answer=dead_letters,
                tuning=tuning,
                **kw,
            )

        self.requests: MessageConsumer[PhaseRequest] = consumer(
            topics.requests,
            topics.group("scheduler-requests"),
            PhaseRequest,
            lambda m, d: self.receiver.on_request(m, d),
            commit_after_handler=False,
            skipped=lambda d: self.receiver.finished(d),
        )
        self.completions: MessageConsumer[PhaseCompletion] = consumer(
            topics.completions,
            topics.group("scheduler-completions"),
            PhaseCompletion,
            lambda m, d: self.receiver.on_completion(m, d),
            # One Redis round trip per offset commit (every 0.25 s while busy):
            # the usage in Redis lags the calls by at most that.
            before_commit=lambda: self.receiver.flush_usage(),
            # Fuller fetches only while direct leases carry every call: each pass sets
            # the terms (`completions_fetch`); the gateways answer calls from notices.
            fetch=COMPLETIONS_FETCH,
        )
        self.consumers: list[MessageConsumer[Any]] = [
            self.requests,
            self.completions,
            consumer(
                topics.events,
                None,
                Event,
                lambda m, d: self.receiver.on_event(m, d),
                from_latest=True,
            ),
        ]

    @property
    def receiver(self) -> Receiver:
        assert self._receiver is not None, "Inbox.deliver_to(receiver) was not called"
        return self._receiver

    async def start(self) -> None:
        """Connect every consumer at once (no message is handled before `run`); where
        one fails, the others are stopped before the failure is raised."""
        started = await asyncio.gather(*(c.start() for c in self.consumers), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(_stopped(c) for c in self.consumers))
            raise failed[0]

    def deliver_to(self, receiver: Receiver) -> None:
        self._receiver = receiver
        receiver.attach(self.requests)


async def waited(state: ClusterState, pace: Pace, refresh: Callable[[], None]) -> None:
    """Wait for news (or the pace's deadline); the health body is refreshed each pass."""
    refresh()
    await state.wait_changed(pace.wait_s(state.everything_due))


def stamp_dispatch(message: Any, token: int) -> Any:
    """A dispatch leaves with its leader's term token; other messages as they are."""
    if isinstance(message, Dispatch):
        return msgspec.structs.replace(message, leader_token=token)
    return message


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


def learn_costs_of(state: ClusterState, policy: PolicyConfig, least: int) -> PolicyConfig:
    """The policy with the costs of sharing its workers measured, each `least` times
    (`plexrl.policy.costs.learned`): the pool's in its config, and in `state.sharing` those of
    a worker whose own stand apart from the pool's, which its group is predicted with."""
    beats = {wid: worker.heartbeat.sharing for wid, worker in state.workers.items()}
    # Over what it predicts with now: a cost the workers measured less since (one
    # restarted) keeps its last learned figure.
    new = costs.learned(policy.sharing, beats.values(), least)
    if costs.moved(policy.sharing, new):
        log_costs("costs of sharing now predicted, as the workers measured them", new)
        policy = dataclasses.replace(policy, sharing=new)
    own = costs.by_worker(policy.sharing, beats, state.sharing, least)
    for wid, mine in own.items():
        if state.sharing.get(wid) is not mine:
            log_costs(f"costs of sharing on {wid} now predicted, as it measured them", mine)
    for wid in state.sharing.keys() - own.keys():
        log.info("costs of sharing on %s now predicted as the pool's", wid)
    state.sharing = own
    return policy


def log_costs(what: str, sharing: SharingCosts) -> None:
    log.info(
        "%s: switch %.3g s, stragglers hold >= %.0f%% and decode %.3gx slower",
        what,
        sharing.switch_s,
        100 * sharing.tail_min_share,
        sharing.tail_contention,
    )


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
            added.declared_steps = job.steps


async def ensure_worker_topics(
    settings: SchedulerSettings, topics: Topics, receiver: Receiver
) -> None:
    if receiver.new_workers:
        wanted = {topics.dispatch(w): 1 for w in receiver.new_workers}
        wanted |= {topics.control(w): 1 for w in receiver.new_workers}
        await ensure_topics(
            settings.kafka_bootstrap,
            wanted,
            settings.topic_replication(),
            settings.kafka_security(),
        )
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


def sharing_status(
    predicted: SharingCosts, setting: SharingCosts, workers: Mapping[str, SharingCosts]
) -> dict[str, Any]:
    """The costs of sharing the policy predicts with, and those its settings give
    (they differ where the workers' measurements replaced them); by worker, those of a
    group predicted with its own worker's figures."""
    return {
        "predicted": predicted.figures(),
        "set": setting.figures(),
        "workers": {wid: costs.figures() for wid, costs in sorted(workers.items())},
    }


def inflight(state: ClusterState) -> dict[str, Any]:
    """Which job each busy worker runs: on /status (beside the health body), for the
    gateway to show each tenant its own."""
    return {"inflight": {w: r.job_id for w, r in state.inflight.items()} | state.held}
