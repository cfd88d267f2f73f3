"""The live scheduler's rules in the simulator: it decides through `plexrl.policy.decide`,
so co-sampling, preemption and anticipation happen there as they do live."""

from __future__ import annotations

import pytest

from plexrl_sim.run import prepare, run_deployment
from tests.sim_fixtures import two_jobs_one_worker, write_workload


def _jobs(result):
    return (next(j for j in result.jobs if j.job_id == x) for x in ("A", "B"))


def test_sample_calls_pending_together_decode_as_one_batch(tmp_path):
    # Each sample keeps half the worker busy (dense_util 0.5): two decode together in the
    # time of one. A creates [0,1], B [1,2]; both samples are pending at 2 and run as one
    # batch [2,4]; A trains [7,8], B [8,9]; then each samples alone (their next samples
    # arrive apart): A [9,11], B [11,13]; A trains [14,15], B [16,17].
    doc = two_jobs_one_worker()
    doc["profiles"]["p"].update(rollout={"sample_s": 2.0, "dense_util": 0.5}, create_s=1.0)
    setup = prepare(write_workload(tmp_path, doc))
    result = run_deployment(setup, "fifo")
    a, b = _jobs(result)
    assert (a.finish_s, b.finish_s) == pytest.approx((15.0, 17.0))
    assert result.counts["cosampled"] == 1
    # The batch's 2 s are charged half to each; each job is charged 1 + 1 + 1 + 2 + 1.
    assert (a.used_device_s, b.used_device_s) == pytest.approx((6.0, 6.0))
    # Without co-sampling B's first sample runs after A's, [4,6]: the worker is busy 2 s
    # longer for the same work (each job charged 1 + 2 + 1 + 2 + 1).
    doc["policy"] = {"max_cosampled_calls": 0}
    alone = run_deployment(prepare(write_workload(tmp_path, doc)), "fifo")
    assert alone.counts["cosampled"] == 0
    assert [j.used_device_s for j in alone.jobs] == pytest.approx([7.0, 7.0])


def test_a_sample_batch_yields_to_a_short_call_and_resumes_after_it(tmp_path):
    # A samples for 10 s a step; B arrives at 12.5, while A's second sample [12,22] runs,
    # with a create the policy expects to be short (it has no history: 0.05 s). The batch
    # yields: B creates [12.5,14.5] while it is paused, then it resumes and ends at 24.
    doc = two_jobs_one_worker()
    doc["profiles"]["p"].update(rollout={"sample_s": 10.0}, reward_s=1.0)
    doc["profiles"]["q"] = {**doc["profiles"]["p"], "rollout": {"sample_s": 1.0}, "create_s": 2.0}
    doc["jobs"][1].update(profile="q", arrival_s=12.5, steps=1)
    doc["policy"] = {"slowdown_budget": 10.0, "pack": False, "max_cosampled_calls": 0}
    setup = prepare(write_workload(tmp_path, doc))
    result = run_deployment(setup, "plexrl")
    a, b = _jobs(result)
    assert result.counts["preempted"] == 1
    # A: sample [0,10], reward, train [11,12], sample [12,24] (2 s paused), train [25,26].
    assert a.finish_s == pytest.approx(26.0)
    # The pause is not charged to A: two 10 s samples, two 1 s trainings.
    assert a.used_device_s == pytest.approx(22.0)
    # B then samples [24,25] and trains [26,27].
    assert b.finish_s == pytest.approx(27.0)
    assert b.call_queue_s == pytest.approx(24.0 - 14.5)
    off = run_deployment(setup, "plexrl", overrides={"preempt_ratio": 0.0})
    assert off.counts["preempted"] == 0
    assert next(j for j in off.jobs if j.job_id == "B").start_s == pytest.approx(12.5)


def test_a_group_is_held_a_round_trip_for_a_bursting_job(tmp_path):
    # A's calls come 50 ms apart (reward and host-side gaps), B arrives at 0.5 for one
    # step. When A's training ends at 3.0 with B's training waiting, the group is held
    # for A (its last gap 50 ms, within hold_s): B starts at 3.05, not at 3.0.
    doc = two_jobs_one_worker()
    doc["profiles"]["p"].update(rollout={"sample_s": 1.0}, reward_s=0.05, misc_s=0.05)
    doc["jobs"][0]["steps"] = 3
    doc["jobs"][1].update(arrival_s=0.5, steps=1)
    doc["policy"] = {"slowdown_budget": 10.0, "pack": False}
    setup = prepare(write_workload(tmp_path, doc))
    held = run_deployment(setup, "plexrl")
    assert held.counts["held"] > 0
    _, b = _jobs(held)
    assert b.finish_s == pytest.approx(4.1, abs=1e-5)  # trained [3.05,4.05], then its gap
    off = run_deployment(setup, "plexrl", overrides={"hold_s": 0.0})
    assert off.counts["held"] == 0
    assert next(j for j in off.jobs if j.job_id == "B").finish_s == pytest.approx(4.05)
