"""Preemption: a group's running sample batch yields to a waiting job whose calls are
short beside the batch's remaining seconds, once, and never where that job cannot fit."""

from __future__ import annotations

from dataclasses import replace

from plexrl.messages import Function, Tier
from plexrl.policy import (
    CallEstimates,
    ClusterSnapshot,
    JobView,
    PendingCall,
    PolicyConfig,
    Preempt,
    WorkerView,
    decide,
    preemptions,
)

GB = 10**9
CFG = PolicyConfig(name="plexrl", hold_s=0.0, preempt_ratio=0.5, preempt_after_s=0.05)
TRAIN = CallEstimates({Function.FORWARD_BACKWARD: 0.5, Function.OPTIM_STEP: 0.1})


def job(jid: str, tier: Tier = Tier.DEVICE, state: int = GB, **kw: object) -> JobView:
    return JobView(jid, state_bytes=state, home="g0", tier=tier, **kw)  # type: ignore[arg-type]


def snap(
    jobs: list[JobView],
    calls: list[PendingCall],
    *,
    now: float = 100.0,
    since: float | None = 99.0,
    busy_until: float = 110.0,
    device: int = 10 * GB,
) -> ClusterSnapshot:
    worker = WorkerView(
        "g0",
        device,
        10 * GB,
        running="a",
        busy_until=busy_until,
        preemptible_since=since,
    )
    return ClusterSnapshot(
        now=now,
        workers={"g0": worker},
        jobs={j.job_id: j for j in jobs},
        pending=tuple(calls),
    )


def fb(jid: str, n: int = 1) -> PendingCall:
    return PendingCall(f"{jid}/{n}", jid, Function.FORWARD_BACKWARD, 99.5)


def test_a_long_batch_yields_to_a_short_training_call() -> None:
    s = snap([job("a"), job("b", estimates=TRAIN)], [fb("b")])
    assert preemptions(s, CFG) == (Preempt("g0", "a", "b"),)
    # The live decision carries it (the plexrl policy only).
    assert Preempt("g0", "a", "b") in decide(s, CFG).plan
    assert not [x for x in decide(s, PolicyConfig(name="fifo")).plan if isinstance(x, Preempt)]


def test_no_yield_when_the_waiting_work_is_not_short_beside_the_rest() -> None:
    # 10 s left, ratio 0.5: 5 s of waiting work may cut in, 6 s may not.
    slow = CallEstimates({Function.FORWARD_BACKWARD: 6.0})
    assert preemptions(snap([job("a"), job("b", estimates=slow)], [fb("b")]), CFG) == ()
    # Two calls of 0.5 s each do; the batch nearly done (1 s left) does not yield to them.
    two = [fb("b", 1), fb("b", 2)]
    assert preemptions(snap([job("a"), job("b", estimates=TRAIN)], two), CFG)
    late = snap([job("a"), job("b", estimates=TRAIN)], two, busy_until=101.0)
    assert preemptions(late, CFG) == ()
    # Overdue (past its expected end): the tail release is the batch's way out.
    overdue = snap([job("a"), job("b", estimates=TRAIN)], two, busy_until=99.9)
    assert preemptions(overdue, CFG) == ()


def test_no_yield_for_a_young_batch_an_asked_one_or_with_it_turned_off() -> None:
    jobs, calls = [job("a"), job("b", estimates=TRAIN)], [fb("b")]
    assert preemptions(snap(jobs, calls, since=99.99), CFG) == ()  # ran 10 ms only
    assert preemptions(snap(jobs, calls, since=None), CFG) == ()  # not preemptible
    off = PolicyConfig(name="plexrl", preempt_ratio=0.0)
    assert preemptions(snap(jobs, calls), off) == ()
    # The running job's own calls never preempt it.
    assert preemptions(snap([job("a", estimates=TRAIN)], [fb("a")]), CFG) == ()


def test_the_least_work_goes_first_and_the_swap_in_counts() -> None:
    quick = CallEstimates({Function.FORWARD_BACKWARD: 0.2})
    jobs = [job("a"), job("b", estimates=TRAIN), job("c", estimates=quick)]
    assert preemptions(snap(jobs, [fb("b"), fb("c")]), CFG)[0].for_job == "c"
    # c off the device: bringing 40 GB back from disk (8 s) makes it the longer wait.
    far = [job("a"), job("b", estimates=TRAIN), job("c", Tier.DISK, 40 * GB, estimates=quick)]
    chosen = preemptions(snap(far, [fb("b"), fb("c")], device=100 * GB), CFG)
    assert [p.for_job for p in chosen] == ["b"]


def test_no_yield_to_a_job_that_could_only_come_in_by_evicting_the_runner() -> None:
    # The device holds a (running) and nothing else fits beside it.
    jobs = [job("a", state=8 * GB), job("b", Tier.HOST, 4 * GB, estimates=TRAIN)]
    assert preemptions(snap(jobs, [fb("b")], device=10 * GB), CFG) == ()


def test_sliced_training_yields_to_its_own_jobs_sample_of_saved_weights() -> None:
    # a's asynchronous training runs sliced; its rollout lane's next sample (of saved
    # weights) came in behind its next training call.
    def sliced(calls: list[PendingCall]) -> ClusterSnapshot:
        s = snap([job("a", estimates=TRAIN)], calls)
        worker = replace(s.workers["g0"], sliced=True)
        return replace(s, workers={"g0": worker})

    sample = PendingCall("a/s", "a", Function.SAMPLE, 99.8, portable=True)
    # The job's Runs take the sample first: it needs nothing of the training calls.
    assert [c.request_id for c in sliced([fb("a", 2), sample]).calls_view("a")] == ["a/s", "a/2"]
    assert preemptions(sliced([fb("a", 2), sample]), CFG) == (Preempt("g0", "a", "a"),)
    # A sample of the job's own training weights waits, as its training calls do.
    own = replace(sample, portable=False)
    assert preemptions(sliced([fb("a", 2), own]), CFG) == ()
    assert preemptions(sliced([fb("a", 2)]), CFG) == ()
