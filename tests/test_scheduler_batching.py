"""The scheduler at many calls a second: decisions on the groups events touched, usage
written once per poll, and passes that skip clock-paced steps. Fake clock, no Kafka."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import TopicPartition
from msgspec.structs import replace

from plexrl import tracing
from plexrl.kafka import LOW_LATENCY, Delivery
from plexrl.ledger import Ledger
from plexrl.messages import (
    CompletionStatus,
    Dispatch,
    Function,
    JobSpec,
    NoopInput,
    PhaseCompletion,
    PhaseRequest,
    Timings,
    WorkerHeartbeat,
)
from plexrl.policy import PolicyConfig, Run, decide
from plexrl.topics import Topics
from plexrl_scheduler.actuator import Actuator
from plexrl_scheduler.loop import ControlLoop, Step
from plexrl_scheduler.main import COMPLETIONS_FETCH, Pace, completions_fetch
from plexrl_scheduler.offsets import OffsetTracker
from plexrl_scheduler.pipeline import FollowUps, PipelineConfig
from plexrl_scheduler.receiver import Receiver
from plexrl_scheduler.state import ClusterState

SPEC = JobSpec(base_model="m", state_bytes=10)
POLICY = PolicyConfig(name="plexrl", pack=False)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def beat(worker: str) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        device="cpu",
        device_bytes=100,
        host_bytes=100,
        base_models=["m"],
        resident=[],
        busy=False,
        started_at=0.0,
        sent_at=0.0,
    )


def req(rid: str, job: str, tenant: str = "t") -> PhaseRequest:
    return PhaseRequest(
        request_id=rid,
        job_id=job,
        tenant=tenant,
        function=Function.NOOP,
        payload=NoopInput(),
        arrival_time=1.0,
    )


def done(rid: str, job: str, compute_s: float, finished_at: float) -> PhaseCompletion:
    return PhaseCompletion(
        request_id=rid,
        job_id=job,
        tenant="t",
        worker_id="w0",
        function=Function.NOOP,
        status=CompletionStatus.OK,
        timings=Timings(queue_s=0.5, swap_s=0.25, compute_s=compute_s),
        finished_at=finished_at,
    )


def two_groups(clock: Clock) -> ClusterState:
    state = ClusterState(clock=clock)
    for w in ("w0", "w1"):
        state.on_heartbeat(beat(w))
    for j, w in (("a", "w0"), ("b", "w0"), ("c", "w1")):
        state.add_job(j, "t", SPEC, w)
    return state


def runs(plan: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    return sorted((a.worker_id, a.job_id, a.request_ids) for a in plan if isinstance(a, Run))


def test_an_event_touches_only_its_group_and_its_decision_matches_the_whole_one() -> None:
    clock = Clock()
    state = two_groups(clock)
    assert state.take_touched(False) == {"w0", "w1"} and state.everything_due
    assert state.take_touched(True) is None and not state.everything_due
    state.on_request(req("r1", "c"), None)
    state.on_request(req("r2", "a"), None)
    state.on_request(req("r3", "c"), None)
    groups = state.take_touched(False)
    assert groups == {"w0", "w1"} and not state.take_touched(False)

    part = state.snapshot({"w1"})
    assert set(part.workers) == {"w1"} and set(part.jobs) == {"c"}
    assert [c.request_id for c in part.pending] == ["r1", "r3"]  # in the queue's order
    whole = decide(state.snapshot(), POLICY).plan
    one = decide(part, POLICY).plan
    assert runs(one) == [r for r in runs(whole) if r[0] == "w1"] == [("w1", "c", ("r1", "r3"))]


def test_a_job_without_a_home_asks_for_a_whole_decision() -> None:
    state = two_groups(Clock())
    state.take_touched(True)
    state.add_job("new", "t", SPEC, None)
    state.on_request(req("r1", "new"), None)
    assert state.everything_due
    assert state.take_touched(False) == set()  # nothing a group's own decision could admit


def test_requeued_calls_go_to_the_front_of_a_groups_queue() -> None:
    clock = Clock()
    state = two_groups(clock)
    state.on_request(req("r1", "a"), None)
    state.on_request(req("r2", "a"), None)
    taken = state.take_pending(("r1",))
    state.apply_run("d1", "w0", "a", taken, ())
    state.on_request(req("r3", "a"), None)
    state.requeue("w0")
    assert [c.request_id for c in state.snapshot({"w0"}).pending] == ["r1", "r2", "r3"]
    assert list(state.pending) == ["r1", "r2", "r3"]


def test_tenants_turns_read_the_tenants_last_served_job_elsewhere() -> None:
    clock = Clock()
    state = two_groups(clock)
    state.on_request(req("r1", "c"), None)
    state.apply_run("d1", "w1", "c", state.take_pending(("r1",)), ())
    clock.t += 1
    state.on_completion(done("r1", "c", 0.1, clock.t))
    state.on_request(req("r2", "a"), None)
    part = state.snapshot({"w0"})
    assert set(part.workers) == {"w0"}
    assert set(part.jobs) == {"a", "b", "c"} and part.jobs["c"].last_active == clock.t


async def test_completions_of_one_poll_are_written_as_one_usage_transaction() -> None:
    class Usage:
        def __init__(self) -> None:
            self.writes: list[dict[str, tuple[dict[str, float], float, float]]] = []

        async def add_usages(
            self, usages: dict[str, tuple[dict[str, float], float, float]]
        ) -> None:
            self.writes.append(usages)

    clock = Clock()
    state = two_groups(clock)
    usage = Usage()
    receiver = Receiver(state, jobs=None, usage=usage)  # type: ignore[arg-type]
    for offset, rid in enumerate(("r1", "r2")):
        state.on_request(req(rid, "a"), Delivery("requests", 0, offset))
    state.apply_run("d1", "w0", "a", state.take_pending(("r1", "r2")), ())
    delivery = Delivery("completions", 0, 0)
    await receiver.on_completion(done("r1", "a", 1.0, 10.0), delivery)
    await receiver.on_completion(done("r2", "a", 2.0, 12.0), delivery)
    assert not usage.writes and "w0" not in state.inflight  # the state took both at once
    await receiver.flush_usage()
    await receiver.flush_usage()  # nothing new: no write
    assert len(usage.writes) == 1
    fields, first, last = usage.writes[0]["a"]
    assert (first, last) == (10.0, 12.0)
    assert fields == {
        "calls": 2.0,
        "queue_s": 1.0,
        "swap_s": 0.5,
        "compute_s": 3.0,
        "device_s": 3.5,
    }


async def test_a_clock_paced_step_runs_at_most_once_per_interval() -> None:
    clock = Clock()
    ran: list[str] = []

    async def reap() -> None:
        ran.append("reap")

    async def decide() -> None:
        ran.append("decide")

    loop = ControlLoop([Step("reap", reap, every_s=0.1), Step("decide", decide)], clock=clock)
    await loop.run_pass()
    clock.t += 0.05
    await loop.run_pass()
    clock.t += 0.06
    await loop.run_pass()
    assert ran == ["reap", "decide", "decide", "reap", "decide"]


def test_offsets_commit_past_the_lowest_open_one_out_of_order() -> None:
    tp = TopicPartition("requests", 0)
    offsets = OffsetTracker()
    for o in range(10, 15):
        offsets.seen(tp, o)
    assert offsets.finished(tp, 12) is None
    assert offsets.finished(tp, 10) == 11
    assert offsets.finished(tp, 11) == 13  # 12 was finished already
    assert offsets.finished(tp, 14) is None
    assert offsets.finished(tp, 13) == 15


def test_whole_decisions_take_at_most_their_share_of_the_time() -> None:
    clock = Clock()
    pace = Pace(idle_s=0.5, whole_share=0.05, clock=clock)
    assert pace.whole_now()
    pace.decided(True, 0.010)  # a whole decision of 10 ms: the next one 200 ms on
    clock.t += 0.1
    assert not pace.whole_now()
    assert pace.wait_s() == 0.5 and abs(pace.wait_s(whole_due=True) - 0.1) < 1e-9
    pace.decided(False, 0.001)  # decisions on touched groups do not move it
    clock.t += 0.1
    assert pace.whole_now() and pace.wait_s(whole_due=True) == 0.0


def test_completions_are_fetched_in_fuller_fetches_only_while_leases_carry_every_call() -> None:
    assert completions_fetch(queued=False, running=False, leased=True) == COMPLETIONS_FETCH
    assert COMPLETIONS_FETCH.min_bytes > 1 and COMPLETIONS_FETCH.max_wait_ms <= 5
    # A call waits, a dispatch runs, or nothing is leased: at the first record.
    for queued, running, leased in [
        (True, False, True),
        (False, True, True),
        (False, False, False),
    ]:
        assert completions_fetch(queued, running, leased) == LOW_LATENCY
    assert LOW_LATENCY.min_bytes == 1


class Producer:
    """The actuator's Kafka edge: records the dispatches it would send."""

    def __init__(self) -> None:
        self.sent: list[Dispatch] = []

    async def publish(
        self, topic: str, key: Any, message: Any, headers: tracing.Headers | None = None
    ) -> None:
        self.sent.append(message)


