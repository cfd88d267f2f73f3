"""Which calls follow a running Run at once (`plexrl.policy.follow_up`): the Run the
policy itself would have made, on hand-built snapshots."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from plexrl.messages import Function, Tier
from plexrl.policy import (
    CallEstimates,
    ClusterSnapshot,
    JobView,
    PendingCall,
    PolicyConfig,
    Run,
    WorkerView,
    follow_up,
    plan,
)
from plexrl.policy.costs import SharingCosts
from plexrl.policy.defer import beside_own_s, waiting_sooner

FB, OPT, SAVE, SAMPLE = (
    Function.FORWARD_BACKWARD,
    Function.OPTIM_STEP,
    Function.SAVE,
    Function.SAMPLE,
)
EST = CallEstimates({SAMPLE: 60.0, FB: 6.0, OPT: 1.0, SAVE: 1.0})
CFG = PolicyConfig(name="plexrl")  # quantum 10 s


def job(jid: str, **kw: Any) -> JobView:
    return JobView(
        jid, state_bytes=10, home="g0", tier=Tier.DEVICE, duty_cycle=0.2, estimates=EST, **kw
    )


def calls(jid: str, *functions: Function) -> list[PendingCall]:
    return [PendingCall(f"{jid}{i}", jid, f, 90.0 + i) for i, f in enumerate(functions)]


def snap(running: str | None, jobs: list[JobView], queued: list[PendingCall]) -> ClusterSnapshot:
    worker = WorkerView("g0", device_bytes=100, host_bytes=100, running=running)
    return ClusterSnapshot(
        now=100.0, workers={"g0": worker}, jobs={j.job_id: j for j in jobs}, pending=tuple(queued)
    )


def test_a_job_alone_on_its_group_sends_its_next_calls_up_to_a_sample() -> None:
    queued = calls("a", OPT, SAVE, FB, FB, SAMPLE, FB)
    alone = snap("a", [job("a")], queued)
    assert follow_up(alone, CFG, "g0", [FB]) == ("a0", "a1", "a2", "a3")
    assert follow_up(alone, replace(CFG, max_calls_per_run=2), "g0", [FB]) == ("a0", "a1")
    for name in ("fifo", "pack", "spread"):  # no quantum in those policies
        assert len(follow_up(alone, PolicyConfig(name=name), "g0", [FB])) == 4


def test_on_a_shared_group_the_calls_follow_within_the_runs_quantum() -> None:
    queued = calls("a", OPT, SAVE, FB, OPT)
    shared = snap("a", [job("a"), job("b")], queued)
    # 6 s running, then 1 + 1 s: a third call (6 s more) would pass the 10 s quantum.
    assert follow_up(shared, CFG, "g0", [FB]) == ("a0", "a1")
    assert follow_up(shared, CFG, "g0", [FB, FB]) == ()
    assert follow_up(shared, replace(CFG, quantum_s=60.0), "g0", [FB]) == ("a0", "a1", "a2", "a3")
    # Another tenant's active job there: its shorter quantum (0.25 s) leaves no room.
    assert follow_up(snap("a", [job("a"), job("b", tenant="u")], queued), CFG, "g0", [OPT]) == ()
    # The neighbour said it stays idle for a minute: the Run may go on to then.
    quiet = snap("a", [job("a"), job("b", idle_until=160.0)], queued)
    assert follow_up(quiet, CFG, "g0", [FB]) == ("a0", "a1", "a2", "a3")


def test_nothing_follows_while_a_neighbour_waits_or_behind_a_sample_batch() -> None:
    mine = calls("a", OPT, SAVE)
    assert (
        follow_up(snap("a", [job("a"), job("b")], [*mine, *calls("b", FB)]), CFG, "g0", [FB]) == ()
    )
    # An asynchronous job's training queued behind its own rollout: decided at the
    # batch's end (its stragglers, a neighbour's preemption), not sent behind it.
    alone = snap("a", [job("a", staleness=1)], mine)
    assert follow_up(alone, CFG, "g0", [SAMPLE]) == ()
    assert follow_up(alone, CFG, "g0", [FB, SAMPLE]) == ()
    assert follow_up(snap(None, [job("a")], mine), CFG, "g0", [FB]) == ()
    assert follow_up(snap("z", [job("a")], mine), CFG, "g0", [FB]) == ()


def test_training_passed_over_for_the_groups_stragglers_does_not_follow() -> None:
    a = job("a", staleness=2, step_calls=(SAMPLE, FB, OPT, SAVE))
    queued = calls("a", OPT, SAVE)
    worker = WorkerView("g0", device_bytes=100, host_bytes=100, running="a", tail_until=105.0)
    view = ClusterSnapshot(now=100.0, workers={"g0": worker}, jobs={"a": a}, pending=tuple(queued))
    assert follow_up(view, CFG, "g0", [FB]) == ()
    ended = replace(view, workers={"g0": replace(worker, tail_until=0.0)})
    assert follow_up(ended, CFG, "g0", [FB]) == ("a0", "a1")


def test_training_waits_out_its_own_stragglers_whatever_its_slack() -> None:
    # Busy 68 s of every 68.07 s step: no slack to wait in for another job's stragglers.
    # Its 8 s of training beside its own stragglers' last 30 s (at 3/4 of the group, for
    # 10.7 s) would slow them by a fifth of that: scored 20 s after, at 52.1 s from now;
    # waiting, at 50 s, its training done by then.
    a = job("a", staleness=1, step_calls=(SAMPLE, FB, OPT, SAVE), stall_s=20.0)
    a = replace(a, duty_cycle=0.999)
    queued = calls("a", OPT, SAVE)
    worker = WorkerView("g0", device_bytes=100, host_bytes=100, running="a", tail_until=130.0)
    others = ClusterSnapshot(
        now=100.0, workers={"g0": worker}, jobs={"a": a}, pending=tuple(queued)
    )
    assert follow_up(others, CFG, "g0", [FB]) == ("a0", "a1")
    own = replace(others, workers={"g0": replace(worker, tail_jobs=frozenset({"a"}))})
    assert follow_up(own, CFG, "g0", [FB]) == ()
    idle = replace(own, workers={"g0": replace(own.workers["g0"], running=None)})
    assert not [x for x in plan(idle, CFG) if isinstance(x, Run)]
    # Without a stall to hide its training it runs beside them (its rollout scored at
    # 32.1 s, waiting 38 s); where stragglers decode at full speed beside a Run, too.
    hurried = replace(own, jobs={"a": replace(a, stall_s=0.0)})
    assert follow_up(hurried, CFG, "g0", [FB]) == ("a0", "a1")
    free = SharingCosts(tail_contention=1.0)
    assert follow_up(own, replace(CFG, sharing=free), "g0", [FB]) == ("a0", "a1")
    measured = replace(own, workers={"g0": replace(own.workers["g0"], sharing=free)})
    assert follow_up(measured, CFG, "g0", [FB]) == ("a0", "a1")
    idle_free = replace(idle, workers={"g0": replace(idle.workers["g0"], sharing=free)})
    assert [x for x in plan(idle_free, CFG) if isinstance(x, Run)]


def test_what_the_policys_run_left_at_its_quantum_does_not_follow_it() -> None:
    queued = calls("a", FB, FB, OPT, SAVE)
    shared = snap(None, [job("a"), job("b")], queued)
    (run,) = [a for a in plan(shared, CFG) if isinstance(a, Run)]
    assert run.request_ids == ("a0",)  # 6 s; a second 6 s call would pass 10 s
    started = replace(
        shared,
        workers={"g0": replace(shared.workers["g0"], running="a")},
        pending=tuple(c for c in queued if c.request_id not in run.request_ids),
    )
    assert follow_up(started, CFG, "g0", [FB]) == ()


def test_a_long_training_runs_beside_its_own_stragglers_a_short_one_waits() -> None:
    # 60 s of training beside 10 s of stragglers at contention 2, the training at 3/4 of
    # the group: the stragglers end at 20 s, the training at 60 + 0.25 x 20 = 65 s, where
    # waiting ends it at 70 s. 6 s of training hidden by a 30 s stall: beside them, the
    # stragglers end at 10 + 8 x 1/2 = 14 s and the rollout is scored at 44 s; waiting,
    # at 40 s.
    assert beside_own_s(10.0, 60.0, 0.0, 2.0, 0.25) == pytest.approx(65.0)
    assert not waiting_sooner(10.0, 60.0, 0.0, 2.0, 0.25)
    assert beside_own_s(10.0, 6.0, 30.0, 2.0, 0.25) == pytest.approx(44.0)
    assert waiting_sooner(10.0, 6.0, 30.0, 2.0, 0.25)
    assert not waiting_sooner(10.0, 6.0, 30.0, 1.0, 0.25)  # no contention: never
    assert not waiting_sooner(0.0, 6.0, 30.0, 2.0, 0.25)  # nothing left to wait for
