"""The project's own policy on hand-built snapshots."""

from __future__ import annotations

import math
from dataclasses import replace
from statistics import NormalDist

import pytest

from plexrl.messages import Function, Tier
from plexrl.policy import (
    Admit,
    CallEstimates,
    ClusterSnapshot,
    JobView,
    Move,
    PendingCall,
    PolicyConfig,
    Prefetch,
    Run,
    WorkerView,
    plan,
)
from plexrl.policy.costs import SharingCosts
from plexrl.policy.defer import slack_s
from plexrl.policy.plexrl_policy import (
    InterferenceFit,
    _sum_sigma,
    call_residual_s,
    figures_of,
    predicted_slowdown,
    step_phases,
    tail_wall_s,
    two_lanes_s,
)
from plexrl.settings import SchedulerSettings
from plexrl_scheduler.main import policy_config

GB = 10**9
EST = CallEstimates(
    {
        Function.SAMPLE: 60.0,
        Function.FORWARD_BACKWARD: 30.0,
        Function.OPTIM_STEP: 5.0,
        Function.SAVE: 5.0,
    }
)


def job(jid: str, home: str | None = None, duty: float = 0.2, **kw) -> JobView:
    kw.setdefault("tier", Tier.DEVICE if home else None)
    return JobView(
        jid,
        state_bytes=kw.pop("state", 10 * GB),
        home=home,
        duty_cycle=duty,
        estimates=kw.pop("estimates", EST),
        **kw,
    )


def worker(wid: str, running: str | None = None, device_gb: int = 80, busy_until: float = 0.0):
    return WorkerView(
        wid,
        device_bytes=device_gb * GB,
        host_bytes=400 * GB,
        running=running,
        busy_until=busy_until,
    )


def snap(workers, jobs, calls, now: float = 100.0) -> ClusterSnapshot:
    return ClusterSnapshot(
        now=now,
        workers={w.worker_id: w for w in workers},
        jobs={j.job_id: j for j in jobs},
        pending=tuple(sorted(calls, key=lambda c: c.arrival_time)),
    )


def call(jid: str, at: float, fn: Function = Function.CREATE) -> PendingCall:
    return PendingCall(f"{jid}/{fn.value}", jid, fn, at)


CFG = PolicyConfig(name="plexrl")


def test_predicted_slowdown_matches_the_formula():
    a, b = job("a", duty=0.2), job("b", duty=0.3)
    # Phases per step: sample 60, training 40; b's calls in progress have 26 s left on
    # average ((3600 + 1600) / 200) and its step lasts 100 / 0.3 s.
    assert step_phases(a) == (60.0, 40.0)
    assert call_residual_s(b) == pytest.approx(26.0)
    # a's 60 s sample meets b's sample (60^2 / 2) and training (40^2 / 2 + 20 x 40 cutting
    # in); a's 40 s training meets b's sample (40^2 / 2 + 20 x 26) and training (40^2 / 2).
    meeting = 1800 + 1600 + 1320 + 800
    wait = meeting / (100 / 0.3)
    assert predicted_slowdown(a, [b]) == pytest.approx(wait / 500 / (1 - 0.3 / 2))
    assert predicted_slowdown(a, []) == 0.0
    assert predicted_slowdown(a, [job("c", duty=1.0)]) == float("inf")


def test_a_neighbours_sliced_training_delays_samples_by_the_rest_of_one_slice():
    a = job("a", duty=0.2)
    whole = job("b", duty=0.3, staleness=1)
    sliced = replace(whole, train_slices=8)  # 30 s forward_backward calls: 3.75 s slices
    assert figures_of(sliced).slice_s == pytest.approx(3.75)
    assert figures_of(replace(whole, staleness=0, train_slices=8)).slice_s == 0.0
    # a's 60 s sample meets b's sample (60^2 / 2) and, instead of b's 40 s of training
    # (40^2 / 2 + 20 x 40 cutting in), the rest of the slice in progress when found in it
    # (40 x 3.75 / 2); a's 40 s training meets all of b's as before (1320 + 800).
    whole_s = 1800 + 1600 + 1320 + 800
    sliced_s = 1800 + 75 + 1320 + 800
    assert predicted_slowdown(a, [sliced]) == pytest.approx(
        predicted_slowdown(a, [whole]) * sliced_s / whole_s
    )
    # Its own samples and its neighbour's waits behind it are as before.
    assert predicted_slowdown(sliced, [a]) == pytest.approx(predicted_slowdown(whole, [a]))


