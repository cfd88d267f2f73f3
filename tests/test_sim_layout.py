"""How the GPUs are split into whole groups per model size (`workload.apportion`)."""

from __future__ import annotations

from plexrl_sim.workload import apportion

SIZES = {"7B": 16, "30B": 32, "235B": 128}


def test_a_large_group_short_of_its_share_is_not_left_at_one_for_idle_gpus():
    # 512 GPUs wanted as 5.16 / 5.64 / 1.95 groups: rounding each down alone gives
    # 6 / 6 / 1 (416 GPUs) and 96 GPUs no 235B group fits.
    share = {"7B": 5.16 * 16, "30B": 5.64 * 32, "235B": 1.95 * 128}
    counts = apportion(share, SIZES, 512)
    assert counts == {"7B": 6, "30B": 5, "235B": 2}
    assert sum(SIZES[k] * c for k, c in counts.items()) == 512


def test_the_least_covered_profile_gets_the_most_it_can():
    share = {"7B": 7.43 * 16, "30B": 6.46 * 32, "235B": 1.46 * 128}
    counts = apportion(share, SIZES, 512)
    least = min(SIZES[k] * c / share[k] for k, c in counts.items())
    # Every other split of 512 GPUs with at least one group each covers someone less.
    for a in range(1, 33):
        for b in range(1, 17):
            for c in range(1, 5):
                if 16 * a + 32 * b + 128 * c <= 512:
                    other = min(
                        16 * a / share["7B"], 32 * b / share["30B"], 128 * c / share["235B"]
                    )
                    assert other <= least + 1e-12


def test_exact_shares_are_met_and_every_gpu_that_fits_a_group_is_used():
    assert apportion({"7B": 192.0, "30B": 320.0, "235B": 1536.0}, SIZES, 2048) == {
        "7B": 12,
        "30B": 10,
        "235B": 12,
    }
    # The 40 GPUs the shares leave take two more 16-GPU groups; 8 fit nothing.
    counts = apportion({"7B": 160.0, "30B": 320.0}, {"7B": 16, "30B": 32}, 520)
    assert 16 * counts["7B"] + 32 * counts["30B"] > 520 - 16


def test_every_profile_gets_a_group_even_with_a_tiny_share():
    counts = apportion({"7B": 500.0, "235B": 1.0}, {"7B": 16, "235B": 128}, 512)
    assert counts["235B"] == 1
    assert counts["7B"] == (512 - 128) // 16


def _job(duty: float, job_id: str = "j"):
    from plexrl.messages import Function
    from plexrl.policy.snapshot import CallEstimates, JobView

    seconds = {Function.SAMPLE: 20.0, Function.FORWARD_BACKWARD: 5.0}
    calls = (Function.SAMPLE, Function.FORWARD_BACKWARD, Function.FORWARD_BACKWARD)
    return JobView(job_id, 0, estimates=CallEstimates(seconds), duty_cycle=duty, step_calls=calls)


def test_a_job_with_more_idle_time_is_expected_to_pack_denser() -> None:
    import random

    from plexrl.policy.costs import SharingCosts
    from plexrl_sim.packing import MOST_PER_GROUP, admitted_per_group

    costs = SharingCosts()

    def held(duties: list[float], budget: float = 0.05) -> float:
        views = [_job(d, f"j{i}") for i, d in enumerate(duties)]
        return admitted_per_group(views, 1, costs, budget, random.Random(0), fills=50)

    packed = [held([duty]) for duty in (0.9, 0.3, 0.1, 0.05)]
    assert packed[0] == 1  # busy 90% of its step: nothing fits beside it within 5%
    assert packed == sorted(packed) and packed[3] > packed[2] > 1
    assert max(packed) <= MOST_PER_GROUP
    assert held([0.1], budget=0.5) >= packed[2]  # a wider budget, no fewer


def test_held_over_the_cluster_a_size_packs_at_least_as_deep_as_per_group() -> None:
    import random

    from plexrl.policy.costs import SharingCosts
    from plexrl_sim.packing import admitted_in_cluster, admitted_per_group

    costs = SharingCosts()

    def both(duties: list[float]) -> tuple[float, float]:
        views = [_job(d, f"j{i}") for i, d in enumerate(duties)]
        per_group = admitted_per_group(views, 1, costs, 0.05, random.Random(0), fills=50)
        cluster = admitted_in_cluster(views, 1, costs, 0.05, random.Random(0), groups=40)
        return per_group, cluster

    assert both([0.9]) == (1.0, 1.0)  # nothing fits beside a job busy 90% of its step
    for duties in ([0.1], [0.05, 0.1, 0.2]):
        per_group, cluster = both(duties)
        # Jobs alone hold the cluster's mean down: the fullest groups go past 5% each.
        assert cluster >= per_group > 1
    views = [_job(0.05, "a"), _job(0.2, "b")]
    seeded = [admitted_in_cluster(views, 1, costs, 0.05, random.Random(7), 20) for _ in "ab"]
    assert seeded[0] == seeded[1]


