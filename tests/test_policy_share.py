"""Tenants' share of a group (`plexrl.policy.share`) under the plexrl policy, on
hand-built snapshots and on a small event loop that runs the policy call by call."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest

from plexrl.messages import Function, Tier
from plexrl.policy import (
    Admit,
    CallEstimates,
    ClusterSnapshot,
    JobView,
    PendingCall,
    PolicyConfig,
    Run,
    WorkerView,
    decide,
    plan,
)
from plexrl.policy.costs import SharingCosts
from plexrl.policy.history import RecentUse
from plexrl.policy.share import tenant_order

GB = 10**9
FB = Function.FORWARD_BACKWARD
CFG = PolicyConfig(name="plexrl")
BLIND = PolicyConfig(name="plexrl", fair_share=False)
LIGHT = CallEstimates({FB: 0.05, Function.OPTIM_STEP: 0.01})
HEAVY = CallEstimates({FB: 3.0, Function.OPTIM_STEP: 0.01})


def job(jid: str, tenant: str, home: str | None = "g0", **kw: object) -> JobView:
    kw.setdefault("tier", Tier.DEVICE if home else None)
    kw.setdefault("duty_cycle", 0.2)
    return JobView(jid, state_bytes=GB, home=home, tenant=tenant, **kw)  # type: ignore[arg-type]


def snap(jobs: list[JobView], calls: list[PendingCall], now: float = 100.0, groups: int = 1):
    return ClusterSnapshot(
        now=now,
        workers={f"g{i}": WorkerView(f"g{i}", 10 * GB, 10 * GB) for i in range(groups)},
        jobs={j.job_id: j for j in jobs},
        pending=tuple(sorted(calls, key=lambda c: c.arrival_time)),
    )


def call(jid: str, at: float, n: int = 0, fn: Function = FB) -> PendingCall:
    return PendingCall(f"{jid}/{n}", jid, fn, at)


def runs(actions: tuple[object, ...]) -> list[Run]:
    return [a for a in actions if isinstance(a, Run)]


# Order ------------------------------------------------------------------------------------


def test_the_tenant_that_used_the_group_less_goes_first_whoever_was_served_last() -> None:
    # Both are owed a turn (neither started since the other began waiting). Tenant a was
    # served last but used 1 s lately; b 30 s: a goes first. Tenant-blind, b goes first
    # (served longest ago).
    jobs = [
        job("a", "ta", used_s=1.0, last_active=99.0, last_started=98.9),
        job("b", "tb", used_s=30.0, last_active=98.0, last_started=95.0),
    ]
    s = snap(jobs, [call("a", 99.5), call("b", 99.2)])
    assert tenant_order(s, "g0", list(s.jobs.values())) == ["ta", "tb"]
    assert [r.job_id for r in runs(plan(s, CFG))] == ["a"]
    assert [r.job_id for r in runs(plan(s, BLIND))] == ["b"]


def test_a_lighter_tenant_gets_one_turn_while_another_waits_never_two() -> None:
    # b's call has waited since 90. a started a Run at 95, since then: however much less
    # a used, b goes next (so b waits at most one dispatch of a per turn).
    jobs = [
        job("a", "ta", used_s=0.1, last_active=95.1, last_started=95.0),
        job("b", "tb", used_s=50.0, last_active=80.0, last_started=77.0),
    ]
    s = snap(jobs, [call("b", 90.0), call("a", 99.0)])
    assert [r.job_id for r in runs(plan(s, CFG))] == ["b"]


def test_use_is_summed_over_a_tenants_jobs_on_the_group() -> None:
    # Tenant a has two jobs of 6 s each lately, tenant b one of 10 s: b first.
    jobs = [
        job("a1", "ta", used_s=6.0),
        job("a2", "ta", used_s=6.0),
        job("b", "tb", used_s=10.0),
    ]
    s = snap(jobs, [call("a1", 99.0), call("b", 99.1)])
    assert [r.job_id for r in runs(plan(s, CFG))] == ["b"]


def test_one_tenant_is_scheduled_as_without_the_share() -> None:
    jobs = [
        job("a", "t", used_s=50.0, estimates=LIGHT, last_active=99.0),
        job("b", "t", used_s=0.0, estimates=HEAVY, last_active=10.0),
    ]
    s = snap(jobs, [call("a", 99.5), *(call("b", 90.0 + i, i) for i in range(4))])
    assert plan(s, CFG) == plan(s, BLIND)
    (run,) = runs(plan(s, CFG))
    assert run.job_id == "a"  # least remaining work, the tenant's use aside


def test_the_share_never_reorders_one_jobs_calls() -> None:
    jobs = [job("a", "ta", estimates=LIGHT), job("b", "tb", used_s=9.0, estimates=HEAVY)]
    calls = [call("a", 99.0, 0), call("a", 99.1, 1, Function.OPTIM_STEP), call("b", 98.0)]
    (run,) = runs(plan(snap(jobs, calls), CFG))
    assert run.request_ids == ("a/0", "a/1")


# Run length -------------------------------------------------------------------------------


def test_beside_another_tenant_a_run_holds_about_one_long_call() -> None:
    heavy = job("b", "tb", estimates=HEAVY)
    calls = [call("b", 90.0 + i, i) for i in range(3)]
    beside = snap([heavy, job("a", "ta", estimates=LIGHT)], calls)
    assert [len(r.request_ids) for r in runs(plan(beside, CFG))] == [1]
    assert [len(r.request_ids) for r in runs(plan(beside, BLIND))] == [3]  # 9 s < 10 s
    # Beside its own tenant's job, or another tenant's dormant one (duty 0), the
    # policy's quantum as before.
    own = snap([heavy, job("b2", "tb", estimates=LIGHT)], calls)
    assert [len(r.request_ids) for r in runs(plan(own, CFG))] == [3]
    dormant = snap([heavy, job("a", "ta", estimates=LIGHT, duty_cycle=0.0)], calls)
    assert [len(r.request_ids) for r in runs(plan(dormant, CFG))] == [3]


def test_short_calls_beside_another_tenant_still_go_several_to_a_run() -> None:
    jobs = [job("b", "tb", estimates=LIGHT), job("a", "ta", estimates=HEAVY)]
    calls = [call("b", 90.0 + i, i) for i in range(8)]
    (run,) = runs(plan(snap(jobs, calls), CFG))
    assert len(run.request_ids) == 5  # 5 x 0.05 s = the 0.25 s tenant quantum


# The bound, call by call -------------------------------------------------------------------


@dataclass
class _Job:
    view: JobView
    used: RecentUse = field(default_factory=RecentUse)
    queue: list[PendingCall] = field(default_factory=list)


def _serve(
    config: PolicyConfig, light_jobs: int, until: float, think_s: float = 0.5
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """One group; tenant tb's two trainers keep two 3 s forward_backward calls queued
    each; tenant ta's `light_jobs` jobs send a 50 ms call `think_s` after their last one
    ended. Returns each tenant's waits (a call's arrival, or for tb the end of its
    previous Run, to its start) and engine seconds."""
    jobs = {
        **{f"b{i}": _Job(job(f"b{i}", "tb", estimates=HEAVY, duty_cycle=1.0)) for i in (1, 2)},
        **{
            f"a{i}": _Job(job(f"a{i}", "ta", estimates=LIGHT, duty_cycle=0.1))
            for i in range(light_jobs)
        },
    }
    seconds = {"ta": 0.05, "tb": 3.0}
    now, n = 0.0, 0
    next_light = {jid: 0.0 for jid in jobs if jid.startswith("a")}
    waits: dict[str, list[float]] = {"ta": [], "tb": []}
    engine = {"ta": 0.0, "tb": 0.0}
    tb_free = 0.0
    """When tb's last Run ended: its trainers always have calls queued."""
    while now < until:
        for jid, j in jobs.items():
            if jid.startswith("b"):
                while len(j.queue) < 2:
                    n += 1
                    j.queue.append(call(jid, now, n))
            elif not j.queue and next_light[jid] <= now:
                n += 1
                j.queue.append(call(jid, next_light[jid], n))
        views = [replace(j.view, used_s=j.used.as_of(now)) for j in jobs.values()]
        pending = [c for j in jobs.values() for c in j.queue]
        (run,) = runs(plan(snap(views, pending, now), config))
        j = jobs[run.job_id]
        tenant = j.view.tenant
        j.view = replace(j.view, last_started=now)
        if tenant == "tb":
            waits["tb"].append(now - tb_free)
        for rid in run.request_ids:
            started = j.queue.pop(0)
            assert started.request_id == rid  # in the job's own order
            if tenant == "ta":
                waits["ta"].append(now - started.arrival_time)
            now += seconds[tenant]
            engine[tenant] += seconds[tenant]
            j.used.add(seconds[tenant], now)
        j.view = replace(j.view, last_active=now)
        if tenant == "ta":
            next_light[run.job_id] = now + think_s
        else:
            tb_free = now
    return waits, engine


