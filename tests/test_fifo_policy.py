"""The FIFO policy as a pure function over hand-built snapshots."""

from __future__ import annotations

from plexrl.messages import Function, Tier
from plexrl.policy import (
    Admit,
    ClusterSnapshot,
    JobView,
    Move,
    PendingCall,
    PolicyConfig,
    Reject,
    RejectReason,
    Run,
    WorkerView,
    plan,
)

GB = 1024**3
CFG = PolicyConfig(name="fifo")


def snap(
    workers: list[WorkerView], jobs: list[JobView], pending: list[PendingCall]
) -> ClusterSnapshot:
    return ClusterSnapshot(
        now=100.0,
        workers={w.worker_id: w for w in workers},
        jobs={j.job_id: j for j in jobs},
        pending=tuple(pending),
    )


def call(rid: str, job: str, t: float, fn: Function = Function.FORWARD_BACKWARD) -> PendingCall:
    return PendingCall(rid, job, fn, t)


def test_new_job_is_admitted_then_run() -> None:
    s = snap([WorkerView("w0", GB, GB)], [JobView("a", GB // 4)], [call("r1", "a", 1.0)])
    actions = plan(s, CFG)
    assert actions[0] == Admit("a", "w0")
    assert isinstance(actions[1], Run) and actions[1].request_ids == ("r1",)


def test_admission_spreads_jobs_over_the_least_loaded_group() -> None:
    workers = [WorkerView("w0", GB, GB), WorkerView("w1", GB, GB)]
    jobs = [JobView("old", GB // 2, home="w0", tier=Tier.DEVICE), JobView("new", GB // 4)]
    actions = plan(snap(workers, jobs, [call("r", "new", 1.0)]), CFG)
    assert Admit("new", "w1") in actions


def test_too_large_job_is_refused_with_what_to_change() -> None:
    s = snap([WorkerView("w0", GB, GB)], [JobView("big", 2 * GB)], [call("r", "big", 1.0)])
    (reject,) = plan(s, CFG)
    assert isinstance(reject, Reject) and reject.reason == RejectReason.TOO_LARGE
    assert "PLEXRL_WORKER_DEVICE_BYTES" in reject.detail


def test_no_workers_is_a_refusal_that_says_so() -> None:
    (reject,) = plan(snap([], [JobView("a", 1)], [call("r", "a", 1.0)]), CFG)
    assert isinstance(reject, Reject) and reject.reason == RejectReason.NO_WORKERS


def test_oldest_call_first_and_consecutive_calls_of_a_job_batched() -> None:
    w = WorkerView("w0", GB, GB)
    jobs = [
        JobView("a", 10, home="w0", tier=Tier.DEVICE),
        JobView("b", 10, home="w0", tier=Tier.DEVICE),
    ]
    pending = [
        call("b1", "b", 1.0),
        call("a1", "a", 2.0),
        call("b2", "b", 3.0, Function.OPTIM_STEP),
    ]
    (run,) = plan(snap([w], jobs, pending), CFG)
    assert isinstance(run, Run) and run.job_id == "b" and run.request_ids == ("b1", "b2")


def test_tenants_take_turns_however_many_calls_one_queued_first() -> None:
    """Tenant x queued four jobs' calls before tenant y's one; x was served last (its job
    just ended a call), so y goes next, then x again, oldest call first."""
    w = WorkerView("w0", GB, GB)
    jobs = [
        JobView(f"x{i}", 10, home="w0", tier=Tier.DEVICE, tenant="x", last_active=50.0 + i)
        for i in range(4)
    ] + [JobView("y0", 10, home="w0", tier=Tier.DEVICE, tenant="y", last_active=40.0)]
    pending = [call(f"rx{i}", f"x{i}", 1.0 + i) for i in range(4)] + [call("ry", "y0", 9.0)]
    order = []
    for _ in range(3):
        (run,) = plan(snap([w], jobs, pending), CFG)
        assert isinstance(run, Run)
        order.append(run.job_id)
        pending = [p for p in pending if p.request_id not in run.request_ids]
        jobs = [
            JobView(j.job_id, 10, home="w0", tier=Tier.DEVICE, tenant=j.tenant, last_active=99.0)
            if j.job_id == run.job_id
            else j
            for j in jobs
        ]
    assert order == ["y0", "x0", "x1"]


def test_one_tenant_is_plain_fifo() -> None:
    w = WorkerView("w0", GB, GB)
    jobs = [
        JobView("a", 10, home="w0", tier=Tier.DEVICE, tenant="t", last_active=5.0),
        JobView("b", 10, home="w0", tier=Tier.DEVICE, tenant="t", last_active=1.0),
    ]
    (run,) = plan(snap([w], jobs, [call("b1", "b", 2.0), call("a1", "a", 1.0)]), CFG)
    assert isinstance(run, Run) and run.job_id == "a"


def test_busy_worker_gets_nothing() -> None:
    w = WorkerView("w0", GB, GB, running="a")
    jobs = [
        JobView("a", 10, home="w0", tier=Tier.DEVICE),
        JobView("b", 10, home="w0", tier=Tier.HOST),
    ]
    assert plan(snap([w], jobs, [call("b1", "b", 1.0)]), CFG) == ()


def test_batch_is_capped() -> None:
    w = WorkerView("w0", GB, GB)
    jobs = [JobView("a", 10, home="w0", tier=Tier.DEVICE)]
    pending = [call(f"r{i}", "a", float(i)) for i in range(5)]
    (run,) = plan(snap([w], jobs, pending), PolicyConfig(name="fifo", max_calls_per_run=2))
    assert isinstance(run, Run) and run.request_ids == ("r0", "r1")


def test_onload_evicts_least_recently_active_to_host_then_disk() -> None:
    w = WorkerView("w0", device_bytes=100, host_bytes=40)
    jobs = [
        JobView("old", 40, home="w0", tier=Tier.DEVICE, last_active=1.0),
        JobView("older", 40, home="w0", tier=Tier.DEVICE, last_active=0.5),
        JobView("recent", 20, home="w0", tier=Tier.DEVICE, last_active=9.0),
        JobView("next", 70, home="w0", tier=Tier.DISK),
    ]
    (run,) = plan(snap([w], jobs, [call("r", "next", 1.0)]), CFG)
    assert isinstance(run, Run)
    # 100 used + 70 needed - 100 capacity = 70 to free: `older` fits the host, `old` goes to disk.
    assert run.evict == (Move("older", Tier.HOST), Move("old", Tier.DISK))
    assert run.expected_swap_s > 0


def test_two_idle_groups_both_get_work_in_one_plan() -> None:
    workers = [WorkerView("w0", GB, GB), WorkerView("w1", GB, GB)]
    jobs = [
        JobView("a", 1, home="w0", tier=Tier.DEVICE),
        JobView("b", 1, home="w1", tier=Tier.DEVICE),
    ]
    runs = plan(snap(workers, jobs, [call("a1", "a", 1.0), call("b1", "b", 2.0)]), CFG)
    assert {(r.worker_id, r.job_id) for r in runs if isinstance(r, Run)} == {
        ("w0", "a"),
        ("w1", "b"),
    }


def test_unknown_policy_names_the_choices() -> None:
    import pytest

    with pytest.raises(ValueError, match="fifo"):
        plan(snap([], [], []), PolicyConfig(name="nope"))