def test_a_size_drains_by_its_backlog_or_by_its_last_arrival() -> None:
    from plexrl_sim.packing import drain_days

    # Ten 10-day jobs at day 0: two jobs per group on one group drain in 50 days of
    # work, then the last ones run a mean run on (the fluid's end is when they start).
    assert drain_days([0.0] * 10, [10.0] * 10, 1, 2.0) == 60.0
    assert drain_days([0.0] * 10, [10.0] * 10, 5, 2.0) == 20.0
    # More groups never drain later; none drains before its last arrival's run alone.
    arrivals, runs = [0.0, 1.0, 2.0, 30.0], [10.0, 10.0, 10.0, 25.0]
    days = [drain_days(arrivals, runs, g, 1.5) for g in range(1, 6)]
    assert days == sorted(days, reverse=True) and days[-1] == 55.0


def test_the_layout_gives_a_size_that_would_drain_last_the_groups_it_needs() -> None:
    from plexrl_sim.packing import drain_minimum, packing_by_profile
    from plexrl_sim.run import policy_config, prepare
    from plexrl_sim.workload import TAIL_RELEASE

    setup = prepare("workloads/trace-3mo.yaml", gpus=512, jobs=90, partition="packed")
    factory = setup.factory.with_tail_release(TAIL_RELEASE)
    costs = setup.workload.cluster.colocation.costs()
    config = policy_config(setup, "plexrl", {})
    budget, over_cluster = config.slowdown_budget, config.budget_over_cluster
    packing = packing_by_profile(factory, setup.jobs, costs, budget, over_cluster)
    assert set(packing) == set(SIZES) and all(1 <= p <= 8 for p in packing.values())
    assert packing == packing_by_profile(factory, setup.jobs, costs, budget, over_cluster)
    least = drain_minimum(factory, setup.jobs, packing, costs, 512)
    assert sum(SIZES[k] * c for k, c in least.items()) <= 512
    layout = setup.groups_for("plexrl", factory)
    counts = {p: sum(g.profile == p for g in layout) for p in SIZES}
    assert all(counts[k] >= c for k, c in least.items())


def test_at_least_groups_come_first_and_the_rest_follows_the_shares() -> None:
    share = {"7B": 7.43 * 16, "30B": 6.46 * 32, "235B": 1.46 * 128}
    plain = apportion(share, SIZES, 512)
    forced = apportion(share, SIZES, 512, at_least={"235B": 3})
    assert forced["235B"] == 3 and plain["235B"] < 3
    assert sum(SIZES[k] * c for k, c in forced.items()) > 512 - 16
    # More than the GPUs hold: returned as asked, for the caller to refuse by name.
    assert apportion(share, SIZES, 512, at_least={"235B": 5})["235B"] == 5


def test_a_packed_layout_sizes_each_job_by_the_jobs_a_group_holds_beside_it() -> None:
    from plexrl_sim.run import prepare
    from plexrl_sim.workload import build_groups

    setup = prepare("workloads/trace-3mo.yaml", gpus=512, jobs=90, partition="packed")
    by_run = build_groups(setup.workload, setup.factory, setup.jobs, 512)
    halved = build_groups(
        setup.workload,
        setup.factory,
        setup.jobs,
        512,
        per_group=lambda job: 2.0 if job.profile == "7B" else 1.0,
    )

    def counts(groups: list) -> dict[str, int]:
        return {p: sum(g.profile == p for g in groups) for p in SIZES}

    assert counts(halved)["7B"] < counts(by_run)["7B"]
    assert sum(g.devices for g in halved) <= 512
    # The dedicated deployments keep the layout sized by whole runs; the policies get
    # the packed one.
    assert setup.groups_for("isolated", setup.factory) is setup.groups
    packed = setup.groups_for("plexrl", setup.factory)
    assert packed is not setup.groups and sum(g.devices for g in packed) <= 512


def test_jobs_declare_their_steps_exactly_or_off_by_the_declared_error() -> None:
    import math

    import pytest

    from plexrl_sim.run import prepare

    exact = prepare("workloads/trace-3mo.yaml", gpus=512, jobs=200)
    assert all(j.declared_steps == j.steps for j in exact.jobs)
    off = prepare("workloads/trace-3mo.yaml", gpus=512, jobs=200, declared_error=0.5)
    # The same jobs (the error has its own random stream), their declarations off.
    assert [(j.job_id, j.steps, j.arrival_s) for j in off.jobs] == [
        (j.job_id, j.steps, j.arrival_s) for j in exact.jobs
    ]
    logs = [math.log(j.declared_steps / j.steps) for j in off.jobs]
    assert sum(x != 0 for x in logs) > 190
    assert 0.4 < (sum(x * x for x in logs) / len(logs)) ** 0.5 < 0.6
    with pytest.raises(ValueError, match="declared error"):
        prepare("workloads/trace-3mo.yaml", gpus=512, jobs=20, declared_error=-1)
