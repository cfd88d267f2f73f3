"""The scheduler's cluster view and offset bookkeeping, with a fake clock and no Kafka."""

from __future__ import annotations

import math
import statistics
from typing import Any, cast

import msgspec
import pytest
from aiokafka import TopicPartition
from pydantic import ValidationError

from plexrl.kafka import Delivery
from plexrl.messages import (
    CompletionStatus,
    Function,
    JobSpec,
    NoopInput,
    PhaseCompletion,
    PhaseRequest,
    ReleaseReason,
    ResidentState,
    TailReleased,
    Tier,
    Timings,
    WorkerHeartbeat,
    WorkHint,
)
from plexrl.policy import Move, PolicyConfig, Run, plan
from plexrl.policy.history import CallHistory, describe, priors
from plexrl.settings import SchedulerSettings
from plexrl_scheduler.main import cluster_state, policy_config
from plexrl_scheduler.offsets import OffsetTracker
from plexrl_scheduler.state import DORMANT_S, ClusterState


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def beat(
    worker: str, resident: list[ResidentState] | None = None, busy: bool = False
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        device="cpu",
        device_bytes=100,
        host_bytes=100,
        base_models=["m"],
        resident=resident or [],
        busy=busy,
        started_at=0.0,
        sent_at=0.0,
    )


def req(rid: str, job: str, fn: Function = Function.NOOP) -> PhaseRequest:
    return PhaseRequest(
        request_id=rid, job_id=job, tenant="t", function=fn, payload=NoopInput(), arrival_time=1.0
    )


def done(
    rid: str,
    job: str,
    compute_s: float = 0.5,
    fn: Function = Function.NOOP,
    *,
    swap_s: float = 0.0,
    queue_s: float = 0.0,
    finished_at: float = 0.0,
) -> PhaseCompletion:
    return PhaseCompletion(
        request_id=rid,
        job_id=job,
        tenant="t",
        worker_id="w0",
        function=fn,
        status=CompletionStatus.OK,
        timings=Timings(queue_s=queue_s, swap_s=swap_s, compute_s=compute_s),
        finished_at=finished_at,
    )


def delivery(offset: int) -> Delivery:
    return Delivery("requests", 0, offset)


def test_offsets_commit_only_past_finished_prefix() -> None:
    tracker = OffsetTracker()
    tp = TopicPartition("requests", 0)
    for offset in (0, 1, 2):
        tracker.seen(tp, offset)
    assert tracker.finished(tp, 1) is None  # 0 still open
    assert tracker.finished(tp, 0) == 2  # 0 and 1 done: commit up to 2
    assert tracker.finished(tp, 2) == 3
    assert tracker.finished(tp, 2) is None  # nothing new


def test_run_marks_worker_busy_until_all_its_calls_complete() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m", state_bytes=10), home="w0")
    state.on_request(req("r1", "j"), delivery(0))
    state.on_request(req("r2", "j"), delivery(1))
    (run,) = plan(state.snapshot(), PolicyConfig())
    assert isinstance(run, Run) and run.request_ids == ("r1", "r2")
    taken = state.take_pending(run.request_ids)
    state.apply_run("d1", "w0", "j", taken, run.evict)
    assert state.snapshot().workers["w0"].running == "j"
    assert state.snapshot().jobs["j"].tier == Tier.DEVICE
    clock.t += 1
    assert state.on_completion(done("r1", "j")) == delivery(0)
    assert "w0" in state.inflight
    state.on_completion(done("r2", "j", compute_s=0.25))
    assert "w0" not in state.inflight
    job = state.snapshot().jobs["j"]
    assert job.last_active == clock.t
    assert 0.25 < job.estimates.expected_s(Function.NOOP) < 0.5  # running mean


def test_heartbeat_reconciles_residency_only_when_idle() -> None:
    state = ClusterState(clock=Clock())
    state.add_job("j", "t", JobSpec(base_model="m"), home="w0")
    state.on_heartbeat(beat("w0", [ResidentState("j", Tier.HOST, 42, 3)], busy=True))
    assert state.jobs["j"].tier is None
    state.on_heartbeat(beat("w0", [ResidentState("j", Tier.HOST, 42, 3)]))
    assert state.jobs["j"].tier == Tier.HOST and state.jobs["j"].state_bytes == 42


def test_worker_goes_unhealthy_without_heartbeats() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=5)
    state.on_heartbeat(beat("w0"))
    assert state.snapshot().workers["w0"].healthy
    clock.t += 6
    assert not state.snapshot().workers["w0"].healthy


def test_evictions_update_the_believed_tiers() -> None:
    state = ClusterState(clock=Clock())
    state.on_heartbeat(beat("w0"))
    state.add_job("a", "t", JobSpec(base_model="m", state_bytes=60), home="w0").tier = Tier.DEVICE
    state.add_job("b", "t", JobSpec(base_model="m", state_bytes=60), home="w0").tier = Tier.HOST
    state.on_request(req("rb", "b"), delivery(0))
    (run,) = plan(state.snapshot(), PolicyConfig())
    assert isinstance(run, Run) and run.evict == (Move("a", Tier.HOST),)
    state.apply_run("d", "w0", "b", state.take_pending(run.request_ids), run.evict)
    assert state.jobs["a"].tier == Tier.HOST and state.jobs["b"].tier == Tier.DEVICE


async def test_calls_wait_for_a_worker_instead_of_failing() -> None:
    from plexrl.policy import Reject, RejectReason
    from plexrl_scheduler.actuator import Actuator

    state = ClusterState(clock=Clock())
    state.add_job("j", "t", JobSpec(base_model="m"), home=None)
    state.on_request(req("r1", "j"), delivery(0))
    (reject,) = plan(state.snapshot(), PolicyConfig())
    assert isinstance(reject, Reject) and reject.reason == RejectReason.NO_WORKERS

    async def finished(_: object) -> None:
        raise AssertionError("nothing may be answered yet")

    actuator = Actuator(state, None, None, None, None, finished, None)  # type: ignore[arg-type]
    await actuator.carry_out((reject,))
    assert "r1" in state.pending and "j" in state.jobs


