"""Roaming samples: an asynchronous job's sample runs on an idle group while its home
trains it."""

from __future__ import annotations

from dataclasses import replace

from plexrl.messages import Function
from plexrl.policy import PolicyConfig, Run, plan
from plexrl.policy.costs import SharingCosts
from tests.test_policy_plexrl import call, job, snap, worker

CFG = PolicyConfig(name="plexrl", pack=False)


def runs(actions) -> dict[str, tuple[str, ...]]:
    return {a.worker_id: a.request_ids for a in actions if isinstance(a, Run)}


def test_a_sample_that_came_with_the_training_its_home_starts_roams_at_once():
    # The job's training and its next rollout's sample wait together: the home takes
    # the training and the sample goes to the idle group now, not after the training.
    sample = replace(call("a", 3.0, Function.SAMPLE), portable=True)
    calls = [call("a", 1.0, Function.FORWARD_BACKWARD), call("a", 2.0, Function.OPTIM_STEP)]
    s = snap([worker("g0"), worker("g1")], [job("a", "g0", staleness=1)], [*calls, sample])
    assert runs(plan(s, CFG)) == {
        "g0": ("a/forward_backward", "a/optim_step"),
        "g1": ("a/sample",),
    }


def test_a_sample_its_home_is_free_for_stays_home():
    sample = replace(call("a", 3.0, Function.SAMPLE), portable=True)
    s = snap([worker("g0"), worker("g1")], [job("a", "g0", staleness=1)], [sample])
    assert runs(plan(s, CFG)) == {"g0": ("a/sample",)}


def test_a_sample_that_needs_its_jobs_state_never_roams():
    calls = [call("a", 1.0, Function.FORWARD_BACKWARD), call("a", 3.0, Function.SAMPLE)]
    s = snap([worker("g0"), worker("g1")], [job("a", "g0", staleness=1)], calls)
    assert runs(plan(s, CFG)) == {"g0": ("a/forward_backward",)}


def test_a_sample_that_can_roam_nowhere_goes_before_its_jobs_training_at_home():
    # One group: the sample of saved weights that came in behind the job's training
    # goes first (its rollout lane is on its critical path), the training after it.
    sample = replace(call("a", 3.0, Function.SAMPLE), portable=True)
    calls = [call("a", 1.0, Function.FORWARD_BACKWARD), call("a", 2.0, Function.OPTIM_STEP)]
    s = snap([worker("g0")], [job("a", "g0", staleness=2)], [*calls, sample])
    assert runs(plan(s, CFG)) == {"g0": ("a/sample",)}


def test_a_sample_roams_only_where_the_borrowed_groups_own_switch_leaves_time_for_it():
    # g1's job said it stays idle 100 s; the 60 s sample, its sampler weights' load and
    # the pool's 1 s engine switch fit in that. g1's worker measured a 50 s switch of
    # its own: they no longer fit, and the sample waits at home behind the training.
    sample = replace(call("a", 3.0, Function.SAMPLE), portable=True)
    calls = [call("a", 1.0, Function.FORWARD_BACKWARD), call("a", 2.0, Function.OPTIM_STEP)]
    jobs = [job("a", "g0", staleness=1), job("b", "g1", idle_until=200.0)]
    s = snap([worker("g0"), worker("g1")], jobs, [*calls, sample])
    assert runs(plan(s, CFG))["g1"] == ("a/sample",)
    slow = replace(worker("g1"), sharing=SharingCosts(switch_s=50.0))
    s = snap([worker("g0"), slow], jobs, [*calls, sample])
    assert "g1" not in runs(plan(s, CFG))