def test_the_costs_of_sharing_add_to_the_waits():
    costs = SharingCosts(switch_s=1.0, tail_min_share=0.25, tail_contention=1.25)
    a, b = job("a", duty=0.2, tail_s=30.0), job("b", duty=0.3, tail_s=20.0)
    # a's step is 500 s (sample 60, training 40), b's 333.3 s. Switches: a's two phases
    # each follow a Run of b (b starts 2 phases per 333 s, 3 in a's 500 s): 2 s.
    # A tail of wall W overlapping Runs O of it takes W = tail + O (1 - 1/1.25), the
    # Runs beside it a third longer (at 3/4 of the group), O = busy x W + queued:
    # b's 20 s tail beside a: busy 100 x 4/3 / 500, queued (a's phases, at most the
    # tail's 25 s longest) (25 + 25) x 60 / 500 = 6 s, W = (20 + 0.2 x 6) / (1 - 0.2 x
    # 0.2667) = 22.39 s. a's 100 busy seconds fall in that tail (or queue behind b's
    # 60 s sample) 82.39 / 333.3 of the time, at a third slower: 8.24 s.
    # a's 30 s tail beside b: busy 0.4, queued (37.5 + 37.5) x 60 / 333.3 = 13.5 s,
    # W = (30 + 2.7) / 0.92 = 35.54 s: 5.54 s more.
    b_tail = (20 + 0.2 * 6) / (1 - 0.2 * 100 * 4 / 3 / 500)
    a_tail = (30 + 0.2 * 13.5) / (1 - 0.2 * 0.4)
    extra = 2.0 + 100 * (b_tail + 60) / (1000 / 3) / 3 + (a_tail - 30)
    free = predicted_slowdown(a, [b])
    assert predicted_slowdown(a, [b], costs) == pytest.approx(free + extra / 500)
    # Free costs predict the waits alone.
    assert predicted_slowdown(a, [b], SharingCosts(0.0, 0.0, 1.0)) == pytest.approx(free)


def test_a_tail_beside_a_neighbour_always_running_takes_contention_times_as_long():
    costs = SharingCosts(switch_s=0.0, tail_min_share=0.25, tail_contention=2.0)
    a = figures_of(job("a", duty=0.2, tail_s=30.0))
    busy = figures_of(job("b", duty=0.9))
    idle = figures_of(job("c", duty=0.01))
    assert tail_wall_s(a, busy, costs) == pytest.approx(60.0)  # decoding at half speed
    assert 30.0 < tail_wall_s(a, idle, costs) < 31.0
    assert tail_wall_s(a, busy, replace(costs, tail_contention=1.0)) == 30.0
    # The dearer the contention, the longer; never past contention x the tail.
    walls = [
        tail_wall_s(a, figures_of(job("d", duty=0.3)), replace(costs, tail_contention=c))
        for c in (1.25, 1.5, 2.0, 3.0)
    ]
    assert walls == sorted(walls) and walls[-1] <= 90.0


def test_a_wait_runs_past_its_slack_less_the_more_slack_there_is():
    assert two_lanes_s(0.0, 0.0, 10.0, 1.0) == 0.0
    assert two_lanes_s(0.0, 50.0, 0.0, 1.0) == pytest.approx(50.0)
    assert two_lanes_s(0.0, 50.0, 50.0, 1.0) == pytest.approx(50.0 * math.exp(-1.0))
    # Met rarely, a wait of the same mean is longer when met, and runs past more often.
    assert two_lanes_s(0.0, 50.0, 50.0, 0.5) > two_lanes_s(0.0, 50.0, 50.0, 1.0)


def test_a_step_grows_by_the_longer_of_its_lanes() -> None:
    # Rollouts the longer lane by 100 s: their growth is all of the step's, and it
    # shortens the slack the training's wait runs past.
    assert two_lanes_s(30.0, 0.0, 100.0, 1.0) == pytest.approx(30.0)
    assert two_lanes_s(30.0, 40.0, 100.0, 1.0) == pytest.approx(30.0 + 40.0 * math.exp(-130 / 40))
    # Training the longer lane alone (slack -> -100 s, clipped to 0 when fixed): the
    # rollouts' growth hides in it up to 100 s... with a fixed slack, none of it hides.
    assert two_lanes_s(30.0, 0.0, -100.0, 1.0) == pytest.approx(30.0)
    # ...with a moving one, the steps whose training is the longer lane hide it.
    hidden = two_lanes_s(30.0, 0.0, -100.0, 1.0, stalls=300.0, sigma=0.5)
    assert 0.0 < hidden < 30.0
    # There the training's wait is all of the growth.
    assert two_lanes_s(30.0, 40.0, -1000.0, 1.0, stalls=300.0, sigma=0.1) == pytest.approx(40.0)


