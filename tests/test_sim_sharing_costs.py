"""The costs of sharing a group, as the executor charges them and the policy predicts
them: one definition (`plexrl.policy.costs.SharingCosts`)."""

from __future__ import annotations

import pytest

from plexrl_sim.multiplexed import MultiplexedSim
from plexrl_sim.run import policy_config, prepare, run_deployment
from plexrl_sim.workload import parse_colocation
from tests.sim_fixtures import two_jobs_one_worker, write_workload


def _tail_beside_runs(mode: str) -> dict:
    # A samples 2 s, then its stragglers decode 4 s alone (10% of the worker) in the
    # background; B (no stragglers) samples 1 s and trains 2 s beside them.
    doc = two_jobs_one_worker()
    doc["cluster"] = {"colocation": {"switch_s": 0.0, "contention_while": mode}}
    doc["profiles"]["p"].update(
        rollout={"sample_s": 2.0, "tail_s": 4.0, "tail_util": 0.1, "tail_threshold": 0.25},
        reward_s=1.0,
    )
    doc["profiles"]["q"] = {
        **doc["profiles"]["p"],
        "rollout": {"sample_s": 1.0},
        "reward_s": 0.0,
        "train_s": 2.0,
    }
    doc["jobs"][1]["profile"] = "q"
    for job in doc["jobs"]:
        job["steps"] = 1
    return doc


def test_a_tail_slows_only_while_a_run_is_in_flight_beside_it(tmp_path):
    # A's tail starts at 2. B samples [2, 3.33] (1 s of work at 75% of the worker: A's
    # stragglers hold 25% beside it) and trains [3.33, 6]; meanwhile A's tail decodes at
    # 1 / 1.25 of its speed: 4 s of it minus 3.2 s done by 6, the last 0.8 s alone
    # [6, 6.8]. A's reward [6.8, 7.8], its training [7.8, 8.8].
    setup = prepare(write_workload(tmp_path, _tail_beside_runs("run")))
    result = run_deployment(setup, "fifo")
    a, b = (next(j for j in result.jobs if j.job_id == x) for x in ("A", "B"))
    assert (a.finish_s, b.finish_s) == pytest.approx((8.8, 6.0))
    # A is charged its calls (3 s) and its tail: 10% of the worker for its 0.8 s alone,
    # 25% for the 4 s beside B's Runs.
    assert a.used_device_s == pytest.approx(3.0 + 0.1 * 0.8 + 0.25 * 4.0)


def test_shared_scope_charges_the_whole_tail_whenever_another_job_is_homed(tmp_path):
    # The pessimistic bound: 4 s x 1.25 = 5 s whatever runs, at 25% of the worker.
    setup = prepare(write_workload(tmp_path, _tail_beside_runs("shared")))
    result = run_deployment(setup, "fifo")
    a = next(j for j in result.jobs if j.job_id == "A")
    assert a.finish_s == pytest.approx(9.0)
    assert a.used_device_s == pytest.approx(3.0 + 0.25 * 5.0)


def test_the_policy_predicts_with_the_costs_the_executor_charges(tmp_path):
    doc = two_jobs_one_worker()
    doc["cluster"] = {"colocation": {"switch_s": 2.5, "tail_contention": 1.5}}
    setup = prepare(write_workload(tmp_path, doc))
    sim = MultiplexedSim(
        setup.factory, setup.jobs, setup.groups, policy_config(setup, "plexrl", {}), setup.gpus
    )
    assert sim.config.sharing is sim.executor.costs
    assert (sim.config.sharing.switch_s, sim.config.sharing.tail_contention) == (2.5, 1.5)


def test_a_bad_cost_says_what_to_change(tmp_path):
    doc = two_jobs_one_worker()
    doc["cluster"] = {"colocation": {"contention_while": "always"}}
    with pytest.raises(ValueError, match=r"cluster\.colocation: contention_while"):
        prepare(write_workload(tmp_path, doc))


