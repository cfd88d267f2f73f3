"""Re-homing in the simulator: a newcomer's home reviewed once its own figures are known,
and a job's again once it is left alone on its group or, alone, another alone could take
it, carried out by the executor with the costs of a restore from the disk tier."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plexrl_sim.results import DeploymentResult
from plexrl_sim.run import Setup, prepare, run_deployment
from tests.sim_fixtures import write_workload
from tests.test_sim_headline import small_h200_trace


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    path = write_workload(tmp_path_factory.mktemp("w"), small_h200_trace())
    # (A draw in which some pair refused when a job was left alone fits later on: not
    # every draw of so small a trace has one.)
    return prepare(path, seed=3, staleness=1)


@pytest.fixture(scope="module")
def runs(setup: Setup) -> dict[str, DeploymentResult]:
    return {
        "on": run_deployment(setup, "plexrl+tail"),
        "off": run_deployment(setup, "plexrl+tail", overrides={"rehome": False}),
        "newcomers": run_deployment(setup, "plexrl+tail", overrides={"rehome_lone": False}),
        "left alone": run_deployment(setup, "plexrl+tail", overrides={"review_alone": False}),
    }


def test_newcomers_move_once_to_a_group_of_their_size(runs: dict[str, DeploymentResult]):
    newcomers = runs["newcomers"]
    moved = [j for j in newcomers.jobs if j.rehomed_from]
    assert moved and newcomers.counts["rehomed"] == len(moved)
    on = runs["on"]
    moved = [j for j in on.jobs if j.rehomed_from]
    assert moved and on.counts["rehomed"] >= len(moved)  # left alone, some move again
    for job in moved:
        assert job.group != job.rehomed_from
        assert job.group.split("-")[0] == job.rehomed_from.split("-")[0]  # its size class
        assert job.done
    assert runs["off"].counts["rehomed"] == 0
    assert not any(j.rehomed_from for j in runs["off"].jobs)


def test_a_job_left_alone_is_reviewed_again(runs: dict[str, DeploymentResult]):
    # Its last neighbour gone, it joins a job alone where both stay within budget.
    on, newcomers = runs["on"].counts, runs["newcomers"].counts
    assert 0 < on["rehomed_alone"] <= on["rehomed"]
    assert newcomers["rehomed_alone"] == 0 and newcomers["rehomed"] > 0


def test_jobs_alone_are_asked_about_again_every_review_interval(
    runs: dict[str, DeploymentResult],
):
    # Reviewed only when left alone, a job alone whose pair was refused then stays alone;
    # asked about again (`plexrl.policy.lone_pairs`), more of them join another alone.
    on, left = runs["on"].counts, runs["left alone"].counts
    assert on["rehomed_alone"] > left["rehomed_alone"] > 0


def test_a_moved_job_pays_its_restore(runs: dict[str, DeploymentResult]):
    # Its state read from the disk tier at the new home and its logged calls replayed
    # there: swap seconds it did not pay where it kept its home.
    off = {j.job_id: j for j in runs["off"].jobs}
    for job in (j for j in runs["on"].jobs if j.rehomed_from):
        assert job.swaps >= 1 and job.swap_s > 0, job.job_id
        assert off[job.job_id].rehomed_from == ""


def test_the_known_duty_control_places_on_own_figures_and_reviews_no_newcomer(setup: Setup):
    counts = run_deployment(replace(setup, known_duty=True), "plexrl+tail").counts
    assert counts["rehomed"] == counts["rehomed_alone"]


def test_same_figures_again(setup: Setup, runs: dict[str, DeploymentResult]):
    again = run_deployment(setup, "plexrl+tail")
    assert [(j.job_id, j.group, j.step_time_s) for j in again.jobs] == [
        (j.job_id, j.group, j.step_time_s) for j in runs["on"].jobs
    ]
