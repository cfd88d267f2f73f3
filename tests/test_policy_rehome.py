"""Re-homing: a newcomer's home reviewed once its own figures are known."""

from __future__ import annotations

from dataclasses import replace

from plexrl.messages import Function, Tier
from plexrl.policy import JobView, PolicyConfig, Rehome, Run, decide, lone_pairs, plan
from tests.test_policy_plexrl import call, job, snap, worker

CFG = PolicyConfig(name="plexrl")
STEPS = (Function.SAMPLE, Function.FORWARD_BACKWARD, Function.OPTIM_STEP)


def reviewed(jid: str, home: str, duty: float) -> JobView:
    return job(jid, home, duty=duty, review=True, step_calls=STEPS)


def rehomes(actions) -> list[Rehome]:
    return [a for a in actions if isinstance(a, Rehome)]


def test_a_newcomer_its_own_figures_put_over_budget_moves_to_an_empty_group():
    s = snap(
        [worker("g0"), worker("g1")],
        [job("a", "g0", duty=0.6, step_calls=STEPS), reviewed("new", "g0", 0.35)],
        [],
    )
    assert rehomes(plan(s, CFG)) == [Rehome("new", "g0", "g1")]


def test_over_budget_with_no_group_to_take_it_it_stays_under_review():
    busy = [job("a", "g0", duty=0.6, step_calls=STEPS), reviewed("new", "g0", 0.35)]
    full = [job("b", "g1", duty=0.6, step_calls=STEPS)]
    (answer,) = rehomes(plan(snap([worker("g0"), worker("g1")], busy + full, []), CFG))
    assert answer == Rehome("new", "g0", "g0", waits=True) and not answer.moves
    # Once a group frees, the next review moves it there.
    s = snap([worker("g0"), worker("g1")], busy, [])
    assert rehomes(plan(s, CFG)) == [Rehome("new", "g0", "g1")]
    # Once its neighbour is gone, it stays, its review done.
    s = snap([worker("g0"), worker("g1")], [busy[1], *full], [])
    assert rehomes(plan(s, CFG)) == [Rehome("new", "g0", "g0")]


def test_a_newcomer_within_budget_stays_and_its_review_is_answered():
    s = snap(
        [worker("g0"), worker("g1")],
        [job("a", "g0", duty=0.02, step_calls=STEPS), reviewed("new", "g0", 0.02)],
        [],
    )
    (answer,) = rehomes(plan(s, CFG))
    assert answer == Rehome("new", "g0", "g0") and not answer.moves


def test_a_newcomer_alone_on_a_group_joins_a_shared_one_within_budget():
    # The guard kept it off g0 as a newcomer; its own figures fit there: g1 is freed.
    s = snap(
        [worker("g0"), worker("g1"), worker("g2")],
        [job("a", "g0", duty=0.02, step_calls=STEPS), reviewed("new", "g1", 0.02)],
        [],
    )
    assert rehomes(plan(s, CFG)) == [Rehome("new", "g1", "g0")]


def test_alone_it_joins_a_job_alone_not_a_pair():
    # A pair's prediction is checked against forced pairs; a third job's is optimistic
    # (its neighbours meet each other): a job alone joins a job alone, freeing a group.
    pair = [job("a", "g0", duty=0.02, step_calls=STEPS), job("b", "g0", duty=0.02)]
    lone = [job("c", "g2", duty=0.02, step_calls=STEPS), reviewed("new", "g1", 0.02)]
    workers = [worker("g0"), worker("g1"), worker("g2")]
    assert rehomes(plan(snap(workers, pair + lone, []), CFG)) == [Rehome("new", "g1", "g2")]
    assert rehomes(plan(snap(workers, [*pair, lone[1]], []), CFG)) == [Rehome("new", "g1", "g1")]


def test_alone_and_nowhere_within_budget_it_stays():
    s = snap(
        [worker("g0"), worker("g1"), worker("g2")],
        [job("a", "g0", duty=0.6, step_calls=STEPS), reviewed("new", "g1", 0.5)],
        [],
    )
    assert rehomes(plan(s, CFG)) == [Rehome("new", "g1", "g1")]