def follow_ups(
    state: ClusterState, depth: int = 2, policy: PolicyConfig = POLICY
) -> tuple[FollowUps, Producer]:
    producer = Producer()
    actuator = Actuator(
        state,
        producer,
        None,  # type: ignore[arg-type]  # no admissions here
        None,  # type: ignore[arg-type]  # no refusals here
        Topics("t"),
        finished=lambda _: asyncio.sleep(0),
        ledger=Ledger(aioredis.Redis(), "t"),  # NOOPs: nothing to number
    )
    return FollowUps(state, actuator, PipelineConfig(depth=depth), policy), producer


def following(state: ClusterState, worker: str = "w0") -> tuple[str, ...]:
    """What the pipeline would send behind the worker's dispatch now."""
    return follow_ups(state)[0].calls(worker)


async def test_a_running_jobs_next_calls_follow_its_dispatch_when_no_other_job_waits() -> None:
    clock = Clock()
    state = two_groups(clock)
    state.apply_admit("a", "w0", epoch=1)
    for n in range(3):
        state.on_request(req(f"r{n}", "a"), None)
    state.apply_run("d1", "w0", "a", state.take_pending(("r0",)), ())
    pipeline, producer = follow_ups(state)
    await pipeline.step()
    ((sent,),) = [producer.sent]
    assert [c.request_id for c in sent.calls] == ["r1", "r2"] and sent.worker_id == "w0"
    assert sent.lease is not None and sent.lease.epoch == 1
    state.on_request(req("r3", "a"), None)
    await pipeline.step()
    assert len(producer.sent) == 1  # two dispatches in flight: the depth
    for n in range(3):
        state.on_completion(done(f"r{n}", "a", 0.01, clock.t))
        assert ("w0" in state.inflight) == (n < 2)  # free once the follow-up is answered
    assert state.take_freed()["w0"].dispatches == 2