def test_a_slack_that_moves_with_the_stalls_lets_more_of_a_wait_past() -> None:
    # A slack of 300 s on the mean, 600 s of stalls in it: steps whose stall is short
    # lose more than steps whose stall is long gain (the loss is convex in the slack).
    fixed = two_lanes_s(0.0, 100.0, 300.0, 0.5)
    assert two_lanes_s(0.0, 100.0, 300.0, 0.5, stalls=600.0, sigma=0.0) == pytest.approx(fixed)
    narrow = two_lanes_s(0.0, 100.0, 300.0, 0.5, stalls=600.0, sigma=0.2)
    wide = two_lanes_s(0.0, 100.0, 300.0, 0.5, stalls=600.0, sigma=0.6)
    assert fixed < narrow < wide < 100.0
    # Against the expectation over the stall's lognormal, integrated finely.
    sigma, stalls, rate = 0.6, 600.0, 0.5 / 100.0
    n = 20000
    total = 0.0
    for i in range(n):
        z = NormalDist().inv_cdf((i + 0.5) / n)
        slack = 300.0 + stalls * (math.exp(sigma * z - sigma * sigma / 2) - 1.0)
        total += math.exp(-rate * max(slack, 0.0))
    assert wide == pytest.approx(100.0 * total / n, rel=0.03)
    # A mean slack short of 0 still leaves the long-stalled steps some room: not all of
    # the wait counts, where a fixed slack of 0 counts all of it.
    assert two_lanes_s(0.0, 100.0, -50.0, 0.5, stalls=600.0, sigma=0.6) < 100.0


def test_an_asynchronous_jobs_stall_spread_keeps_its_slack_unclipped() -> None:
    tight = job("a", duty=0.5, staleness=1, tail_s=200.0, stall_s=40.0)
    # Sample 60 + stragglers 200 + scores 40: a 300 s cycle, busy 100 s, 40 s of its
    # own stragglers waited out: 160 s of slack, fixed or moving.
    assert figures_of(tight).slack == pytest.approx(160.0)
    assert figures_of(tight).stall_sigma == 0.0
    spread = figures_of(replace(tight, stall_sigma=0.5))
    assert (spread.slack, spread.stalls, spread.stall_sigma) == pytest.approx((160.0, 40.0, 0.5))
    # Staleness 2 is given one rollout of slack, as staleness 1 (`defer.SLACK_CYCLES`).
    two = figures_of(replace(tight, stall_sigma=0.5, staleness=2))
    assert (two.slack, two.stalls, two.stall_sigma) == pytest.approx((160.0, 40.0, 0.5))
    assert slack_s(replace(tight, staleness=2)) == slack_s(tight) > 0
    # The sum of two stalls varies less than one.
    assert 0.0 < _sum_sigma(0.5, 2) < 0.5
    # Short of slack on the mean (a 130 s cycle, busy 100 s, 40 s of its own stragglers
    # waited out: -10 s), a fixed slack is clipped to 0 and a moving one is not.
    short = replace(tight, tail_s=60.0, stall_s=10.0)
    assert figures_of(short).slack == 0.0
    assert figures_of(replace(short, stall_sigma=0.5)).slack == pytest.approx(-10.0)


def test_an_asynchronous_job_steps_by_its_rollout_cycle_not_its_learned_duty():
    # Sample 60 + stragglers 200 + scores 300: a 560 s cycle; busy 100 s (sample 60,
    # training 40). Its learned duty (0.5, queueing taken out) would make it 200 s.
    a = job("a", duty=0.5, staleness=1, tail_s=200.0, stall_s=300.0)
    fig = figures_of(a)
    assert fig.period == pytest.approx(560.0)
    assert fig.duty == pytest.approx(100 / 560)
    assert fig.critical == (60.0,)
    assert fig.training == (40.0,)
    # Defer's own slack (200 - 100 = 100 s) lets its training wait out 40 s of its own
    # stragglers after its sample; 560 - 100 - 40 s are left for its neighbours.
    assert fig.slack == pytest.approx(420.0)
    # A synchronous job keeps its learned figures.
    s = figures_of(job("s", duty=0.5, tail_s=200.0, stall_s=300.0))
    assert s.period == pytest.approx(200.0) and s.training == () and s.slack == 0.0