def test_duty_cycle_is_measured_once_a_job_has_history() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m"), home="w0")
    state.on_request(req("r1", "j"), delivery(0))
    assert state.snapshot().jobs["j"].duty_cycle == 0.5  # no history yet
    state.apply_run("d", "w0", "j", state.take_pending(("r1",)), ())
    clock.t += 10
    state.on_completion(done("r1", "j", compute_s=2.0))
    assert abs(state.snapshot().jobs["j"].duty_cycle - 0.2) < 1e-9


def test_a_new_job_borrows_the_figures_of_its_kind() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    state.on_heartbeat(beat("w0"))
    state.add_job("old", "t", JobSpec(base_model="m"), home="w0")
    state.on_request(req("r1", "old", Function.SAMPLE), delivery(0))
    state.apply_run("d", "w0", "old", state.take_pending(("r1",)), ())
    clock.t += 10
    state.on_completion(done("r1", "old", compute_s=1.0, fn=Function.SAMPLE))
    # Same tenant, base model and kind (full fine-tuning): the old job's duty (0.1) and
    # call durations stand in until the newcomer has a history of its own.
    state.add_job("new", "t", JobSpec(base_model="m"), home=None)
    state.on_request(req("r2", "new", Function.FORWARD_BACKWARD), delivery(1))
    state.apply_admit("new", "w0")
    view = state.snapshot().jobs["new"]
    assert abs(view.duty_cycle - 0.1) < 1e-9
    assert view.estimates.expected_s(Function.SAMPLE) == 1.0
    # Another tenant's job learns nothing from it.
    state.add_job("other", "u", JobSpec(base_model="m"), home=None)
    assert state.snapshot().jobs["other"].duty_cycle == 0.5
    assert view.duty_bound > 0.0  # borrowed: bounded by its kind's busiest
    # Once the newcomer has its own history, its own figures count, in a decision on its
    # group (the kinds' figures as the last whole snapshot learned them) as in a whole one.
    clock.t += 10
    for snapshot in (state.snapshot(["w0"]), state.snapshot()):
        assert (snapshot.jobs["new"].duty_cycle, snapshot.jobs["new"].duty_bound) == (0.01, 0.0)


def test_queueing_is_not_counted_as_idle() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m"), home="w0")
    state.on_request(req("r1", "j"), delivery(0))
    state.apply_run("d", "w0", "j", state.take_pending(("r1",)), ())
    clock.t += 20
    # 8 s waiting behind another job's run, then 2 s of compute: busy 2 of the 12 s the
    # job was not waiting for the device (it was 2 of 20 when queueing counted as idle).
    state.on_completion(done("r1", "j", compute_s=2.0, queue_s=8.0))
    assert state.snapshot().jobs["j"].duty_cycle == pytest.approx(2.0 / 12.0)


def test_queueing_before_admission_or_behind_its_own_calls_stays_out() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m"), home=None)
    state.on_request(req("r1", "j", Function.FORWARD_BACKWARD), delivery(0))
    state.on_request(req("r2", "j", Function.FORWARD_BACKWARD), delivery(1))
    clock.t += 30  # waited for a home: outside the job's history
    state.apply_admit("j", "w0")
    state.apply_run("d", "w0", "j", state.take_pending(("r1", "r2")), ())
    clock.t += 4
    state.on_completion(done("r1", "j", compute_s=4.0, queue_s=30.0))
    clock.t += 4
    # r2 queued behind r1, the job's own busy time: not counted as queueing again.
    state.on_completion(done("r2", "j", compute_s=4.0, queue_s=34.0))
    assert state.jobs["j"].history.queued_s == 0.0
    clock.t += 2
    assert state.snapshot().jobs["j"].duty_cycle == pytest.approx(8.0 / 10.0)


