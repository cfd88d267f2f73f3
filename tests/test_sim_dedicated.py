"""The dedicated baselines in closed form, on steps small enough to compute by hand."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl_sim.dedicated import (
    best_rollout_share,
    colocated_wall_s,
    isolated_wall_s,
    pipeline_s,
    split_async_wall_s,
    split_stages,
)
from plexrl_sim.workload import Colocated, Profile, Rollout, SplitAsync, Steps


def steps(
    n: int,
    *,
    dense: float = 3.0,
    tail: float = 0.0,
    scalable: float = 2.0,
    useful_rollout: float = 1.5,
    reward: float = 3.0,
    fb: float = 4.0,
    optim: float = 0.0,
    save: float = 0.0,
    misc: float = 0.0,
    create: float = 0.0,
) -> Steps:
    """`n` identical steps; the rollout lasts `dense + tail`, of which `scalable` is
    throughput-bound, and does `useful_rollout` group-seconds of useful work."""
    full = np.full
    return Steps(
        dense_s=full(n, dense),
        dense_work=full(n, useful_rollout),
        tail_s=full(n, tail),
        tail_work=full(n, 0.0),
        scalable_s=full(n, scalable),
        reward_s=full(n, reward),
        fb_s=full(n, fb),
        optim_s=optim,
        save_s=save,
        misc_s=full(n, misc),
        create_s=create,
        train_util=1.0,
        save_util=1.0,
        fb_calls=1,
    )


def profile(devices: int = 4, **split: object) -> Profile:
    return Profile(
        devices=devices,
        state_bytes=1,
        rollout=Rollout(sample_s=1.0),
        train_s=1.0,
        split=SplitAsync(**{"sync_s": 1.0, **split}),  # type: ignore[arg-type]
        colocated=Colocated(rollout_slowdown=1.5, switch_s=2.0),
    )


def test_isolated_is_create_plus_every_phase_of_every_step():
    s = steps(2, dense=2, tail=1, reward=3, fb=4, optim=1, save=1, misc=0.5, create=10)
    # 2 + 1 + 3 + 4 + 1 + 1 + 0.5 = 12.5 a step.
    assert isolated_wall_s(s) == pytest.approx(10 + 2 * 12.5)


def test_colocated_slows_only_the_throughput_bound_rollout_and_pays_the_switch():
    s = steps(2, dense=2, tail=1, scalable=2, reward=3, fb=4, optim=1, save=1, misc=0.5, create=10)
    # 12.5 + 2 s scalable x (1.5 - 1) + 2 s switch = 15.5 a step.
    assert colocated_wall_s(s, profile()) == pytest.approx(10 + 2 * 15.5)


def test_split_scales_only_the_throughput_bound_part_of_the_rollout():
    s = steps(1, dense=3, scalable=2, reward=3, fb=4)
    stages = split_stages(s, profile().split, 0.5)
    # Half the devices roll out: the scalable 2 s take 4 s, the latency-bound 1 s stays
    # 1 s, then the pool waits 3 s for its scores; the other half trains 4 s in 8 s.
    assert stages.rollout == [pytest.approx(4 + 1 + 3)]
    assert stages.scoring == [0.0]
    assert stages.train == [pytest.approx(8.0)]


def test_split_pipeline_with_staleness_one():
    # Rollout 8 s, training 8 s, sync 1 s. Rollout 2 needs step 0's weights (16 + 1):
    #   roll [0,8]  [8,16]  [17,25];  train [8,16]  [17,25]  [26,34];  last sync: 35.
    s = steps(3)
    assert split_async_wall_s(s, profile(), 0.5) == pytest.approx(35.0)


def test_split_pipeline_synchronous():
    # Staleness 0: rollout 1 needs step 0's weights: roll [0,8] [17,25], train [8,16]
    # [25,33], sync: 34.
    s = steps(2)
    assert split_async_wall_s(s, profile(staleness=0), 0.5) == pytest.approx(34.0)


def test_split_with_a_scorer_beside_the_pools():
    # The pool rolls out 5 s and moves on; scores land 3 s later. roll [0,5] [5,10];
    # train [8,16], then [17,25] (waits for its own sync after step 0); sync: 26.
    s = steps(2)
    split = profile(scoring="scorer").split
    stages = split_stages(s, split, 0.5)
    assert stages.rollout == [pytest.approx(5.0)] * 2
    assert stages.scoring == [pytest.approx(3.0)] * 2
    assert pipeline_s(stages, split) == pytest.approx(26.0)


def test_split_with_partial_rollouts():
    # Batch kept full: 1.5 s of useful rollout work on half the devices is 3 s, above
    # the 3 s longest response over 2 iterations (1.5 s); then 3 s of scores, 8 s of
    # training, 1 s of sync: 15.
    s = steps(1)
    assert split_async_wall_s(s, profile(partial_rollouts=True), 0.5) == pytest.approx(15.0)
    # With a long latency-bound rollout the floor binds: 30 s over 2 iterations.
    s = steps(1, dense=30, scalable=2)
    stages = split_stages(s, profile(partial_rollouts=True).split, 0.5)
    assert stages.rollout == [pytest.approx(15.0 + 3.0)]


def test_best_split_is_searched_per_job():
    # 4 s of scalable rollout and 4 s of training a step, nothing else, weights barely
    # stale: the pools balance at 2 devices each (8 s a step), against 16 s at 1 or 3.
    s = steps(40, dense=4, scalable=4, reward=0, fb=4)
    p = profile(staleness=8, sync_s=0.0)
    assert best_rollout_share(s, p) == pytest.approx(0.5)
    assert split_async_wall_s(s, p) == pytest.approx(
        min(split_async_wall_s(s, p, share) for share in (0.25, 0.5, 0.75))
    )
    # A fixed fraction is taken as given (rounded to whole devices).
    assert best_rollout_share(s, profile(rollout_fraction=0.7)) == pytest.approx(0.75)