def test_an_asynchronous_job_pays_its_trainings_waits_beyond_its_slack():
    calls = (Function.SAMPLE, Function.FORWARD_BACKWARD, Function.OPTIM_STEP, Function.SAVE)
    b = job("b", duty=0.4, step_calls=calls)
    roomy = job("a", duty=0.2, staleness=1, step_calls=calls, stall_s=2000.0)
    tight = job("a", duty=0.2, staleness=1, step_calls=calls, stall_s=45.0)
    # The same sample waits in both; with hardly any slack its training's waits count too.
    assert figures_of(tight).slack < figures_of(roomy).slack
    # Its 40 s training meets b's 60 s sample (40^2 / 2 + 20 x 22.75 of b's call in
    # progress) and b's 40 s training (40^2 / 2) once per b's 250 s step: 8.22 s a step,
    # 10.275 s amplified by b's load (1 / (1 - 0.4 / 2)); b holds the group 40% of the
    # time. With room to spare, the sample's waits are all it pays (c a step); where
    # they lengthen its rollouts, they lengthen its training's slack as well, so
    # 10.275 x exp(-(5 + c) x 0.4 / 10.275) of its training's wait runs past it.
    seconds = {a.stall_s: predicted_slowdown(a, [b]) * figures_of(a).period for a in (tight, roomy)}
    c = seconds[2000.0]
    assert c > 0
    assert seconds[45.0] - c == pytest.approx(10.275 * math.exp(-(5 + c) * 0.4 / 10.275), rel=1e-3)


def test_interference_grows_with_neighbours_and_their_load():
    calls = (Function.SAMPLE, Function.FORWARD_BACKWARD, Function.OPTIM_STEP, Function.SAVE)
    a = job("a", duty=0.25, step_calls=calls)
    one = predicted_slowdown(a, [job("b", duty=0.25, step_calls=calls)])
    two = predicted_slowdown(a, [job(k, duty=0.25, step_calls=calls) for k in "bc"])
    busier = predicted_slowdown(a, [job("b", duty=0.5, step_calls=calls)])
    assert 0 < one < busier and two > 2 * one


def test_placement_prefers_the_fullest_group_within_budget():
    fit = InterferenceFit(budget=0.05)
    s = snap(
        [worker("g0"), worker("g1"), worker("g2")],
        [job("x", "g0", duty=0.1), job("y", "g1", duty=0.2), job("new", duty=0.1)],
        [call("new", 1.0)],
    )
    assert fit(s, s.jobs["new"]) == "g1"
    assert admits(plan(s, CFG)) == {"new": "g1"}


def test_a_group_whose_worker_measured_its_own_costs_is_predicted_with_them():
    # g1 holds the busier job, so the fullest-first rule picks it, until its worker's
    # own costs (a slow engine switch, stragglers that hold half of it) put "new" beside
    # x past the budget there: then g0 takes it, priced with the pool's costs.
    dear = SharingCosts(switch_s=5.0, tail_min_share=0.5, tail_contention=3.0)
    jobs = [
        job("x", "g0", duty=0.1, tail_s=20.0),
        job("y", "g1", duty=0.3, tail_s=20.0),
        job("new", duty=0.1, tail_s=20.0),
    ]
    pooled = snap([worker("g0"), worker("g1")], jobs, [call("new", 1.0)])
    apart = snap([worker("g0"), replace(worker("g1"), sharing=dear)], jobs, [call("new", 1.0)])
    assert InterferenceFit(budget=0.05)(pooled, pooled.jobs["new"]) == "g1"
    assert InterferenceFit(budget=0.05)(apart, apart.jobs["new"]) == "g0"
    per_group = PolicyConfig(name="plexrl", budget_over_cluster=False)
    assert admits(plan(apart, per_group)) == {"new": "g0"}
    # Its group's prediction is the pool's at its costs.
    on_g1 = InterferenceFit(budget=0.05).added_slowdown(apart, "g1", apart.jobs["new"])
    as_pool = InterferenceFit(budget=0.05, costs=dear).added_slowdown(pooled, "g1", jobs[2])
    assert on_g1 == pytest.approx(as_pool)


def test_least_added_placement_takes_the_group_it_slows_least():
    # Within a generous budget either group takes "new": the fullest is x's, but beside
    # the lighter y it adds less to the jobs' summed predicted slowdown.
    s = snap(
        [worker("g0"), worker("g1"), worker("g2")],
        [job("x", "g0", duty=0.3), job("y", "g1", duty=0.1), job("new", duty=0.1)],
        [call("new", 1.0)],
    )
    assert InterferenceFit(budget=0.5)(s, s.jobs["new"]) == "g0"
    assert InterferenceFit(budget=0.5, least_added=True)(s, s.jobs["new"]) == "g1"
    least = PolicyConfig(name="plexrl", slowdown_budget=0.5, least_added=True)
    assert admits(plan(s, least)) == {"new": "g1"}