def test_snapshot_describes_a_job_as_its_call_history_does() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m"), home=None)
    clock.t += 3  # waiting for admission
    state.apply_admit("j", "w0")
    expected = CallHistory()
    expected.homed(clock.t)
    # Two training steps (sample, forward_backward x2, optim_step), then the next sample:
    # (function, idle before its arrival, queue, swap, compute), one call per dispatch.
    calls = [
        (Function.SAMPLE, 0.0, 0.0, 1.5, 6.0),
        (Function.FORWARD_BACKWARD, 4.0, 2.0, 0.0, 3.0),
        (Function.FORWARD_BACKWARD, 0.0, 0.0, 0.0, 2.0),
        (Function.OPTIM_STEP, 0.0, 1.0, 0.0, 0.5),
        (Function.SAMPLE, 2.0, 3.0, 0.5, 5.0),
        (Function.FORWARD_BACKWARD, 5.0, 0.0, 0.0, 4.0),
        (Function.FORWARD_BACKWARD, 0.0, 0.5, 0.0, 2.5),
        (Function.OPTIM_STEP, 0.0, 0.0, 0.0, 0.7),
        (Function.SAMPLE, 1.0, 0.0, 0.0, 0.0),
    ]
    kind = state.jobs["j"].kind

    def described_as_its_history() -> None:
        # At every snapshot, whatever the view kept from the one before (only its duty
        # cycle is described again while its history has not changed).
        view = state.snapshot().jobs["j"]
        prior = priors([(kind, expected)], clock.t, 5.0).get(kind)
        want = describe(expected, prior, clock.t, 5.0)
        assert view.duty_cycle == pytest.approx(want.duty_cycle)
        assert view.estimates.seconds == want.durations
        assert (view.step_calls, view.tail_s) == (want.step_calls, want.tail_s)

    for i, (function, idle_s, queue_s, swap_s, compute_s) in enumerate(calls):
        clock.t += idle_s
        described_as_its_history()
        state.on_request(req(f"r{i}", "j", function), delivery(i))
        expected.arrived(function)
        if i == len(calls) - 1:
            break  # the last sample is still waiting
        clock.t += queue_s
        state.apply_run(f"d{i}", "w0", "j", state.take_pending((f"r{i}",)), ())
        described_as_its_history()
        clock.t += swap_s + compute_s
        state.on_completion(done(f"r{i}", "j", compute_s, function, swap_s=swap_s, queue_s=queue_s))
        expected.observe(function, compute_s, swap_s, queue_s)
        described_as_its_history()

    view = state.snapshot().jobs["j"]
    want = describe(expected, None, clock.t, 5.0)
    assert view.duty_cycle == pytest.approx(want.duty_cycle)
    assert view.duty_cycle > 0.6  # idle 12 s, queued 6.5 s of the 44.2 s since admission
    assert view.estimates.seconds == pytest.approx(want.durations)
    assert (
        view.step_calls
        == want.step_calls
        == (
            Function.SAMPLE,
            Function.FORWARD_BACKWARD,
            Function.FORWARD_BACKWARD,
            Function.OPTIM_STEP,
        )
    )
    assert view.duty_bound == 0.0  # its own duty cycle
    # A newcomer of its kind borrows its figures, bounded by the kind's busiest tenth
    # (here the one job with a history).
    state.add_job("k", "t", JobSpec(base_model="m"), home=None)
    newcomer = state.snapshot().jobs["k"]
    assert newcomer.duty_cycle == pytest.approx(view.duty_cycle)
    assert newcomer.duty_bound == pytest.approx(view.duty_cycle)


def _tail(worker: str, dispatch_id: str, rids: list[str], jobs: list[str]) -> TailReleased:
    return TailReleased(
        worker_id=worker,
        dispatch_id=dispatch_id,
        request_ids=rids,
        job_ids=jobs,
        remaining=1,
        total=8,
        at=0.0,
    )


def _sampling(state: ClusterState) -> None:
    """Jobs a and b on w0; a dispatch d1 of a's two sample calls and b's one in flight."""
    state.on_heartbeat(beat("w0"))
    for job in ("a", "b", "c"):
        state.add_job(job, "t", JobSpec(base_model="m", state_bytes=10), home="w0")
    state.on_request(req("a1", "a", Function.SAMPLE), delivery(0))
    state.on_request(req("a2", "a", Function.SAMPLE), delivery(1))
    state.on_request(req("b1", "b", Function.SAMPLE), delivery(2))
    taken = state.take_pending(("a1", "a2", "b1"))
    state.apply_run("d1", "w0", "a", taken, ())


def test_a_tail_release_frees_the_worker_and_pins_the_straggling_jobs() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    _sampling(state)
    state.on_completion(done("a1", "a", fn=Function.SAMPLE))
    assert state.on_tail_released(_tail("w0", "d1", ["a2", "b1"], ["a", "b"]))
    snap = state.snapshot()
    assert snap.workers["w0"].running is None  # free for the next dispatch
    assert snap.jobs["a"].pinned and snap.jobs["b"].pinned and not snap.jobs["c"].pinned
    assert snap.workers["w0"].tail_jobs == {"a", "b"}  # whose stragglers decode there
    # The next dispatch goes out beside the tail; completions of either are matched.
    state.on_request(req("c1", "c"), delivery(3))
    state.apply_run("d2", "w0", "c", state.take_pending(("c1",)), ())
    assert state.on_completion(done("b1", "b", fn=Function.SAMPLE)) == delivery(2)
    assert state.on_completion(done("c1", "c")) == delivery(3)
    assert "w0" not in state.inflight and state.snapshot().jobs["a"].pinned
    assert state.snapshot().workers["w0"].tail_jobs == {"a"}
    clock.t += 4.0
    state.on_completion(done("a2", "a", fn=Function.SAMPLE))
    assert not state.tails and not state.snapshot().jobs["a"].pinned
    # How long the stragglers took after the release reaches the policy (b's answer came
    # at the release, a's 4 s after it).
    assert state.snapshot().jobs["a"].tail_s == pytest.approx(4.0)


def test_a_co_sampled_job_is_pinned_while_its_call_runs_in_another_jobs_dispatch() -> None:
    state = ClusterState(clock=Clock())
    _sampling(state)  # b's sample rides in a's dispatch
    snap = state.snapshot()
    assert snap.workers["w0"].running == "a" and snap.jobs["b"].pinned
    assert not snap.jobs["a"].pinned and not snap.jobs["c"].pinned
    state.on_completion(done("b1", "b", fn=Function.SAMPLE))
    assert not state.snapshot().jobs["b"].pinned


def test_a_late_tail_event_is_ignored_and_a_lost_worker_requeues_its_tails() -> None:
    state = ClusterState(clock=Clock())
    _sampling(state)
    assert not state.on_tail_released(_tail("w0", "other", ["a2"], ["a"]))
    assert state.on_tail_released(_tail("w0", "d1", ["a2", "b1"], ["a", "b"]))
    state.on_completion(done("a1", "a", fn=Function.SAMPLE))
    state.on_request(req("c1", "c"), delivery(3))
    state.apply_run("d2", "w0", "c", state.take_pending(("c1",)), ())
    state.on_worker_lost("w0")
    assert list(state.pending) == ["a2", "b1", "c1"]  # the tail's calls, then the dispatch's
    assert not state.tails and not state.inflight


