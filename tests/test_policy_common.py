"""The shared building blocks, and FIFO, which the live scheduler runs by default."""

from __future__ import annotations

from plexrl.messages import Function, Tier
from plexrl.policy import (
    POLICIES,
    Admit,
    ClusterSnapshot,
    JobView,
    Move,
    PendingCall,
    PolicyConfig,
    Run,
    WorkerView,
    plan,
)
from plexrl.policy.common import make_room, size_class

GB = 10**9


def snap(workers, jobs, calls) -> ClusterSnapshot:
    return ClusterSnapshot(
        now=10.0,
        workers={w.worker_id: w for w in workers},
        jobs={j.job_id: j for j in jobs},
        pending=tuple(calls),
    )


def test_every_documented_policy_is_registered():
    assert {"fifo", "pack", "spread", "spread-backfill", "plexrl"} <= set(POLICIES)


def test_snapshot_indexes_answer_per_group_questions():
    s = snap(
        [WorkerView("w0", 100, 100), WorkerView("w1", 100, 100)],
        [
            JobView("a", 10, home="w0", tier=Tier.DEVICE),
            JobView("b", 20, home="w0", tier=Tier.HOST),
            JobView("c", 30, home="w1", tier=Tier.DEVICE),
            JobView("d", 40),
        ],
        [PendingCall("r1", "a", Function.SAMPLE, 1.0), PendingCall("r2", "a", Function.SAVE, 2.0)],
    )
    assert [j.job_id for j in s.homed("w0")] == ["a", "b"]
    assert s.device_used("w0") == 10 and s.host_used("w0") == 20 and s.device_used("w1") == 30
    assert [c.request_id for c in s.calls_of("a")] == ["r1", "r2"] and s.calls_of("d") == []


def test_make_room_evicts_least_recent_first_and_skips_pinned_and_running():
    w = WorkerView("w0", device_bytes=30, host_bytes=8, running="run")
    jobs = [
        JobView("new", 10, home="w0", tier=Tier.DISK),
        JobView("run", 10, home="w0", tier=Tier.DEVICE, last_active=0.0),
        JobView("pin", 10, home="w0", tier=Tier.DEVICE, last_active=1.0, pinned=True),
        JobView("old", 5, home="w0", tier=Tier.DEVICE, last_active=2.0),
        JobView("older", 5, home="w0", tier=Tier.DEVICE, last_active=1.5),
    ]
    s = snap([w], jobs, [])
    # Device holds 30 of 30 and "new" needs 10: "older", then "old", go; the host tier
    # has room for one of them, so the second goes to disk.
    assert make_room(s, "w0", s.jobs["new"]) == (Move("older", Tier.HOST), Move("old", Tier.DISK))
    tight = WorkerView("w0", device_bytes=25, host_bytes=8, running="run")
    blocked = snap([tight], jobs[:3], [])
    assert make_room(blocked, "w0", blocked.jobs["new"]) is None


def test_size_class_keeps_jobs_on_the_smallest_groups_that_fit():
    s = snap(
        [
            WorkerView("a", 100, 100, devices=8),
            WorkerView("b", 100, 100, devices=16),
            WorkerView("c", 100, 100, devices=8),
        ],
        [JobView("j", 10, devices=8), JobView("k", 10, devices=9)],
        [],
    )
    assert [w.worker_id for w in size_class(s, s.jobs["j"])] == ["a", "c"]
    assert [w.worker_id for w in size_class(s, s.jobs["k"])] == ["b"]


def test_fifo_admits_least_loaded_and_runs_oldest_calls_batched():
    s = snap(
        [WorkerView("w0", 100, 100), WorkerView("w1", 100, 100)],
        [JobView("a", 50, home="w0", tier=Tier.DEVICE), JobView("b", 10)],
        [
            PendingCall("b1", "b", Function.CREATE, 1.0),
            PendingCall("a1", "a", Function.FORWARD_BACKWARD, 2.0),
            PendingCall("a2", "a", Function.OPTIM_STEP, 2.0),
            PendingCall("a3", "a", Function.SAVE, 2.0),
        ],
    )
    actions = plan(s, PolicyConfig(name="fifo", max_calls_per_run=2))
    assert actions[0] == Admit("b", "w1")
    runs = {a.worker_id: a for a in actions if isinstance(a, Run)}
    assert runs["w0"].request_ids == ("a1", "a2")
    assert runs["w1"].request_ids == ("b1",)