def test_a_light_tenants_call_waits_behind_at_most_one_heavy_call() -> None:
    waits, engine = _serve(CFG, light_jobs=1, until=300.0)
    assert max(waits["ta"]) <= 3.0 + 1e-9
    assert engine["tb"] / (engine["ta"] + engine["tb"]) > 0.95  # the heavy tenant still runs
    # Tenant-blind, a trainer's Run holds its two queued calls: up to 6 s of waiting.
    blind, _ = _serve(BLIND, light_jobs=1, until=300.0)
    assert max(blind["ta"]) > 5.0


def test_a_heavy_tenant_is_never_starved_by_a_lighter_one() -> None:
    # Four light jobs that call back at once keep tenant ta always waiting, and ta used
    # far less than tb; still tb waits at most one Run of ta (0.25 s) between its own,
    # and each of ta's calls at most one of tb's.
    waits, engine = _serve(CFG, light_jobs=4, until=300.0, think_s=0.0)
    assert max(waits["tb"]) <= 0.25 + 1e-9
    assert max(waits["ta"]) <= 4 * 3.0 + 3 * 0.05 + 1e-9  # its own other jobs go too
    assert engine["tb"] > 280.0 and len(waits["ta"]) > 90


# Placement --------------------------------------------------------------------------------


def _admitted(s: ClusterSnapshot, config: PolicyConfig) -> dict[str, str]:
    return {a.job_id: a.worker_id for a in plan(s, config) if isinstance(a, Admit)}