def test_a_job_silent_for_a_minute_weighs_nothing_and_lends_no_figures() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=1e9)
    state.on_heartbeat(beat("w0"))
    state.add_job("old", "t", JobSpec(base_model="m"), home=None)
    state.apply_admit("old", "w0")
    for i in range(4):  # busy 4 s of every 5 s for 20 s
        state.on_request(req(f"r{i}", "old"), delivery(i))
        state.apply_run(f"d{i}", "w0", "old", state.take_pending((f"r{i}",)), ())
        clock.t += 4
        state.on_completion(done(f"r{i}", "old", compute_s=4.0))
        clock.t += 1
    state.add_job("new", "t", JobSpec(base_model="m"), home=None)
    view = state.snapshot()
    assert view.jobs["old"].duty_cycle == pytest.approx(0.8)
    assert view.jobs["new"].duty_cycle == pytest.approx(0.8)  # its kind's figure
    clock.t += 61  # the old job's client has gone quiet; the new one waits unhomed
    view = state.snapshot()
    assert state.dormant(clock.t) == {"old"}
    assert view.jobs["old"].duty_cycle == 0.0
    assert view.jobs["new"].duty_cycle == 0.5  # no active job of its kind to borrow from
    state.on_request(req("r9", "old"), delivery(9))  # its next call wakes it
    assert state.dormant(clock.t) == set()
    assert state.snapshot().jobs["old"].duty_cycle > 0.0


def test_how_long_a_silent_job_takes_to_turn_dormant_is_a_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert SchedulerSettings().dormant_s == DORMANT_S  # the state's own default
    monkeypatch.setenv("PLEXRL_DORMANT_S", "300")
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=1e9, dormant_s=SchedulerSettings().dormant_s)
    state.on_heartbeat(beat("w0"))
    state.add_job("slow", "t", JobSpec(base_model="m"), home=None)
    state.apply_admit("slow", "w0")
    state.on_request(req("r0", "slow"), delivery(0))
    state.apply_run("d0", "w0", "slow", state.take_pending(("r0",)), ())
    clock.t += 4
    state.on_completion(done("r0", "slow", compute_s=4.0))
    clock.t += 120  # a two-minute stall with no idle hint: not stopped at 300 s
    assert state.dormant(clock.t) == set()
    clock.t += 181
    assert state.dormant(clock.t) == {"slow"}
    monkeypatch.setenv("PLEXRL_DORMANT_S", "0")
    with pytest.raises(ValidationError, match="dormant_s"):
        SchedulerSettings()


def test_a_jobs_last_gap_is_from_the_end_of_its_calls_to_its_next_with_none_queued() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=1e9)
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m"), home=None)
    state.apply_admit("j", "w0")
    state.on_request(req("r0", "j"), delivery(0))
    assert state.snapshot().jobs["j"].last_gap_s == 0.0  # nothing ended before it
    state.apply_run("d0", "w0", "j", state.take_pending(("r0",)), ())
    clock.t += 1.0
    state.on_completion(done("r0", "j", compute_s=1.0))
    clock.t += 0.03  # the client's round trip
    state.on_request(req("r1", "j"), delivery(1))
    clock.t += 5.0  # a second call queued behind the first: no gap of its own
    state.on_request(req("r2", "j"), delivery(2))
    view = state.snapshot().jobs["j"]
    assert view.last_gap_s == pytest.approx(0.03)
    assert view.burst_s == pytest.approx(5.0)  # its burst began with r1


def test_a_sample_run_is_preemptible_once_and_a_preempt_release_frees_the_worker() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    _sampling(state)
    clock.t += 0.5
    worker = state.snapshot().workers["w0"]
    assert worker.preemptible_since == 1000.0
    # Expected end: the dispatch's start plus its three calls' expected seconds.
    assert worker.busy_until > 1000.0
    assert state.apply_preempt("w0") == "d1"
    assert state.snapshot().workers["w0"].preemptible_since is None  # asked once
    released = TailReleased(
        worker_id="w0",
        dispatch_id="d1",
        request_ids=["a1", "a2", "b1"],
        job_ids=["a", "b"],
        remaining=6,
        total=8,
        at=0.0,
        reason=ReleaseReason.PREEMPT,
    )
    assert state.on_tail_released(released)
    snap = state.snapshot()
    assert snap.workers["w0"].running is None and snap.jobs["a"].pinned
    assert state.apply_preempt("w0") is None  # nothing runs there now


def test_a_run_with_other_calls_is_never_preemptible() -> None:
    state = ClusterState(clock=Clock())
    state.on_heartbeat(beat("w0"))
    state.add_job("a", "t", JobSpec(base_model="m", state_bytes=10), home="w0")
    state.on_request(req("a1", "a", Function.SAMPLE), delivery(0))
    state.on_request(req("a2", "a", Function.FORWARD_BACKWARD), delivery(1))
    state.apply_run("d1", "w0", "a", state.take_pending(("a1", "a2")), ())
    assert state.snapshot().workers["w0"].preemptible_since is None


def _training(state: ClusterState, *, slices: bool = True, staleness: int = 1) -> None:
    """Job a (asynchronous at `staleness`) trains on w0 (dispatch d1: one
    forward_backward), its optim_step and a sample queued behind it; b homed there too."""
    state.on_heartbeat(msgspec.structs.replace(beat("w0"), slices_training=slices))
    for job in ("a", "b"):
        state.add_job(job, "t", JobSpec(base_model="m", state_bytes=10), home="w0")
    state.on_job_options("a", staleness)
    state.on_request(req("a1", "a", Function.FORWARD_BACKWARD), delivery(0))
    # As the actuator issues it: the dispatch says whether the worker may slice it.
    sliceable = state.sliceable("a", "w0")
    state.apply_run("d1", "w0", "a", state.take_pending(("a1",)), (), sliceable=sliceable)
    state.on_request(req("a2", "a", Function.OPTIM_STEP), delivery(1))
    state.on_request(req("a3", "a", Function.SAMPLE), delivery(2))
    state.on_request(req("b1", "b", Function.SAMPLE), delivery(3))