def test_costs_set_for_a_run_replace_the_workloads_for_executor_and_policy(tmp_path):
    # The tail case above with its stragglers as cheap as can be beside B's Runs: A's
    # tail decodes [2, 6] at full speed and holds only the 10% of the worker it uses,
    # so B's 3 s of Runs take 3 / 0.9 s from 2.
    path = write_workload(tmp_path, _tail_beside_runs("run"))
    free = parse_colocation("tail_min_share=0, tail_contention=1")
    setup = prepare(path, colocation=free)
    costs = setup.workload.cluster.colocation
    assert (costs.switch_s, costs.tail_min_share, costs.tail_contention) == (0.0, 0.0, 1.0)
    result = run_deployment(setup, "fifo")
    a, b = (next(j for j in result.jobs if j.job_id == x) for x in ("A", "B"))
    assert (a.finish_s, b.finish_s) == pytest.approx((8.0, 2.0 + 3.0 / 0.9))
    assert a.used_device_s == pytest.approx(3.0 + 0.1 * 4.0)
    sim = MultiplexedSim(
        setup.factory, setup.jobs, setup.groups, policy_config(setup, "plexrl", {}), setup.gpus
    )
    assert sim.config.sharing == sim.executor.costs == costs.costs()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("switch=0", r"colocation 'switch=0': use key=value with a key of .*switch_s"),
        ("switch_s", r"use key=value"),
        ("tail_contention=fast", r"tail_contention takes a number"),
    ],
)
def test_a_bad_cost_override_says_what_to_change(text, message):
    with pytest.raises(ValueError, match=message):
        parse_colocation(text)


def test_a_cost_override_out_of_range_is_refused_as_the_workloads_is(tmp_path):
    path = write_workload(tmp_path, two_jobs_one_worker())
    with pytest.raises(ValueError, match=r"cluster\.colocation"):
        prepare(path, colocation={"tail_min_share": 1.5})


def _charged_apart(tmp_path, learn_costs: int) -> tuple:
    # The tail case above, its stragglers decoding twice as slowly beside B's Runs
    # (charged) where the policy assumes the workload's 1.25.
    path = write_workload(tmp_path, _tail_beside_runs("run"))
    setup = prepare(path, charge={"tail_contention": 2.0}, learn_costs=learn_costs)
    config = policy_config(setup, "fifo", {})
    assert setup.assumed is not None
    sim = MultiplexedSim(
        setup.factory,
        setup.jobs,
        setup.groups,
        config,
        setup.gpus,
        assumed=setup.assumed.costs(),
        learn_samples=learn_costs,
    )
    return setup, sim


def test_costs_charged_apart_from_those_assumed_are_learned_once_paid_often_enough(tmp_path):
    setup, sim = _charged_apart(tmp_path, learn_costs=1)
    assert setup.assumed is not None and setup.assumed.tail_contention == 1.25
    assert setup.workload.cluster.colocation.tail_contention == 2.0  # what every deployment pays
    assert sim.config.sharing.tail_contention == 1.25 and sim.executor.costs.tail_contention == 2.0
    result = sim.run()
    # Learned once a Run of B's beside A's tail (from 2) ended, by its sample's end.
    assert sim.config.sharing == sim.executor.costs
    assert 2 <= result.counts["costs_learned_s"] <= 3
    # Charged as set: A's tail decodes at half speed beside B's Runs to 6, 4 - 2 s done,
    # the last 2 s alone [6, 8]; A's reward and training [8, 10].
    a = next(j for j in result.jobs if j.job_id == "A")
    assert a.finish_s == pytest.approx(10.0)


def test_a_policy_told_not_to_learn_keeps_the_costs_it_assumed(tmp_path):
    _, sim = _charged_apart(tmp_path, learn_costs=0)
    result = sim.run()
    assert sim.config.sharing.tail_contention == 1.25
    assert result.counts["costs_learned_s"] == 0
    a = next(j for j in result.jobs if j.job_id == "A")
    assert a.finish_s == pytest.approx(10.0)  # charged alike


def test_a_run_in_other_processes_is_set_up_with_the_same_costs(tmp_path):
    path = write_workload(tmp_path, _tail_beside_runs("run"))
    setup = prepare(
        path, colocation={"switch_s": 0.5}, charge={"tail_min_share": 0.3}, learn_costs=5
    )
    again = prepare(**setup.recipe())
    assert again.workload.cluster.colocation == setup.workload.cluster.colocation
    assert again.assumed == setup.assumed and again.learn_costs == 5
    assert setup.assumed is not None
    assert (setup.assumed.switch_s, setup.assumed.tail_min_share) == (0.5, 0.25)
    charged = setup.workload.cluster.colocation
    assert (charged.switch_s, charged.tail_min_share) == (0.5, 0.3)
