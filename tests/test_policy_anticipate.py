"""Anticipation: a free group waits a round trip for the job that is in a burst."""

from __future__ import annotations

from plexrl.messages import Function, Tier
from plexrl.policy import (
    CallEstimates,
    ClusterSnapshot,
    JobView,
    PendingCall,
    PolicyConfig,
    Run,
    WorkerView,
    decide,
)

GB = 10**9
CFG = PolicyConfig(name="plexrl", hold_s=0.1)


def job(jid: str, last_active: float = 0.0, gap: float = 0.0, **kw: object) -> JobView:
    return JobView(
        jid,
        state_bytes=GB,
        home="g0",
        tier=kw.pop("tier", Tier.DEVICE),  # type: ignore[arg-type]
        last_active=last_active,
        last_gap_s=gap,
        **kw,  # type: ignore[arg-type]
    )


def snap(jobs: list[JobView], calls: list[PendingCall], now: float) -> ClusterSnapshot:
    return ClusterSnapshot(
        now=now,
        workers={"g0": WorkerView("g0", 10 * GB, 10 * GB)},
        jobs={j.job_id: j for j in jobs},
        pending=tuple(calls),
    )


def b_call(at: float = 99.0) -> PendingCall:
    return PendingCall("b/1", "b", Function.FORWARD_BACKWARD, at)


def runs(plan: tuple[object, ...]) -> list[str]:
    return [a.job_id for a in plan if isinstance(a, Run)]


def test_the_group_waits_for_a_bursting_jobs_next_call_then_serves_the_other() -> None:
    # a's call ended at 100.00 and its last gap was 20 ms: hold until 100.04.
    a, b = job("a", last_active=100.0, gap=0.02), job("b", last_active=50.0)
    s = snap([a, b], [b_call()], now=100.01)
    assert runs(decide(s, CFG).plan) == []
    assert decide(s, CFG).wake_at == 100.04
    # a's call arrived: it runs (and b still waits behind it, as the policy orders).
    s = snap([a, b], [b_call(), PendingCall("a/2", "a", Function.FORWARD_BACKWARD, 100.02)], 100.02)
    assert decide(s, CFG).wake_at is None
    assert runs(decide(s, CFG).plan)
    # a did not come back in time: b runs.
    assert runs(decide(snap([a, b], [b_call()], now=100.05), CFG).plan) == ["b"]


def test_no_hold_after_a_stall_an_idle_hint_or_off_the_device_or_under_fifo() -> None:
    b = job("b", last_active=50.0)
    for a in (
        job("a", last_active=100.0, gap=2.0),  # its last gap was a reward stall
        job("a", last_active=100.0, gap=0.02, idle_until=103.0),  # it said it is idle
        job("a", last_active=100.0, gap=0.02, tier=Tier.HOST),  # swapped out already
        job("a", last_active=100.0),  # no gap seen yet
    ):
        s = snap([a, b], [b_call()], now=100.01)
        assert runs(decide(s, CFG).plan) == ["b"], a
    a = job("a", last_active=100.0, gap=0.02)
    s = snap([a, b], [b_call()], now=100.01)
    assert runs(decide(s, PolicyConfig(name="fifo", hold_s=0.1)).plan) == ["b"]
    assert runs(decide(s, PolicyConfig(name="plexrl", hold_s=0.0)).plan) == ["b"]  # off
    long = job("a", last_active=100.0, gap=0.02, burst_s=10.0)  # a quantum of burst
    assert runs(decide(snap([long, b], [b_call()], now=100.01), CFG).plan) == ["b"]


def test_the_bursting_jobs_call_goes_first_though_the_other_waited_longer() -> None:
    a, b = job("a", last_active=100.0, gap=0.02), job("b", last_active=50.0)
    calls = [b_call(99.0), PendingCall("a/2", "a", Function.FORWARD_BACKWARD, 100.02)]
    assert runs(decide(snap([a, b], calls, now=100.02), CFG).plan)[0] == "a"
    # Without anticipation the older call (b's) goes first at equal work.
    off = PolicyConfig(name="plexrl", hold_s=0.0)
    assert runs(decide(snap([a, b], calls, now=100.02), off).plan)[0] == "b"


def test_a_burst_of_long_calls_neither_holds_the_group_nor_cuts_ahead_of_short_work() -> None:
    # a calls back to back, but every step of it has a 1 s rollout: b's 30 ms training
    # call should not wait out a's burst (shortest remaining work first).
    rollout = CallEstimates(
        {Function.SAMPLE: 1.0, Function.FORWARD_BACKWARD: 0.03, Function.OPTIM_STEP: 0.02}
    )
    steps = (Function.SAMPLE, Function.FORWARD_BACKWARD, Function.OPTIM_STEP)
    short = CallEstimates({Function.FORWARD_BACKWARD: 0.03})
    a = job("a", last_active=100.0, gap=0.02, estimates=rollout, step_calls=steps)
    b = job("b", last_active=50.0, estimates=short)
    s = snap([a, b], [b_call()], now=100.01)
    assert decide(s, CFG).wake_at is None and runs(decide(s, CFG).plan) == ["b"]  # no hold
    # a's rollout arrived: b's shorter call goes first all the same.
    calls = [b_call(99.0), PendingCall("a/2", "a", Function.SAMPLE, 100.02)]
    assert runs(decide(snap([a, b], calls, now=100.02), CFG).plan)[0] == "b"
    # Like work (within BURST_TOLERANCE) keeps run to completion.
    like = job("a", last_active=100.0, gap=0.02, estimates=short, step_calls=steps[1:2])
    calls = [b_call(99.0), PendingCall("a/2", "a", Function.FORWARD_BACKWARD, 100.02)]
    assert runs(decide(snap([like, b], calls, now=100.02), CFG).plan)[0] == "a"