async def test_no_call_follows_while_another_job_waits_for_the_worker_or_past_a_sample() -> None:
    clock = Clock()
    state = two_groups(clock)
    state.apply_admit("a", "w0", epoch=1)
    for rid, fn in (("r0", Function.NOOP), ("r1", Function.NOOP), ("r2", Function.SAMPLE)):
        state.on_request(replace(req(rid, "a"), function=fn), None)
    state.apply_run("d1", "w0", "a", state.take_pending(("r0",)), ())
    assert following(state) == ("r1",)  # the sample is the policy's to batch
    state.on_request(req("rb", "b"), None)  # another job homed on w0 now waits
    pipeline, producer = follow_ups(state)
    await pipeline.step()
    assert producer.sent == [] and following(state) == ()


async def test_a_follow_up_stops_at_the_policys_quantum_and_never_follows_a_sample_batch() -> None:
    clock = Clock()
    state = two_groups(clock)
    for job, worker in (("a", "w0"), ("c", "w1")):
        state.apply_admit(job, worker, epoch=1)
        for n in range(4):
            state.on_request(req(f"{job}{n}", job), None)
        state.apply_run(f"d{job}", worker, job, state.take_pending((f"{job}0",)), ())
    # a shares w0 with b: its Run stops at the quantum (each NOOP expected 0.05 s), so
    # only one more call fits beside the running one; c is alone on w1: no quantum.
    pipeline, producer = follow_ups(state, policy=PolicyConfig(name="plexrl", quantum_s=0.12))
    await pipeline.step()
    sent = {d.worker_id: [c.request_id for c in d.calls] for d in producer.sent}
    assert sent == {"w0": ["a1"], "w1": ["c1", "c2", "c3"]}

    batch = two_groups(clock)
    batch.apply_admit("c", "w1", epoch=1)
    batch.on_request(replace(req("s0", "c"), function=Function.SAMPLE), None)
    batch.apply_run("ds", "w1", "c", batch.take_pending(("s0",)), ())
    batch.on_request(req("t1", "c"), None)  # its training, queued behind its rollout
    pipeline, producer = follow_ups(batch)
    await pipeline.step()
    assert producer.sent == [] and following(batch, "w1") == ()