def test_an_asynchronous_jobs_training_is_sliced_where_the_worker_slices_it() -> None:
    for slices, staleness, sliced in ((True, 1, True), (False, 1, False), (True, 0, False)):
        state = ClusterState(clock=Clock())
        _training(state, slices=slices, staleness=staleness)
        worker = state.snapshot().workers["w0"]
        assert worker.sliced is sliced
        assert (worker.preemptible_since is not None) is sliced
        # What the dispatch tells the worker: slice it, or run it whole.
        assert state.sliceable("a", "w0") is sliced
    assert not state.sliceable("a", "w9") and not state.sliceable("z", "w0")


def test_training_dispatched_whole_stays_whole_when_its_job_turns_asynchronous() -> None:
    state = ClusterState(clock=Clock())
    _training(state, staleness=0)
    # Declared while the call runs: the worker runs it whole as its dispatch said, so
    # the scheduler's view must not offer it for preemption.
    state.on_job_options("a", 1)
    assert state.sliceable("a", "w0")  # the job's next training dispatch will be sliced
    worker = state.snapshot().workers["w0"]
    assert not worker.sliced and worker.preemptible_since is None


def test_training_with_a_follow_up_behind_it_is_not_sliced() -> None:
    state = ClusterState(clock=Clock())
    _training(state)
    assert state.follow_up_running("w0") is None  # b waits: no follow-up
    state.apply_follow_up("d2", "w0", "a", state.take_pending(("a2",)))
    assert not state.snapshot().workers["w0"].sliced


def _preempt_training(state: ClusterState) -> None:
    """a's forward_backward (dispatch d1) paused at a micro-batch and released."""
    assert state.apply_preempt("w0") == "d1"
    released = TailReleased(
        worker_id="w0",
        dispatch_id="d1",
        request_ids=["a1"],
        job_ids=["a"],
        remaining=1,
        total=1,
        at=0.0,
        reason=ReleaseReason.PREEMPT,
    )
    assert state.on_tail_released(released)


def test_a_preempted_training_call_holds_back_its_jobs_later_calls() -> None:
    state = ClusterState(clock=Clock())
    _training(state)
    _preempt_training(state)
    snap = state.snapshot()
    # The worker is free for b's sample; a's optim_step (numbered) and the sample behind
    # it wait for the forward_backward, which runs on in the background.
    assert snap.workers["w0"].running is None and snap.jobs["a"].pinned
    assert [c.request_id for c in snap.pending] == ["b1"]
    assert snap.workers["w0"].tail_until > 1000.0
    state.on_completion(done("a1", "a", fn=Function.FORWARD_BACKWARD))
    assert [c.request_id for c in state.snapshot().pending] == ["a2", "a3", "b1"]


def test_a_sample_of_saved_weights_goes_past_its_jobs_preempted_training() -> None:
    state = ClusterState(clock=Clock())
    _training(state)
    state.on_request(_portable("a4", "a"), delivery(4))
    _preempt_training(state)
    snap = state.snapshot()
    # The numbered optim_step and the sample on the job's own weights wait for the
    # forward_backward; the sample of saved weights needs nothing of it.
    assert [c.request_id for c in snap.pending] == ["b1", "a4"]
    state.on_completion(done("a1", "a", fn=Function.FORWARD_BACKWARD))
    # The job's Runs take its sample of saved weights before its earlier training calls.
    assert [c.request_id for c in state.snapshot().calls_view("a")] == ["a4", "a2", "a3"]


def test_the_slices_a_jobs_training_ran_in_reach_the_policys_view() -> None:
    state = ClusterState(clock=Clock())
    _training(state)
    assert state.snapshot().jobs["a"].train_slices == 1  # none seen yet
    sliced = done("a1", "a", fn=Function.FORWARD_BACKWARD)
    sliced = msgspec.structs.replace(
        sliced, timings=msgspec.structs.replace(sliced.timings, slices=6)
    )
    state.on_completion(sliced)
    assert state.snapshot().jobs["a"].train_slices == 6


def test_a_restarted_worker_gives_back_the_calls_of_its_released_batches() -> None:
    # The tail's dispatch was acknowledged at its release: Kafka will not bring it
    # back to the restarted worker, so the scheduler must.
    state = ClusterState(clock=Clock())
    _sampling(state)
    state.on_completion(done("a1", "a", fn=Function.SAMPLE))
    assert state.on_tail_released(_tail("w0", "d1", ["a2", "b1"], ["a", "b"]))
    state.on_request(req("c1", "c"), delivery(3))
    state.apply_run("d2", "w0", "c", state.take_pending(("c1",)), ())
    restarted = msgspec.structs.replace(beat("w0"), started_at=5.0)
    state.on_heartbeat(restarted)
    assert list(state.pending) == ["a2", "b1"] and not state.tails
    assert state.inflight["w0"].dispatch_id == "d2"  # Kafka redelivers that one
    assert not state.snapshot().jobs["a"].pinned


def test_a_jobs_engine_use_and_last_dispatch_reach_the_snapshot() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    state.on_heartbeat(beat("w0"))
    state.add_job("a", "t", JobSpec(base_model="m"), home="w0")
    state.add_job("b", "u", JobSpec(base_model="m"), home="w0")
    state.on_request(req("r1", "a", Function.SAMPLE), delivery(0))
    state.on_request(req("r2", "b", Function.SAMPLE), delivery(1))
    # One dispatch carries both jobs' calls (co-sampling): both started with it.
    state.apply_run("d", "w0", "a", state.take_pending(("r1", "r2")), ())
    started = clock.t
    clock.t += 3
    state.on_completion(done("r1", "a", compute_s=2.0, swap_s=0.5))
    view = state.snapshot().jobs
    assert view["a"].last_started == started and view["b"].last_started == started
    assert view["a"].used_s == 2.5 and view["b"].used_s == 0.0
    assert view["a"].tenant == "t" and view["b"].tenant == "u"
    clock.t += 60  # one half-life
    assert state.snapshot().jobs["a"].used_s == pytest.approx(1.25)


