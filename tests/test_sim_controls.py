"""The simulator's controls and their plumbing: the known-duty control, and a setup made
again in another process (`plexrl sim --parallel`) with every setting of the first."""

from __future__ import annotations

import pytest

from plexrl.messages import Function
from plexrl.policy.history import UNKNOWN_DUTY
from plexrl_sim.multiplexed import MultiplexedSim
from plexrl_sim.run import policy_config, prepare, run_deployment, run_many
from tests.sim_fixtures import small_trace, two_jobs_one_worker, write_workload


def _setup(tmp_path):
    doc = two_jobs_one_worker()
    doc["profiles"]["p"]["reward_s"] = 5.0  # a step of 2 + 5 + 1 s, busy 3 s of it
    return prepare(write_workload(tmp_path, doc))


def _sim(setup, known_duty: dict[str, float] | None) -> MultiplexedSim:
    return MultiplexedSim(
        setup.factory,
        setup.jobs,
        setup.groups,
        policy_config(setup, "plexrl", {}),
        setup.gpus,
        known_duty=known_duty,
    )


def test_a_job_that_finished_reports_the_duty_cycle_it_was_seen_with(tmp_path):
    jobs = _sim(_setup(tmp_path), None).run().jobs
    # Its calls busy 3 s of its 8 s loop, less what it queued behind the other job.
    assert all(j.done and 3.0 / 8.0 <= j.learned_duty <= 3.0 / 5.0 for j in jobs)


def test_a_newcomer_is_seen_with_its_kinds_figures_unless_its_own_are_given(tmp_path):
    setup = _setup(tmp_path)
    job = _sim(setup, None).jobs["A"]
    assert job.known_duty == 0.0
    assert job.as_view(0.0, {}, 60.0).duty_cycle == UNKNOWN_DUTY  # no kind, no history
    job = _sim(setup, {"A": 0.3}).jobs["A"]
    view = job.as_view(0.0, {}, 60.0)
    assert view.duty_cycle == 0.3
    assert view.duty_bound == 0.0  # its own figure: nothing to guard against
    job.history.homed(0.0)
    job.history.observe(Function.SAMPLE, 60.0)
    job.touch()
    assert job.as_view(100.0, {}, 60.0).duty_cycle == pytest.approx(0.6)  # its history's


def test_the_control_runs_the_deployment_again_with_the_duty_cycles_it_learned(tmp_path):
    path = write_workload(tmp_path, small_trace(jobs=8, days=0.1))
    plain = prepare(path, seed=1)
    first = run_deployment(plain, "plexrl")
    learned = {j.job_id: j.learned_duty for j in first.jobs}
    again = _sim(plain, learned).run()
    control = run_deployment(prepare(path, seed=1, known_duty=True), "plexrl")
    assert [(j.job_id, j.finish_s) for j in control.jobs] == [
        (j.job_id, j.finish_s) for j in again.jobs
    ]
    assert [j.useful_device_s for j in control.jobs] == [j.useful_device_s for j in first.jobs]


def test_a_setup_is_made_again_with_every_setting(tmp_path):
    path = write_workload(tmp_path, small_trace(jobs=12))
    setup = prepare(
        path,
        seed=3,
        gpus=32,
        jobs=12,
        staleness=1,
        fb_slices=4,
        declared_error=0.5,
        known_duty=True,
    )
    again = prepare(**setup.recipe())
    assert again.recipe() == setup.recipe()
    assert [(j.job_id, j.steps, j.declared_steps, j.arrival_s) for j in again.jobs] == [
        (j.job_id, j.steps, j.declared_steps, j.arrival_s) for j in setup.jobs
    ]
    assert any(j.declared_steps != j.steps for j in again.jobs)  # the error came along
    assert [g.devices for g in again.groups] == [g.devices for g in setup.groups]


def test_deployments_in_other_processes_run_the_same_setup(tmp_path):
    path = write_workload(tmp_path, small_trace(jobs=8, days=0.1))
    setup = prepare(path, seed=1, declared_error=0.5, known_duty=True)
    here = run_deployment(setup, "plexrl")
    there = run_many(setup, ["plexrl", "fifo"], parallel=2)["plexrl"]
    assert [(j.job_id, j.finish_s) for j in there.jobs] == [
        (j.job_id, j.finish_s) for j in here.jobs
    ]