def test_the_guard_bounds_each_jobs_predicted_slowdown_as_a_multiple_of_the_budget():
    # Two jobs of duty 0.3 side by side each predict 6.4% (the costs of sharing
    # included); over the cluster (four jobs alone elsewhere) their mean is 2.1%, within
    # a 2.5% budget, but each is over twice it: the default guard gives "new" an empty
    # group, a guard of three times the budget shares.
    pair = predicted_slowdown(job("a", duty=0.3), [job("b", duty=0.3)], SharingCosts())
    assert 0.05 < pair < 0.075
    workers = [worker(f"g{i}") for i in range(6)]
    jobs = [job("x", "g0", duty=0.3), job("new", duty=0.3)]
    jobs += [job(f"alone{i}", f"g{i}", duty=0.3) for i in (2, 3, 4, 5)]
    s = snap(workers, jobs, [call("new", 1.0)])
    assert InterferenceFit(budget=0.025, over_cluster=True)(s, s.jobs["new"]) == "g1"
    assert InterferenceFit(budget=0.025, over_cluster=True, guard=3.0)(s, s.jobs["new"]) == "g0"
    looser = PolicyConfig(name="plexrl", slowdown_budget=0.025, slowdown_guard=3.0)
    assert admits(plan(s, looser)) == {"new": "g0"}


def test_placement_falls_back_to_an_empty_group_then_waits():
    s = snap(
        [worker("g0"), worker("g1")],
        [job("x", "g0", duty=0.6), job("new", duty=0.5)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, CFG)) == {"new": "g1"}
    s_full = snap(
        [worker("g0")],
        [
            job("x", "g0", duty=0.6),
            job("new", duty=0.5),
            job("tiny", duty=0.0005, estimates=CallEstimates({Function.SAMPLE: 1.0})),
        ],
        [call("new", 1.0), call("tiny", 2.0)],
    )
    # "new" must wait; admission backfills "tiny": two phases per step (a 1 s sample,
    # 0.15 s of training by the default estimates) every 2300 s, expected to wait about
    # 31 s a step behind x (mostly x's calls in progress): 31 / 2300 / (1 - 0.6 / 2) = 1.9%.
    assert admits(plan(s_full, CFG)) == {"tiny": "g0"}


def test_a_bigger_budget_packs_deeper():
    s = snap(
        [worker("g0"), worker("g1")],
        [job("x", "g0", duty=0.3), job("new", duty=0.3)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, PolicyConfig(name="plexrl", slowdown_budget=0.02))) == {"new": "g1"}
    assert admits(plan(s, PolicyConfig(name="plexrl", slowdown_budget=0.5))) == {"new": "g0"}


FIXED = PolicyConfig(name="plexrl", pack=False)


def test_in_a_fixed_pool_jobs_go_where_they_slow_the_others_least():
    # Packing would put "new" beside x (fullest within a generous budget); in a fixed
    # pool g1 is held anyway, and alone there "new" slows nobody.
    s = snap(
        [worker("g0"), worker("g1")],
        [job("x", "g0", duty=0.3), job("new", duty=0.3)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, PolicyConfig(name="plexrl", slowdown_budget=0.5))) == {"new": "g0"}
    assert admits(plan(s, replace(FIXED, slowdown_budget=0.5))) == {"new": "g1"}


def test_in_a_fixed_pool_four_alike_jobs_split_two_and_two_and_none_waits():
    jobs = [job(f"j{i}", duty=0.5) for i in range(4)]
    s = snap([worker("g0"), worker("g1")], jobs, [call(f"j{i}", float(i)) for i in range(4)])
    placed = admits(plan(s, FIXED))
    assert sorted(placed) == ["j0", "j1", "j2", "j3"]  # nobody waits, though loads reach 1
    assert sorted(placed.values()) == ["g0", "g0", "g1", "g1"]


def test_in_a_fixed_pool_a_stopped_job_weighs_nothing():
    # A job with duty 0 (the live scheduler's view of one that stopped calling) adds no
    # predicted slowdown: the newcomer joins it rather than the busy group.
    s = snap(
        [worker("g0"), worker("g1")],
        [job("busy", "g0", duty=0.4), job("done", "g1", duty=0.0), job("new", duty=0.4)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, FIXED)) == {"new": "g1"}