def test_the_snapshot_sizes_jobs_for_groups_of_several_ranks() -> None:
    from plexrl.messages import LoraSpec

    clock = Clock()
    state = ClusterState(clock=clock)
    one = msgspec.structs.replace(beat("one"), device_bytes=50)
    pair = msgspec.structs.replace(beat("pair"), device_bytes=100, devices=2)
    state.on_heartbeat(one)
    state.on_heartbeat(pair)
    lora = JobSpec(base_model="m", lora=LoraSpec(rank=4), state_bytes=20)
    state.add_job("adapter", "t", lora, "pair")
    state.add_job("full", "t", JobSpec(base_model="m", state_bytes=80), None)
    state.add_job("small", "t", JobSpec(base_model="m", state_bytes=30), None)
    jobs = state.snapshot().jobs
    # A LoRA adapter is whole on both ranks of its home: 40 of the group's 100 bytes.
    assert jobs["adapter"].state_bytes == 40 and jobs["adapter"].replicated_bytes == 0
    # A job waiting for a home needs the fewest ranks of a group that holds it.
    assert jobs["full"].devices == 2 and jobs["small"].devices == 1
    # A decision on the pair's group alone sees the adapter as the whole one does.
    assert state.snapshot(groups={"pair"}).jobs["adapter"].state_bytes == 40


def test_a_jobs_stall_is_the_mean_of_its_idle_hints() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=1e9)
    state.add_job("j", "t", JobSpec(base_model="m"), home=None)
    assert state.snapshot().jobs["j"].stall_s == 0.0  # none said yet
    state.on_idle_hint("j", 2.0)
    state.on_idle_hint("j", 4.0)
    view = state.snapshot().jobs["j"]
    assert view.stall_s == pytest.approx(3.0)
    assert view.idle_until == pytest.approx(clock.t + 4.0)


def test_a_jobs_stall_spread_is_learned_from_hint_to_next_call() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=1e9)
    state.add_job("j", "t", JobSpec(base_model="m"), home=None)
    # However long each hint says, its stall lasts until the job's next call.
    for i, lasted in enumerate((100.0, 400.0, 200.0)):
        state.on_idle_hint("j", 250.0)
        clock.t += lasted
        state.on_request(req(f"r{i}", "j"), delivery(i))
    logs = [math.log(s) for s in (100.0, 400.0, 200.0)]
    assert state.snapshot().jobs["j"].stall_sigma == pytest.approx(statistics.stdev(logs))
    # A call with no hint before it is no stall.
    clock.t += 5000.0
    state.on_request(req("r3", "j"), delivery(3))
    assert state.snapshot().jobs["j"].stall_sigma == pytest.approx(statistics.stdev(logs))


def test_a_jobs_declared_options_reach_the_policys_view() -> None:
    state = ClusterState(clock=Clock())
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m"), home=None)
    view = state.snapshot().jobs["j"]
    assert (view.staleness, view.declared_steps) == (0, 0)
    state.on_job_options("j", 1, 1500)
    view = state.snapshot().jobs["j"]
    assert (view.staleness, view.declared_steps) == (1, 1500)
    state.on_job_options("nobody", 1, 10)  # an unknown job: nothing to change


def _portable(rid: str, job: str) -> PhaseRequest:
    return msgspec.structs.replace(
        req(rid, job, Function.SAMPLE), work=WorkHint(sequences=4, portable=True)
    )


def test_a_job_that_samples_while_it_trains_is_taken_as_asynchronous() -> None:
    state = ClusterState(clock=Clock())
    state.on_heartbeat(msgspec.structs.replace(beat("w0"), slices_training=True))
    for job in ("a", "b"):
        state.add_job(job, "t", JobSpec(base_model="m", state_bytes=10), home="w0")
    # A synchronous loop: its sample comes when its training is answered.
    state.on_request(req("a1", "a", Function.FORWARD_BACKWARD), delivery(0))
    state.apply_run("d1", "w0", "a", state.take_pending(("a1",)), ())
    state.on_completion(done("a1", "a", fn=Function.FORWARD_BACKWARD, finished_at=0.5))
    state.on_request(_portable("a2", "a"), delivery(1))
    # A sample on the job's own weights (not portable) beside its training says nothing.
    state.on_request(req("b1", "b", Function.FORWARD_BACKWARD), delivery(2))
    state.on_request(req("b2", "b", Function.SAMPLE), delivery(3))
    views = state.snapshot().jobs
    assert (views["a"].staleness, views["b"].staleness) == (0, 0)
    assert not state.sliceable("a", "w0")
    # b's sample on saved weights comes (at 1.0) while its training is queued; that
    # training, once it ends after the sample came, makes it asynchronous.
    state.on_request(_portable("b3", "b"), delivery(4))
    state.apply_run("d2", "w0", "b", state.take_pending(("b1",)), ())
    state.on_completion(done("b1", "b", fn=Function.FORWARD_BACKWARD, finished_at=2.0))
    assert state.snapshot().jobs["b"].staleness == 1 and state.sliceable("b", "w0")
    # a's training ended (0.9) before its sample came (1.0), its completion read after:
    # a synchronous loop's next call that overtook the completion, not a second lane.
    state.on_request(req("a3", "a", Function.OPTIM_STEP), delivery(5))
    state.apply_run("d3", "w0", "a", state.take_pending(("a3",)), ())
    state.on_request(_portable("a4", "a"), delivery(6))
    state.on_completion(done("a3", "a", fn=Function.OPTIM_STEP, finished_at=0.9))
    assert state.snapshot().jobs["a"].staleness == 0
    # Once a sample comes while its training runs on, it is; a declared one stands.
    state.on_request(req("a5", "a", Function.OPTIM_STEP), delivery(7))
    state.apply_run("d4", "w0", "a", state.take_pending(("a5",)), ())
    state.on_request(_portable("a6", "a"), delivery(8))
    state.on_completion(done("a5", "a", fn=Function.OPTIM_STEP, finished_at=1.5))
    state.on_job_options("a", 2)
    assert state.snapshot().jobs["a"].staleness == 2
    state.on_job_options("a", 0)
    assert state.snapshot().jobs["a"].staleness == 1


