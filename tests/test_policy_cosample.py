"""Co-sampling: a Run of sample calls takes other resident jobs' leading sample calls."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from plexrl.messages import Function, Tier
from plexrl.policy import (
    ClusterSnapshot,
    JobView,
    PendingCall,
    Run,
    WorkerView,
    co_sample,
    decide,
)
from plexrl.policy.actions import Admit, Move, Rehome
from plexrl.settings import SchedulerSettings
from plexrl_scheduler.main import policy_config

W = WorkerView(worker_id="w0", device_bytes=10**9, host_bytes=10**9)


def _job(
    job_id: str,
    *,
    home: str = "w0",
    tier: Tier | None = Tier.DEVICE,
    base: str = "m",
    state: int = 100,
) -> JobView:
    return JobView(job_id=job_id, state_bytes=state, home=home, tier=tier, base_model=base)


def _snapshot(
    jobs: list[JobView], calls: list[tuple[str, str, Function, float]]
) -> ClusterSnapshot:
    return ClusterSnapshot(
        now=10.0,
        workers={"w0": W, "w1": WorkerView(worker_id="w1", device_bytes=10**9, host_bytes=10**9)},
        jobs={j.job_id: j for j in jobs},
        pending=tuple(PendingCall(rid, job, fn, at) for rid, job, fn, at in calls),
    )


S, FB = Function.SAMPLE, Function.FORWARD_BACKWARD


def test_a_sample_run_takes_resident_jobs_leading_samples_oldest_first() -> None:
    snap = _snapshot(
        [
            _job("a"),
            _job("b"),  # resident, samples then a training call: only the samples join
            _job("c", tier=Tier.HOST),  # would need a swap
            _job("d", base="other"),  # another base model
            _job("e", home="w1"),  # another group
            _job("f", tier=None, state=0),  # a sampler session: nothing to move
        ],
        [
            ("a1", "a", S, 1.0),
            ("b1", "b", S, 0.5),
            ("b2", "b", S, 3.0),
            ("b3", "b", FB, 4.0),
            ("b4", "b", S, 5.0),
            ("c1", "c", S, 1.0),
            ("d1", "d", S, 1.0),
            ("e1", "e", S, 1.0),
            ("f1", "f", S, 2.0),
        ],
    )
    run = Run("w0", "a", ("a1",))
    (out,) = co_sample(snap, (run,), max_calls=32)
    assert isinstance(out, Run) and out.job_id == "a"
    assert out.request_ids == ("a1", "b1", "f1", "b2")


def test_a_job_the_same_plan_moves_does_not_join() -> None:
    # b re-homed to w1 and c evicted by a's Run, in the plan that runs a: neither rides
    # along (b's state leaves the group, c's the device); d, staying, does.
    snap = _snapshot(
        [_job("a"), _job("b"), _job("c"), _job("d")],
        [("a1", "a", S, 1.0), ("b1", "b", S, 1.0), ("c1", "c", S, 1.0), ("d1", "d", S, 1.0)],
    )
    run = Run("w0", "a", ("a1",), evict=(Move("c", Tier.HOST),))
    plan = (Rehome("b", "w0", "w1"), run)
    _, out = co_sample(snap, plan, max_calls=32)
    assert isinstance(out, Run) and out.request_ids == ("a1", "d1")
    # A review that keeps b where it is moves nothing: b joins.
    _, kept = co_sample(snap, (Rehome("b", "w0", "w0"), Run("w0", "a", ("a1",))), 32)
    assert isinstance(kept, Run) and kept.request_ids == ("a1", "b1", "c1", "d1")


def test_room_runs_out_and_training_runs_are_left_alone() -> None:
    snap = _snapshot(
        [_job("a"), _job("b")],
        [("a1", "a", S, 1.0), ("a2", "a", FB, 1.5), ("b1", "b", S, 2.0), ("b2", "b", S, 3.0)],
    )
    (full,) = co_sample(snap, (Run("w0", "a", ("a1",)),), max_calls=2)
    assert isinstance(full, Run) and full.request_ids == ("a1", "b1")
    mixed = Run("w0", "a", ("a1", "a2"))
    assert co_sample(snap, (mixed,), max_calls=32) == (mixed,)
    assert co_sample(snap, (Run("w0", "a", ("a1",)),), max_calls=0)[0] == Run("w0", "a", ("a1",))
    # A job with its own Run in the plan keeps its calls there.
    plan = (Run("w0", "a", ("a1",)), Admit("b", "w0"))
    assert co_sample(snap, plan, max_calls=32)[0].request_ids == ("a1", "b1", "b2")  # type: ignore[union-attr]


def test_the_scheduler_setting_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # PLEXRL_MAX_COSAMPLED_CALLS reaches the live policy: 0 leaves a sample Run alone.
    snap = _snapshot([_job("a"), _job("b")], [("a1", "a", S, 1.0), ("b1", "b", S, 2.0)])
    for value, calls in (("32", ("a1", "b1")), ("0", ("a1",))):
        monkeypatch.setenv("PLEXRL_MAX_COSAMPLED_CALLS", value)
        config = replace(policy_config(SchedulerSettings()), name="fifo")
        (run,) = [
            a for a in decide(snap, config).plan if isinstance(a, Run) and a.worker_id == "w0"
        ]
        assert run.request_ids == calls
    monkeypatch.setenv("PLEXRL_MAX_COSAMPLED_CALLS", "-1")
    with pytest.raises(ValidationError, match="max_cosampled_calls"):
        SchedulerSettings()