def test_in_a_fixed_pool_a_job_waits_only_for_memory():
    s = snap(
        [worker("g0", device_gb=10)],
        [job("x", "g0", duty=0.9, state=400 * GB), job("new", duty=0.9, state=20 * GB)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, FIXED)) == {}


def test_dispatch_prefers_the_resident_job_at_equal_wait():
    s = snap(
        [worker("g0", device_gb=20)],
        [job("off", "g0", tier=Tier.HOST), job("on", "g0")],
        [call("off", 50.0, Function.SAMPLE), call("on", 50.0, Function.SAMPLE)],
    )
    runs = [a for a in plan(s, CFG) if isinstance(a, Run)]
    assert [r.job_id for r in runs] == ["on"]


def test_dispatch_runs_the_least_remaining_work_first():
    s = snap(
        [worker("g0")],
        [job("a", "g0"), job("b", "g0")],
        [call("a", 90.0, Function.SAMPLE), call("b", 95.0, Function.OPTIM_STEP)],
    )
    # a: 60 s of work, waiting longer; b: 5 s -> the short one goes first.
    (run,) = [a for a in plan(s, CFG) if isinstance(a, Run)]
    assert run.job_id == "b"
    training = [PendingCall(f"a/fb{i}", "a", Function.FORWARD_BACKWARD, 50.0) for i in range(3)]
    cut_in = snap(
        [worker("g0")],
        [job("a", "g0"), job("b", "g0")],
        [*training, call("b", 99.0, Function.SAMPLE)],
    )
    # a still has 90 s of training queued; b's 60 s sample cuts in at the call boundary.
    (run,) = [a for a in plan(cut_in, CFG) if isinstance(a, Run)]
    assert run.job_id == "b"


def test_tenants_take_turns_and_least_work_orders_each_tenants_own_jobs():
    # Tenant x has two jobs with short calls and was served last; tenant y's long call
    # goes first, then x's shortest.
    jobs = [
        job("x1", "g0", tenant="x", last_active=90.0),
        job("x2", "g0", tenant="x", last_active=80.0),
        job("y", "g0", tenant="y", last_active=10.0),
    ]
    calls = [
        call("x1", 50.0, Function.OPTIM_STEP),
        call("x2", 51.0, Function.SAVE),
        call("y", 60.0, Function.SAMPLE),
    ]
    (run,) = [a for a in plan(snap([worker("g0")], jobs, calls), CFG) if isinstance(a, Run)]
    assert run.job_id == "y"
    served = [replace(j, last_active=99.0) if j.job_id == "y" else j for j in jobs]
    (run,) = [a for a in plan(snap([worker("g0")], served, calls), CFG) if isinstance(a, Run)]
    assert run.job_id == "x1"  # both x's calls are 5 s; the older one first


def test_switch_cost_counts_as_remaining_work():
    here_est = CallEstimates({Function.SAVE: 7.0})
    slow_disk = snap(
        [worker("g0", device_gb=30)],
        [
            job("away", "g0", tier=Tier.DISK, state=20 * GB),
            job("here", "g0", state=20 * GB, estimates=here_est),
        ],
        [call("away", 0.0, Function.OPTIM_STEP), call("here", 30.0, Function.SAVE)],
    )
    # away: 5 s + 4.4 s from disk = 9.4 s; here: 7 s.
    (run,) = [a for a in plan(slow_disk, CFG) if isinstance(a, Run)]
    assert run.job_id == "here"
    (run,) = [
        a
        for a in plan(slow_disk, PolicyConfig(name="plexrl", switch_weight=0.0))
        if isinstance(a, Run)
    ]
    assert run.job_id == "away"


def test_eviction_takes_the_job_with_the_longest_idle_hint_and_never_a_pinned_one():
    s = snap(
        [worker("g0", device_gb=25)],
        [
            job("new", "g0", tier=Tier.HOST),
            job("stalled", "g0", idle_until=400.0, last_active=90.0),
            job("recent", "g0", idle_until=0.0, last_active=10.0),
        ],
        [call("new", 1.0, Function.SAMPLE)],
    )
    (run,) = [a for a in plan(s, CFG) if isinstance(a, Run)]
    assert run.evict == (Move("stalled", Tier.HOST),)
    pinned = snap(
        [worker("g0", device_gb=15)],
        [job("new", "g0", tier=Tier.HOST), job("tail", "g0", pinned=True)],
        [call("new", 1.0, Function.SAMPLE)],
    )
    assert not [a for a in plan(pinned, CFG) if isinstance(a, Run)]