def test_a_job_that_trains_while_it_samples_is_taken_as_asynchronous() -> None:
    state = ClusterState(clock=Clock())
    for job, worker in (("a", "w0"), ("b", "w1")):
        state.on_heartbeat(beat(worker))
        state.add_job(job, "t", JobSpec(base_model="m", state_bytes=10), home=worker)
    # a's sample is answered before its training comes; b's is still running.
    for job, worker in (("a", "w0"), ("b", "w1")):
        state.on_request(_portable(f"{job}1", job), delivery(0))
        state.apply_run(f"d{job}", worker, job, state.take_pending((f"{job}1",)), ())
    state.on_completion(done("a1", "a", fn=Function.SAMPLE, finished_at=0.5))
    for job in ("a", "b"):
        state.on_request(req(f"{job}2", job, Function.FORWARD_BACKWARD), delivery(1))
    assert state.snapshot().jobs["b"].staleness == 0  # until its sample ends after
    state.on_completion(done("b1", "b", fn=Function.SAMPLE, finished_at=3.0))
    views = state.snapshot().jobs
    assert (views["a"].staleness, views["b"].staleness) == (0, 1)


def test_a_newcomers_home_is_reviewed_once_in_a_whole_decision() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, review_histories=2.0)  # after 10 s of its own
    for w in ("w0", "w1"):
        state.on_heartbeat(beat(w))
    state.add_job("j", "t", JobSpec(base_model="m", state_bytes=10), home=None)
    state.apply_admit("j", "w0", epoch=1)
    state.on_request(req("r1", "j"), delivery(0))
    state.apply_run("d", "w0", "j", state.take_pending(("r1",)), ())
    clock.t += 6  # a history of its own, not yet the review's
    state.on_completion(done("r1", "j"))
    assert not state.snapshot().jobs["j"].review
    clock.t += 5
    state.on_request(req("r2", "j"), delivery(1))
    state.apply_run("d2", "w0", "j", state.take_pending(("r2",)), ())
    assert not state.between_calls("j")
    state.take_touched(True)
    state.on_completion(done("r2", "j"))
    assert state.between_calls("j")
    assert state.everything_due  # its review waits for a whole decision
    assert state.snapshot().jobs["j"].review
    assert not state.snapshot({"w0"}).jobs["j"].review  # only a whole one reviews
    state.apply_rehome("j", "w1", epoch=2)
    job = state.snapshot().jobs["j"]
    assert (job.home, job.tier, job.review) == ("w1", Tier.DISK, False)
    assert state.jobs["j"].epoch == 2
    assert "j" not in {v.job_id for v in state.snapshot({"w0"}).jobs.values()}


def test_under_a_policy_that_reviews_no_home_a_newcomers_calls_ask_for_no_whole_decision() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, review_histories=2.0, review=False)  # fifo's
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m", state_bytes=10), home=None)
    state.apply_admit("j", "w0", epoch=1)
    clock.t += 11  # the history a review would wait for
    state.on_request(req("r1", "j"), delivery(0))
    state.apply_run("d", "w0", "j", state.take_pending(("r1",)), ())
    state.take_touched(True)
    state.on_completion(done("r1", "j"))
    assert not state.everything_due and not state.due_for_review("j")
    assert not state.snapshot().jobs["j"].review


def test_a_job_kept_for_want_of_a_group_is_reviewed_at_whole_decisions_only() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, review_histories=2.0)
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m", state_bytes=10), home=None)
    state.apply_admit("j", "w0", epoch=1)
    clock.t += 11
    assert state.snapshot().jobs["j"].review
    state.apply_review("j", waits=True)  # over the budget, and no group takes it yet
    # Still under review at a whole decision...
    assert state.snapshot().jobs["j"].review
    # ...but its calls do not ask for one.
    state.on_request(req("r1", "j"), delivery(0))
    state.apply_run("d", "w0", "j", state.take_pending(("r1",)), ())
    state.take_touched(True)
    state.on_completion(done("r1", "j"))
    assert not state.everything_due
    state.apply_review("j")  # a later whole decision settles it
    assert not state.snapshot().jobs["j"].review and not state.jobs["j"].awaiting


def test_a_job_left_alone_on_its_worker_is_reviewed_again() -> None:
    for lone in (True, False):
        clock = Clock()
        state = ClusterState(clock=clock, review_histories=1.0, review_lone=lone)
        state.on_heartbeat(beat("w0"))
        for j in ("a", "b", "c"):
            state.add_job(j, "t", JobSpec(base_model="m", state_bytes=10), home=None)
            state.apply_admit(j, "w0", epoch=1)
        clock.t += 10
        assert state.jobs["c"].review_reason == "newcomer"
        for j in ("a", "b", "c"):
            state.apply_review(j)  # reviewed once as newcomers
        # One leaves: two still share w0, no review.
        state.on_request(req("u1", "a", Function.UNLOAD), delivery(0))
        state.apply_run("d1", "w0", "a", state.take_pending(("u1",)), ())
        state.on_completion(done("u1", "a", fn=Function.UNLOAD))
        assert not any(v.review for v in state.snapshot().jobs.values())
        # The next leaves c alone there: its home is due for review at a whole decision.
        state.on_request(req("u2", "b", Function.UNLOAD), delivery(1))
        state.apply_run("d2", "w0", "b", state.take_pending(("u2",)), ())
        state.take_touched(True)
        state.on_completion(done("u2", "b", fn=Function.UNLOAD))
        assert state.snapshot().jobs["c"].review is lone
        assert state.everything_due is lone
        assert not state.snapshot({"w0"}).jobs["c"].review
        assert state.jobs["c"].review_reason == ("left alone" if lone else "newcomer")
        state.apply_review("c")  # kept: the next review would be a newcomer's again
        assert state.jobs["c"].review_reason == "newcomer"


