"""Pack, Spread and Spread+Backfill on hand-built snapshots (no Kafka, no Redis)."""

from __future__ import annotations

from plexrl.messages import Function, Tier
from plexrl.policy import (
    Admit,
    CallEstimates,
    ClusterSnapshot,
    JobView,
    PendingCall,
    PolicyConfig,
    Reject,
    RejectReason,
    Run,
    WorkerView,
    plan,
)

GB = 10**9


def worker(wid: str, devices: int = 8, running: str | None = None) -> WorkerView:
    return WorkerView(
        wid, device_bytes=80 * GB, host_bytes=400 * GB, devices=devices, running=running
    )


def job(
    jid: str,
    home: str | None = None,
    duty: float = 0.4,
    devices: int = 8,
    state: int = 10 * GB,
    tier: Tier | None = None,
) -> JobView:
    return JobView(
        jid,
        state_bytes=state,
        home=home,
        tier=tier if tier is not None else (Tier.DEVICE if home else None),
        devices=devices,
        duty_cycle=duty,
        estimates=CallEstimates({Function.SAMPLE: 60.0, Function.FORWARD_BACKWARD: 30.0}),
    )


def call(jid: str, at: float, fn: Function = Function.CREATE, n: int = 0) -> PendingCall:
    return PendingCall(f"{jid}/{fn.value}{n}", jid, fn, at)


def snap(
    workers: list[WorkerView], jobs: list[JobView], calls: list[PendingCall]
) -> ClusterSnapshot:
    return ClusterSnapshot(
        now=100.0,
        workers={w.worker_id: w for w in workers},
        jobs={j.job_id: j for j in jobs},
        pending=tuple(sorted(calls, key=lambda c: c.arrival_time)),
    )


def admits(actions) -> dict[str, str]:
    return {a.job_id: a.worker_id for a in actions if isinstance(a, Admit)}


def test_pack_fills_the_first_group_before_the_next():
    s = snap(
        [worker("g0", running="x"), worker("g1")],
        [job("x", "g0", duty=0.3), job("new", duty=0.3)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, PolicyConfig(name="pack"))) == {"new": "g0"}


def test_spread_picks_the_least_loaded_group():
    s = snap(
        [worker("g0", running="x"), worker("g1")],
        [job("x", "g0", duty=0.3), job("new", duty=0.3)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, PolicyConfig(name="spread"))) == {"new": "g1"}


def test_load_cap_makes_a_job_wait_and_fifo_holds_the_rest_back():
    # g0 carries 0.7; "big" (0.5) fits nowhere; "small" (0.2) would fit behind it.
    s = snap(
        [worker("g0", running="x")],
        [job("x", "g0", duty=0.7), job("big", duty=0.5), job("small", duty=0.2)],
        [call("big", 1.0), call("small", 2.0)],
    )
    for name in ("pack", "spread"):
        assert admits(plan(s, PolicyConfig(name=name))) == {}, name
    assert admits(plan(s, PolicyConfig(name="spread-backfill"))) == {"small": "g0"}


def test_max_load_is_configurable():
    s = snap(
        [worker("g0", running="x")],
        [job("x", "g0", duty=0.7), job("new", duty=0.5)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, PolicyConfig(name="spread", max_load=1.3))) == {"new": "g0"}


def test_an_empty_group_takes_any_job_even_above_the_cap():
    s = snap([worker("g0")], [job("hog", duty=1.4)], [call("hog", 1.0)])
    assert admits(plan(s, PolicyConfig(name="pack"))) == {"hog": "g0"}


def test_jobs_only_share_groups_of_their_own_size():
    s = snap(
        [worker("big", devices=64), worker("small", devices=8, running="x")],
        [job("x", "small", duty=0.9), job("new", devices=8, duty=0.3)],
        [call("new", 1.0)],
    )
    # The 8-device group is over the cap, and the 64-device group is another size class.
    assert admits(plan(s, PolicyConfig(name="spread-backfill"))) == {}


def test_a_job_no_group_can_hold_is_rejected_with_the_reason():
    s = snap([worker("g0")], [job("huge", state=900 * GB)], [call("huge", 1.0)])
    for name in ("pack", "spread", "spread-backfill", "plexrl", "fifo"):
        (action,) = plan(s, PolicyConfig(name=name))
        assert isinstance(action, Reject) and action.reason == RejectReason.TOO_LARGE


def test_reference_dispatch_is_fifo_and_batches_a_jobs_calls():
    s = snap(
        [worker("g0")],
        [job("a", "g0"), job("b", "g0")],
        [
            call("b", 5.0, Function.SAMPLE),
            call("a", 7.0, Function.FORWARD_BACKWARD),
            call("a", 7.0, Function.OPTIM_STEP),
        ],
    )
    for name in ("pack", "spread", "spread-backfill"):
        (run,) = plan(s, PolicyConfig(name=name))
        assert isinstance(run, Run) and run.job_id == "b" and run.worker_id == "g0", name
    s2 = snap([worker("g0")], [job("a", "g0")], [c for c in s.pending if c.job_id == "a"])
    (run,) = plan(s2, PolicyConfig(name="spread-backfill"))
    assert isinstance(run, Run) and len(run.request_ids) == 2


def test_a_busy_group_gets_no_run():
    s = snap(
        [worker("g0", running="b")],
        [job("a", "g0"), job("b", "g0")],
        [call("a", 1.0, Function.SAMPLE)],
    )
    for name in ("pack", "spread", "spread-backfill", "plexrl", "fifo"):
        assert not [a for a in plan(s, PolicyConfig(name=name)) if isinstance(a, Run)], name