def test_prefetch_brings_up_the_next_job_while_the_group_computes():
    s = snap(
        [worker("g0", running="busy", busy_until=200.0)],
        [job("busy", "g0"), job("next", "g0", tier=Tier.HOST)],
        [call("next", 99.0, Function.SAMPLE)],
    )
    (prefetch,) = plan(s, CFG)
    assert prefetch == Prefetch("g0", "next", ())
    hinted = snap(
        [worker("g0", running="busy", busy_until=200.0)],
        [
            job("busy", "g0"),
            job("soon", "g0", tier=Tier.HOST, idle_until=150.0),
            job("late", "g0", tier=Tier.HOST, idle_until=900.0),
        ],
        [],
    )
    (prefetch,) = plan(hinted, CFG)
    assert prefetch.job_id == "soon"
    assert plan(hinted, PolicyConfig(name="plexrl", prefetch=False)) == ()


def test_the_scheduler_setting_turns_prefetch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    hinted = snap(
        [worker("g0", running="busy", busy_until=200.0)],
        [job("busy", "g0"), job("soon", "g0", tier=Tier.HOST, idle_until=150.0)],
        [],
    )
    for value, prefetched in (("true", 1), ("false", 0)):
        monkeypatch.setenv("PLEXRL_PREFETCH", value)
        monkeypatch.setenv("PLEXRL_POLICY", "plexrl")
        config = policy_config(SchedulerSettings())
        assert len(plan(hinted, config)) == prefetched


def admits(actions) -> dict[str, str]:
    return {a.job_id: a.worker_id for a in actions if isinstance(a, Admit)}


def test_runs_on_a_shared_group_stop_at_the_quantum():
    train = [PendingCall(f"a/fb{i}", "a", Function.FORWARD_BACKWARD, 90.0) for i in range(4)] + [
        call("a", 90.0, Function.OPTIM_STEP),
        call("a", 90.0, Function.SAVE),
    ]
    shared = snap([worker("g0")], [job("a", "g0"), job("b", "g0")], train)
    (run,) = [a for a in plan(shared, CFG) if isinstance(a, Run)]
    assert run.request_ids == ("a/fb0",)  # 30 s is past the 10 s quantum: one call
    wide = PolicyConfig(name="plexrl", quantum_s=60.0)
    (run,) = [a for a in plan(shared, wide) if isinstance(a, Run)]
    assert run.request_ids == ("a/fb0", "a/fb1")  # a third would pass 60 s
    alone = snap([worker("g0")], [job("a", "g0")], train)
    (run,) = [a for a in plan(alone, CFG) if isinstance(a, Run)]
    assert len(run.request_ids) == 6


def test_step_calls_shape_the_phases():
    calls = (Function.SAMPLE, *[Function.FORWARD_BACKWARD] * 4, Function.OPTIM_STEP, Function.SAVE)
    a = job("a", duty=0.3, step_calls=calls)
    # sample 60, then fb 30 x 4, optim 5 and save 5 together: one 130 s phase.
    assert step_phases(a) == (60.0, 130.0)
    # Calls in progress: (60^2 + 4 x 30^2 + 2 x 5^2) / (2 x 190).
    assert call_residual_s(a) == pytest.approx((3600 + 3600 + 50) / 380)
    assert call_residual_s(a) < call_residual_s(job("b", duty=0.3))


def test_a_run_goes_on_while_every_neighbour_said_it_stays_idle():
    train = [PendingCall(f"a/fb{i}", "a", Function.FORWARD_BACKWARD, 90.0) for i in range(4)]
    stalled = snap([worker("g0")], [job("a", "g0"), job("b", "g0", idle_until=175.0)], train)
    # b stays idle for 75 s more: two 30 s calls fit before it may call, the third passes.
    (run,) = [a for a in plan(stalled, CFG) if isinstance(a, Run)]
    assert run.request_ids == ("a/fb0", "a/fb1")
    awake = snap([worker("g0")], [job("a", "g0"), job("b", "g0", idle_until=50.0)], train)
    (run,) = [a for a in plan(awake, CFG) if isinstance(a, Run)]
    assert run.request_ids == ("a/fb0",)


class _Unremembered(InterferenceFit):
    """The placement without its memory of refused jobs: every job tried afresh."""

    def __call__(self, snapshot: ClusterSnapshot, job: JobView) -> str | None:
        self._refused.clear()
        return super().__call__(snapshot, job)