def test_not_reviewed_while_its_calls_hold_the_group():
    jobs = [job("a", "g0", duty=0.6, step_calls=STEPS), reviewed("new", "g0", 0.35)]
    running = snap([worker("g0", running="new"), worker("g1")], jobs, [])
    assert rehomes(plan(running, CFG)) == []
    jobs[1] = replace(jobs[1], pinned=True)  # its stragglers decode there
    assert rehomes(plan(snap([worker("g0"), worker("g1")], jobs, []), CFG)) == []


def test_off_it_keeps_its_home():
    s = snap(
        [worker("g0"), worker("g1")],
        [job("a", "g0", duty=0.6, step_calls=STEPS), reviewed("new", "g0", 0.35)],
        [],
    )
    assert rehomes(plan(s, replace(CFG, rehome=False))) == []


def test_its_calls_run_at_the_new_home_from_the_disk_tier():
    s = snap(
        [worker("g0", running="a"), worker("g1")],
        [job("a", "g0", duty=0.6, step_calls=STEPS), reviewed("new", "g0", 0.35)],
        [call("new", 99.0, Function.SAMPLE)],
    )
    actions = decide(s, CFG).plan
    assert actions[0] == Rehome("new", "g0", "g1")
    (run,) = [a for a in actions if isinstance(a, Run)]
    assert (run.worker_id, run.job_id) == ("g1", "new")
    # The state comes from the disk tier: the plan expects its seconds.
    assert run.expected_swap_s == s.swap.move_s(10 * 10**9, Tier.DISK, Tier.DEVICE)


def test_a_fixed_pool_moves_only_for_a_gain_above_the_threshold():
    fixed = replace(CFG, pack=False)
    crowded = [job("a", "g0", duty=0.6, step_calls=STEPS), reviewed("new", "g0", 0.35)]
    quiet = [job("b", "g1", duty=0.02, step_calls=STEPS)]
    s = snap([worker("g0"), worker("g1")], crowded + quiet, [])
    assert rehomes(plan(s, fixed)) == [Rehome("new", "g0", "g1")]
    # Two quiet groups alike: nothing to gain by moving.
    even = [job("a", "g0", duty=0.02, step_calls=STEPS), reviewed("new", "g0", 0.02)]
    s = snap([worker("g0"), worker("g1")], even + quiet, [])
    assert rehomes(plan(s, fixed)) == [Rehome("new", "g0", "g0")]


def test_of_the_jobs_alone_one_of_each_pair_within_budget_is_named_for_review():
    # Four groups each holding one job: a and b could share within budget, so could c
    # and d; each pair is named once (its first job by id), the busy e with nobody.
    quiet = [job(j, f"g{i}", duty=0.02, step_calls=STEPS) for i, j in enumerate("abcd")]
    busy = job("e", "g4", duty=0.6, step_calls=STEPS)
    workers = [worker(f"g{i}") for i in range(6)]
    assert lone_pairs(snap(workers, [*quiet, busy], []), CFG) == ["a", "c"]
    # Two busy ones alone: none.
    other = job("f", "g5", duty=0.5, step_calls=STEPS)
    assert lone_pairs(snap(workers, [other, busy], []), CFG) == []
    # A job sharing its group is not alone; one not created yet (no tier) is not homed.
    shared = [*quiet[:2], job("x", "g0", duty=0.02, step_calls=STEPS)]
    assert lone_pairs(snap(workers, shared, []), CFG) == []
    fresh = [quiet[0], replace(quiet[1], tier=None)]
    assert lone_pairs(snap(workers, fresh, []), CFG) == []


def test_jobs_alone_are_named_only_where_a_job_left_alone_would_be_reviewed():
    quiet = [job(j, f"g{i}", duty=0.02, step_calls=STEPS) for i, j in enumerate("ab")]
    s = snap([worker("g0"), worker("g1")], quiet, [])
    assert lone_pairs(s, CFG) == ["a"]
    assert lone_pairs(s, replace(CFG, rehome_lone=False)) == []
    assert lone_pairs(s, replace(CFG, review_alone=False)) == []
    assert lone_pairs(s, replace(CFG, rehome=False)) == []
    assert lone_pairs(s, replace(CFG, pack=False)) == []
    assert lone_pairs(s, PolicyConfig(name="fifo")) == []