def test_a_tenants_new_jobs_go_where_no_other_tenants_load_is() -> None:
    # Tenant ta's light job is on g0, g1 is empty; tenant tb's two new trainers arrive
    # together with no figures yet (the defaults: 50 ms calls, half busy).
    light = job("a", "ta", estimates=LIGHT, duty_cycle=0.1)
    new = [job(f"b{i}", "tb", home=None, duty_cycle=0.5) for i in (1, 2)]
    s = snap([light, *new], [call("b1", 99.0), call("b2", 99.1)], groups=2)
    assert _admitted(s, PolicyConfig(name="plexrl", pack=False)) == {"b1": "g1", "b2": "g1"}
    # Tenant-blind, the second goes where the predicted slowdown is least: beside ta.
    blind = PolicyConfig(name="plexrl", pack=False, fair_share=False)
    assert _admitted(s, blind) == {"b1": "g1", "b2": "g0"}


def test_a_tenant_overflows_onto_another_tenants_group_only_past_max_load() -> None:
    light = job("a", "ta", estimates=LIGHT, duty_cycle=0.1)
    busy = [job(f"b{i}", "tb", home="g1", duty_cycle=0.45) for i in (1, 2)]
    new = job("b3", "tb", home=None, duty_cycle=0.45)
    s = snap([light, *busy, new], [call("b3", 99.0)], groups=2)
    assert _admitted(s, PolicyConfig(name="plexrl", pack=False)) == {"b3": "g0"}  # 1.35 > 1
    roomy = replace(new, duty_cycle=0.05)
    s = snap([light, *busy, roomy], [call("b3", 99.0)], groups=2)
    assert _admitted(s, PolicyConfig(name="plexrl", pack=False)) == {"b3": "g1"}


def test_one_tenants_placement_is_unchanged() -> None:
    light = job("a", "t", estimates=LIGHT, duty_cycle=0.1)
    new = [job(f"b{i}", "t", home=None, duty_cycle=0.5) for i in (1, 2)]
    s = snap([light, *new], [call("b1", 99.0), call("b2", 99.1)], groups=2)
    for pack in (True, False):
        on, off = PolicyConfig(name="plexrl", pack=pack), replace(BLIND, pack=pack)
        assert _admitted(s, on) == _admitted(s, off)