def test_a_refused_job_is_remembered_until_a_group_changes():
    # Neither group has room for the alike jobs w0..w6 (60 + 75 GB against 80 + 50 GB);
    # both have room for "small", and it fits their budget. The answers must be those of
    # trying every job afresh, while the alike jobs cost one try before "small" is placed
    # and one after.
    groups = [WorkerView(g, device_bytes=80 * GB, host_bytes=50 * GB) for g in ("g0", "g1")]
    jobs = [job("x", "g0", duty=0.01, state=60 * GB), job("y", "g1", duty=0.01, state=60 * GB)]
    jobs += [job(f"w{i}", duty=0.01, state=75 * GB) for i in range(6)]
    jobs += [job("small", duty=0.01), job("w6", duty=0.01, state=75 * GB)]
    s = snap(groups, jobs, [])
    tried: list[str] = []

    class Counting(InterferenceFit):
        def _fullest_within(self, snapshot, job, fig, empty_ok=True, most=0):
            tried.append(job.job_id)
            return super()._fullest_within(snapshot, job, fig, empty_ok, most)

    fit = Counting(CFG.slowdown_budget)
    answers = {j.job_id: fit(s, j) for j in jobs if j.home is None}
    fresh = _Unremembered(CFG.slowdown_budget)
    assert answers == {j.job_id: fresh(s, j) for j in jobs if j.home is None}
    assert answers["small"] is not None and answers["w0"] is None
    assert tried == ["w0", "small", "w6"]


def test_admission_takes_the_most_declared_work_first_then_arrival_order():
    from plexrl.policy.plexrl_policy import declared_run_s, longest_declared_first

    busy = job("busy", "g0", duty=0.9)
    waiting = [
        job("unsaid", duty=0.9),
        job("short", duty=0.9, declared_steps=100),
        job("long", duty=0.9, declared_steps=1000),
    ]
    s = snap(
        [worker("g0"), worker("g1")],
        [busy, *waiting],
        [call("unsaid", 1.0), call("short", 2.0), call("long", 3.0)],
    )
    # One empty group; none of them fits beside `busy`: the longest declared run goes.
    assert admits(plan(s, CFG)) == {"long": "g1"}
    assert admits(plan(s, PolicyConfig(name="plexrl", longest_first=False))) == {"unsaid": "g1"}
    # Declared work is steps times the step's expected seconds (its figures); jobs that
    # declared nothing keep their arrival order, after the declared ones.
    slow_steps = job("slow", duty=0.5, declared_steps=600)  # 100 s busy a step: 200 s each
    assert declared_run_s(slow_steps) == pytest.approx(600 * 100.0 / 0.5)
    assert declared_run_s(waiting[2]) == pytest.approx(1000 * 100.0 / 0.9)
    assert declared_run_s(waiting[0]) == 0.0
    later = job("unsaid-later", duty=0.9)
    ordered = longest_declared_first([waiting[0], waiting[1], later, slow_steps, waiting[2]])
    assert [j.job_id for j in ordered] == ["slow", "long", "short", "unsaid", "unsaid-later"]


def test_a_newcomer_must_fit_as_busy_as_its_kinds_busiest_tenth():
    # Described by its kind's mean (duty 0.1) it fits beside x (about 2% each); were it
    # as busy as its kind's busiest tenth (0.7), x would wait about 18% of its step, past
    # the guard (10%): it takes the empty group, or waits where there is none.
    s = snap(
        [worker("g0"), worker("g1")],
        [job("x", "g0", duty=0.3), job("new", duty=0.1, duty_bound=0.7)],
        [call("new", 1.0)],
    )
    assert admits(plan(s, CFG)) == {"new": "g1"}
    assert admits(plan(s, replace(CFG, bound_newcomers=False))) == {"new": "g0"}
    alone = snap(
        [worker("g0")],
        [job("x", "g0", duty=0.3), job("new", duty=0.1, duty_bound=0.7)],
        [call("new", 1.0)],
    )
    assert admits(plan(alone, CFG)) == {}
    # A bound no busier than its mean changes nothing.
    same = snap(
        [worker("g0"), worker("g1")],
        [job("x", "g0", duty=0.3), job("new", duty=0.1, duty_bound=0.1)],
        [call("new", 1.0)],
    )
    assert admits(plan(same, CFG)) == {"new": "g0"}


def test_a_refusal_is_not_lent_to_a_job_with_a_smaller_bound():
    # Two waiting jobs described alike but for their bound: the busier bound is refused
    # beside x, the other still fits there.
    s = snap(
        [worker("g0")],
        [
            job("x", "g0", duty=0.3),
            job("wide", duty=0.1, duty_bound=0.7),
            job("narrow", duty=0.1, duty_bound=0.1),
        ],
        [call("wide", 1.0), call("narrow", 2.0)],
    )
    assert admits(plan(s, CFG)) == {"narrow": "g0"}