def test_jobs_alone_that_another_alone_could_take_are_reviewed_again() -> None:
    for lone in (True, False):
        clock = Clock()
        state = ClusterState(clock=clock, review_histories=1.0, review_lone=lone)
        assert state.review_interval_s == 5.0
        for w, j in (("w0", "a"), ("w1", "b")):
            state.on_heartbeat(beat(w))
            state.add_job(j, "t", JobSpec(base_model="m", state_bytes=10), home=None)
            state.apply_admit(j, w, epoch=1)
        clock.t += 10
        for j in ("a", "b"):
            state.apply_review(j)  # reviewed once as newcomers, each kept alone
        state.take_touched(True)
        # The policy names a (`plexrl.policy.lone_pairs`), and a job it does not know.
        state.review_alone(["a", "gone"])
        views = state.snapshot().jobs
        assert views["a"].review is lone and not views["b"].review
        assert state.everything_due is lone
        if lone:
            assert state.jobs["a"].review_reason == "alone"
            # Named again while under review: nothing changes; answered, it is settled.
            state.review_alone(["a"])
            state.apply_review("a")
            assert not state.snapshot().jobs["a"].review
            assert state.jobs["a"].review_reason == "newcomer"


def test_a_job_admitted_on_its_own_figures_is_not_reviewed() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, review_histories=1.0)
    state.on_heartbeat(beat("w0"))
    state.add_job("j", "t", JobSpec(base_model="m"), home=None)
    state.apply_admit("j", "w0", epoch=1)
    clock.t += 10
    state.apply_review("j")  # the policy kept it where it is
    assert not state.snapshot().jobs["j"].review
    # Re-admitted after its worker was lost, with a history of its own: not provisional.
    state.on_worker_lost("w0")
    state.on_heartbeat(beat("w1"))
    state.apply_admit("j", "w1", epoch=2)
    assert not state.jobs["j"].provisional


async def test_a_move_fences_the_old_home_before_telling_it_to_drop_its_copy() -> None:
    from plexrl.messages import Dispatch, JobAdmitted
    from plexrl.policy import Rehome
    from plexrl.topics import Topics
    from plexrl_scheduler.actuator import Actuator

    events: list[tuple[str, object]] = []

    class Ledger:  # the edge: the real ledger is Redis's (tests/test_live_rehome.py)
        async def bump_epoch(self, job_id: str, worker_id: str) -> int:
            events.append(("epoch", worker_id))
            return 7

    class Jobs:
        async def set_home(self, job_id: str, worker_id: str) -> None:
            events.append(("home", worker_id))

    class Publisher:
        async def publish(self, topic: str, key: str, message: object, headers=None) -> None:
            events.append((topic, message))

    async def finished(_: object) -> None:
        return None

    clock = Clock()
    state = ClusterState(clock=clock)
    for w in ("w0", "w1"):
        state.on_heartbeat(beat(w))
    state.add_job("j", "t", JobSpec(base_model="m", state_bytes=10), home="w0")
    state.on_request(req("r1", "j"), delivery(0))
    state.apply_run("d", "w0", "j", state.take_pending(("r1",)), ())
    topics = Topics("c")
    publisher: Any = Publisher()
    jobs: Any = Jobs()
    ledger: Any = Ledger()
    actuator = Actuator(state, publisher, jobs, cast(Any, None), topics, finished, ledger)
    move = Rehome("j", "w0", "w1")
    # A call of it in flight at home: nothing moves, the rest of the plan is dropped.
    await actuator.carry_out((move, Run("w1", "j", ("r2",))))
    assert events == [] and state.jobs["j"].home == "w0" and state.everything_due
    state.on_completion(done("r1", "j"))
    await actuator.carry_out((move,))
    assert [e[0] for e in events] == ["epoch", "home", topics.events, topics.dispatch("w0")]
    assert events[0] == ("epoch", "w1")  # fenced before the old home hears of it
    assert isinstance(events[2][1], JobAdmitted) and events[2][1].home_worker == "w1"
    drop = events[3][1]
    assert isinstance(drop, Dispatch) and drop.drop == ["j"] and drop.calls == []
    assert (state.jobs["j"].home, state.jobs["j"].epoch) == ("w1", 7)
    assert state.jobs["j"].tier in (Tier.DISK, None)


@pytest.mark.parametrize(
    ("env", "reviews"),
    [({}, True), ({"PLEXRL_POLICY": "fifo"}, False), ({"PLEXRL_REHOME": "false"}, False)],
)
def test_homes_come_due_for_review_only_where_the_policy_reviews_them(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], reviews: bool
) -> None:
    # (A job due for review gets no direct lease: under a policy that never reviews,
    # none would ever be granted again.)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = SchedulerSettings(review_histories=1.0)
    clock = Clock()
    state = cluster_state(settings, policy_config(settings), clock=clock)
    state.on_heartbeat(beat("w0"))
    state.add_job("a", "t", JobSpec(base_model="m"), home=None)
    state.apply_admit("a", "w0")
    state.on_request(req("r0", "a"), delivery(0))
    clock.t += 6.0
    state.on_completion(done("r0", "a"))
    assert state.due_for_review("a") is reviews