def test_a_follow_up_whose_dispatch_ended_while_it_was_numbered_is_a_dispatch_of_its_own() -> None:
    clock = Clock()
    state = two_groups(clock)
    state.apply_admit("a", "w0", epoch=1)
    for n in range(2):
        state.on_request(req(f"r{n}", "a"), None)
    state.apply_run("d1", "w0", "a", state.take_pending(("r0",)), ())
    taken = state.take_pending(following(state))
    state.on_completion(done("r0", "a", 0.01, clock.t))  # (while the ledger numbered r1)
    state.apply_follow_up("d2", "w0", "a", taken)
    assert state.inflight["w0"].dispatch_id == "d2" and state.dispatched("r1")
    state.on_completion(done("r1", "a", 0.01, clock.t))
    assert "w0" not in state.inflight and not state.knows_request("r1")


def test_a_groups_call_is_charged_to_every_rank_of_it() -> None:
    from plexrl_scheduler.receiver import UsageDue

    due = UsageDue()
    due.add(done("r1", "a", compute_s=1.0, finished_at=5.0), devices=2)
    due.add(done("r2", "a", compute_s=0.5, finished_at=6.0))
    fields, first, last = due.take()["a"]
    # Seconds the group held: (0.25 + 1.0) on 2 ranks, then (0.25 + 0.5) on one.
    assert fields["device_s"] == 2 * 1.25 + 0.75 and fields["compute_s"] == 1.5
    assert (first, last) == (5.0, 6.0) and fields["calls"] == 2.0


class HeldProducer:
    """A producer whose sends wait until `release` (one broker acknowledgement each)."""

    def __init__(self, failing: str = "") -> None:
        self.started: list[str] = []
        self.acknowledged: list[str] = []
        self.release = asyncio.Event()
        self._failing = failing

    async def publish(
        self, topic: str, key: Any, message: Any, headers: tracing.Headers | None = None
    ) -> None:
        self.started.append(topic)
        await self.release.wait()
        if topic == self._failing:
            raise ConnectionError("the broker went away")
        self.acknowledged.append(topic)


def three_runs(producer: HeldProducer) -> tuple[Actuator, tuple[Run, ...]]:
    """Runs of a (w0), c (w1) and b (w0 again), each with one queued call."""
    state = two_groups(Clock())
    for offset, (rid, job) in enumerate((("ra", "a"), ("rc", "c"), ("rb", "b"))):
        state.apply_admit(job, state.jobs[job].home or "", epoch=1)
        state.on_request(req(rid, job), Delivery("requests", 0, offset))
    actuator = Actuator(
        state,
        producer,
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Topics("t"),
        finished=lambda _: asyncio.sleep(0),
        ledger=Ledger(aioredis.Redis(), "t"),  # NOOPs: nothing to number
    )
    return actuator, (Run("w0", "a", ("ra",)), Run("w1", "c", ("rc",)), Run("w0", "b", ("rb",)))


async def test_a_pass_waits_for_its_dispatches_to_different_workers_at_once() -> None:
    producer = HeldProducer()
    actuator, plan = three_runs(producer)
    carrying = asyncio.create_task(actuator.carry_out(plan))
    for _ in range(10):
        await asyncio.sleep(0)
    # w0's and w1's dispatches both wait for the broker; w0's second waits for its first.
    assert producer.started == ["t.dispatch.w0", "t.dispatch.w1"]
    producer.release.set()
    await carrying
    assert producer.acknowledged == ["t.dispatch.w0", "t.dispatch.w1", "t.dispatch.w0"]
    assert actuator.dispatches == 3


async def test_a_failed_dispatch_fails_the_pass_after_the_others_went_out() -> None:
    producer = HeldProducer(failing="t.dispatch.w0")
    producer.release.set()
    actuator, plan = three_runs(producer)
    with pytest.raises(ConnectionError):
        await actuator.carry_out(plan)
    assert producer.acknowledged == ["t.dispatch.w1"]  # and the plan's rest waits
