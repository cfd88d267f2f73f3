"""Dead workers and lost dispatches in the scheduler's view, with a fake clock."""

from __future__ import annotations

from msgspec.structs import replace

from plexrl.messages import Function, JobSpec, Tier
from plexrl.policy import Admit, PolicyConfig, Run, plan
from plexrl_scheduler.state import ClusterState
from tests.test_scheduler_state import Clock, beat, delivery, req


def two_workers(clock: Clock) -> ClusterState:
    state = ClusterState(clock=clock, worker_timeout_s=10.0)
    state.on_heartbeat(beat("w0"))
    state.on_heartbeat(beat("w1"))
    return state


def test_a_dead_workers_jobs_are_rehomed_with_their_calls_in_order() -> None:
    clock = Clock()
    state = two_workers(clock)
    state.add_job("j", "t", JobSpec(base_model="m"), home="w0")
    state.apply_admit("j", "w0", epoch=3)
    for i in range(3):
        state.on_request(req(f"r{i}", "j", Function.FORWARD_BACKWARD), delivery(i))
    state.apply_run("d", "w0", "j", state.take_pending(("r0", "r1")), ())
    state.on_request(req("r3", "j"), delivery(3))

    clock.t += 11  # w0 went silent; w1 still beats
    state.on_heartbeat(replace(beat("w1"), sent_at=clock.t))
    assert state.lost_workers() == ["w0"]
    assert state.on_worker_lost("w0") == ["j"]
    assert state.lost_workers() == []

    job = state.jobs["j"]
    assert (job.home, job.epoch, job.tier) == (None, 0, Tier.DISK)
    assert "w0" not in state.inflight
    assert list(state.pending) == ["r0", "r1", "r2", "r3"]
    # Admission gives the job a healthy home; its calls run there in order.
    actions = plan(state.snapshot(), PolicyConfig())
    assert actions[0] == Admit("j", "w1")
    state.apply_admit("j", "w1", epoch=4)
    (run,) = [a for a in plan(state.snapshot(), PolicyConfig()) if isinstance(a, Run)]
    assert run.worker_id == "w1" and run.request_ids[:2] == ("r0", "r1")


def test_a_late_completion_of_a_requeued_call_is_ignored() -> None:
    from tests.test_scheduler_state import done

    clock = Clock()
    state = two_workers(clock)
    state.add_job("j", "t", JobSpec(base_model="m"), home="w0")
    state.on_request(req("r0", "j"), delivery(0))
    state.apply_run("d", "w0", "j", state.take_pending(("r0",)), ())
    assert state.requeue("w0") == ["r0"]
    assert state.on_completion(done("r0", "j")) is None
    assert "r0" in state.pending


def test_a_dispatch_the_worker_never_got_expires_its_lease() -> None:
    clock = Clock()
    state = two_workers(clock)
    state.add_job("j", "t", JobSpec(base_model="m"), home="w0")
    state.on_request(req("r0", "j"), delivery(0))
    state.apply_run("d", "w0", "j", state.take_pending(("r0",)), ())
    # Busy, or idle too soon after the dispatch: the lease holds.
    clock.t += 1
    state.on_heartbeat(replace(beat("w0"), busy=True, sent_at=clock.t + 10))
    assert state.expired_leases(grace_s=5.0) == []
    state.on_heartbeat(replace(beat("w0"), sent_at=clock.t + 2))
    assert state.expired_leases(grace_s=5.0) == []
    # Idle long after it: the dispatch was lost on the way.
    state.on_heartbeat(replace(beat("w0"), sent_at=clock.t + 6))
    assert state.expired_leases(grace_s=5.0) == ["w0"]
    assert state.requeue("w0") == ["r0"] and "w0" not in state.inflight


def test_a_restarted_worker_is_not_believed_to_hold_its_states() -> None:
    clock = Clock()
    state = two_workers(clock)
    state.add_job("j", "t", JobSpec(base_model="m"), home="w0")
    state.jobs["j"].tier = Tier.DEVICE
    state.on_heartbeat(replace(beat("w0"), started_at=5.0))
    assert state.jobs["j"].tier == Tier.DISK and state.jobs["j"].home == "w0"


def test_a_home_that_never_reports_after_a_scheduler_restart_is_lost() -> None:
    clock = Clock()
    state = ClusterState(clock=clock, worker_timeout_s=10.0)
    state.add_job("j", "t", JobSpec(base_model="m"), home="w-gone")  # from Redis
    state.on_heartbeat(beat("w1"))
    assert state.lost_workers() == []  # it may still report: give it the timeout
    clock.t += 11
    state.on_heartbeat(replace(beat("w1"), sent_at=clock.t))
    assert state.lost_workers() == ["w-gone"]
    assert state.on_worker_lost("w-gone") == ["j"] and state.jobs["j"].home is None
    assert state.lost_workers() == []
