"""Conservation and determinism on a few dozen stochastic jobs, under every deployment."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.messages import Function
from plexrl_sim.multiplexed import MultiplexedSim
from plexrl_sim.report import makespan_floor_s
from plexrl_sim.results import HOUR
from plexrl_sim.run import DEPLOYMENTS, TAIL_SUFFIX, policy_config, prepare, run_deployment
from plexrl_sim.workload import TAIL_RELEASE
from tests.sim_fixtures import small_trace, write_workload

POLICY_RUNS = ["fifo", "pack", "spread", "spread-backfill", "plexrl", "plexrl+tail"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return prepare(write_workload(tmp_path_factory.mktemp("w"), small_trace()), seed=3)


@pytest.fixture(scope="module")
def results(setup):
    return {name: run_deployment(setup, name) for name in [*DEPLOYMENTS, "fifo"]}


def test_every_job_finishes_in_every_deployment(setup, results):
    for name, r in results.items():
        assert len(r.finished) == len(setup.jobs), name
        assert all(j.start_s >= j.arrival_s - 1e-9 for j in r.jobs), name


def test_device_seconds_never_exceed_capacity(setup, results):
    for name, r in results.items():
        # Per group: what its jobs used fits in the time it was held.
        for g in r.groups:
            assert g.used_device_s <= g.devices * g.held_s * (1 + 1e-9) + 1e-6, (name, g)
        # Per hour, cluster-wide: busy and allocated GPUs never exceed the cluster.
        alloc, busy = r.timeline.trimmed(r.makespan_s)
        assert np.all(alloc <= setup.gpus * HOUR * (1 + 1e-9)), name
        assert np.all(busy <= alloc + 1e-6 * HOUR), name
        # Useful work never exceeds what the jobs occupied.
        for j in r.finished:
            assert j.useful_device_s <= j.used_device_s * (1 + 1e-9), (name, j.job_id)


def test_useful_work_is_the_same_in_every_deployment(results):
    useful = {name: sorted(j.useful_device_s for j in r.jobs) for name, r in results.items()}
    first = next(iter(useful.values()))
    for values in useful.values():
        assert values == pytest.approx(first)


def test_charged_never_exceeds_occupied_and_occupied_covers_the_groups(results):
    for name in POLICY_RUNS:
        r = results[name]
        held = sum(g.held_s * g.devices for g in r.groups)
        assert sum(j.occupied_gpu_s for j in r.jobs) == pytest.approx(held), name
        for j in r.finished:
            assert j.used_device_s <= j.occupied_gpu_s * (1 + 1e-9), (name, j.job_id)


def test_no_job_runs_faster_than_alone(results):
    floor = makespan_floor_s(results["isolated"])
    for name in POLICY_RUNS:
        for j in results[name].finished:
            assert j.slowdown >= -1e-9, (name, j.job_id)
        assert results[name].makespan_s >= floor * (1 - 1e-9), name


@pytest.mark.parametrize("name", ["spread-backfill", "plexrl+tail"])
def test_every_jobs_phases_all_run_in_order(setup, name):
    factory = setup.factory
    policy = name
    if name.endswith(TAIL_SUFFIX):
        policy, factory = name[: -len(TAIL_SUFFIX)], factory.with_tail_release(TAIL_RELEASE)
    sim = MultiplexedSim(
        factory,
        setup.jobs,
        setup.groups,
        policy_config(setup, policy, {}),
        setup.gpus,
        record_trail=True,
    )
    sim.run()
    for spec in setup.jobs:
        fb = factory.workload.profiles[spec.profile].fb_calls
        step = [
            Function.SAMPLE,
            *[Function.FORWARD_BACKWARD] * fb,
            Function.OPTIM_STEP,
            Function.SAVE,
        ]
        expected = [(0, Function.CREATE)] + [(k, f) for k in range(spec.steps) for f in step]
        assert sim.trails()[spec.job_id] == expected, spec.job_id


def test_the_simulation_is_deterministic_for_a_seed(tmp_path):
    path = write_workload(tmp_path, small_trace(jobs=12))

    def figures(seed: int) -> list[tuple[str, float, float, float]]:
        setup = prepare(path, seed=seed)
        out = []
        for name in ("split-async", "spread-backfill", "plexrl+tail"):
            r = run_deployment(setup, name)
            out += [(j.job_id, j.finish_s, j.used_device_s, j.call_queue_s) for j in r.jobs]
        return out

    assert figures(7) == figures(7)
    assert figures(7) != figures(8)


def test_tail_release_keeps_durations_and_work(setup):
    plain = setup.factory.steps(setup.jobs[0])
    early = setup.factory.with_tail_release(TAIL_RELEASE).steps(setup.jobs[0])
    assert np.allclose(plain.isolated_step_s, early.isolated_step_s)
    assert np.allclose(plain.useful_work, early.useful_work)
    assert np.all(early.exclusive_s <= plain.exclusive_s + 1e-9)
    assert np.all(plain.tail_s == 0)