def test_packing_prefers_a_group_of_the_jobs_own_tenant() -> None:
    # g0 holds tenant ta's job, g1 tenant tb's, both light enough to share within budget
    # (on engines that switch jobs for free); g0 is the fuller. A new tb job packs beside
    # tb; tenant-blind, onto the fuller g0.
    quiet = CallEstimates({FB: 0.05, Function.SAMPLE: 0.05})
    jobs = [
        job("a", "ta", estimates=quiet, duty_cycle=0.03),
        job("b", "tb", home="g1", estimates=quiet, duty_cycle=0.02),
        job("new", "tb", home=None, estimates=quiet, duty_cycle=0.02),
    ]
    s = snap(jobs, [call("new", 99.0)], groups=2)
    free = SharingCosts(switch_s=0.0)
    assert _admitted(s, PolicyConfig(name="plexrl", pack=True, sharing=free)) == {"new": "g1"}
    assert _admitted(s, replace(BLIND, pack=True, sharing=free)) == {"new": "g0"}


def turn_order(jobs: list[JobView], calls: list[PendingCall], ready: list[JobView]) -> list[str]:
    """The turn rule as written: a tenant had its turn if its last Run started after some
    other waiting tenant began waiting (its oldest call, or when it was last served if
    later); those owed a turn go first by least use (then served longest ago), then the
    others by when their turns began."""
    tenant_of = {j.job_id: j.tenant for j in jobs}
    tenants = set(tenant_of.values())
    used = {t: sum(j.used_s for j in jobs if j.tenant == t) for t in tenants}
    started = {t: max(j.last_started for j in jobs if j.tenant == t) for t in tenants}
    served = {t: max(j.last_active for j in jobs if j.tenant == t) for t in tenants}
    oldest = {
        t: min((c.arrival_time for c in calls if tenant_of[c.job_id] == t), default=1e9)
        for t in tenants
    }
    waiting = {j.tenant for j in ready}

    def key(t: str) -> tuple[int, float, float, str]:
        had = any(started[t] > max(oldest[o], served[o]) for o in waiting if o != t)
        return (1, started[t], used[t], t) if had else (0, used[t], served[t], t)

    return sorted(waiting, key=key)


def test_the_order_is_the_turn_rule_as_written_for_any_tenants() -> None:
    draw = random.Random(11)
    for _ in range(400):
        tenants = [f"t{i}" for i in range(draw.randint(1, 6))]
        jobs = [
            job(
                f"j{i}",
                draw.choice(tenants),
                used_s=float(draw.randint(0, 3)),
                last_active=float(draw.randint(90, 99)),
                last_started=float(draw.randint(88, 99)),
            )
            for i in range(draw.randint(1, 8))
        ]
        calls = [call(j.job_id, float(draw.randint(85, 99))) for j in jobs if draw.random() < 0.7]
        s = snap(jobs, calls)
        ready = [j for j in jobs if s.calls_view(j.job_id)]
        if ready:
            assert tenant_order(s, "g0", ready) == turn_order(jobs, calls, ready)


# Anticipation -----------------------------------------------------------------------------


def test_no_hold_for_a_tenant_that_had_its_turn_while_another_waits() -> None:
    held = PolicyConfig(name="plexrl", hold_s=0.1)
    # b (tenant tb) is in a burst; a's call (tenant ta) waits since before b's last Run.
    b = job("b", "tb", last_active=100.0, last_started=99.0, last_gap_s=0.02, estimates=LIGHT)
    a = job("a", "ta", last_active=50.0, estimates=LIGHT)
    s = snap([a, b], [call("a", 98.0)], now=100.01)
    assert [r.job_id for r in runs(decide(s, held).plan)] == ["a"]
    assert runs(decide(s, replace(held, fair_share=False)).plan) == []  # held for b
    # The same tenant's waiting call: b's burst is held for as before.
    mine = replace(a, tenant="tb")
    assert runs(decide(snap([mine, b], [call("a", 98.0)], now=100.01), held).plan) == []


def test_recent_use_halves_every_half_life() -> None:
    use = RecentUse(half_life_s=10.0)
    use.add(4.0, now=100.0)
    assert use.as_of(100.0) == 4.0
    assert use.as_of(110.0) == pytest.approx(2.0)
    use.add(1.0, now=120.0)
    assert use.as_of(120.0) == pytest.approx(2.0)


def test_tenant_quantum_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tenant_quantum_s"):
        PolicyConfig(tenant_quantum_s=0)
