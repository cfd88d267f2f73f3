"""The main job's checks of its own run: the control phase and what counts as learning, on
hand-made results."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import pytest
from rlvr import CLEAR_GAIN, SOLVED, JobResult, learned
from rlvr_demo import Control, policy_variant


def _job(i: int, wall: float, rewards: tuple[float, ...] = (0.5, 0.6)) -> JobResult:
    return JobResult(model_id=f"m{i}", sft_losses=[1.0], rewards=list(rewards), wall_s=wall)


def test_one_job_per_worker_is_recognised_and_a_shared_worker_is_not() -> None:
    results = [_job(0, 10.0), _job(1, 12.0)]
    assert Control(results, {"m0": {"w0"}, "m1": {"w1"}}).own_worker_each()
    assert not Control(results, {"m0": {"w0"}, "m1": {"w0"}}).own_worker_each()
    assert not Control(results, {"m0": {"w0", "w1"}, "m1": {"w1"}}).own_worker_each()
    assert not Control(results, {"m0": {"w0"}}).own_worker_each()


def test_figures_are_the_mean_slowdown_against_the_jobs_alone() -> None:
    alone = [_job(0, 10.0), _job(1, 20.0)]
    control = Control([_job(0, 11.0), _job(1, 26.0)], {"m0": {"w0"}, "m1": {"w1"}})
    figures = control.figures(alone)
    assert figures["mean_slowdown"] == round((1.1 + 1.3) / 2, 3)
    assert figures["jobs_wall_s"] == [11.0, 26.0]
    assert figures["own_worker_each"]


def test_a_control_job_that_learned_differently_is_a_problem() -> None:
    alone = [_job(0, 10.0), _job(1, 10.0)]
    same = Control([_job(0, 12.0), _job(1, 12.0)], {})
    assert same.problems(alone) == []
    other = Control([_job(0, 12.0), _job(1, 12.0, rewards=(0.5, 0.7))], {})
    assert other.problems(alone) == ["control: job 1's rewards or losses differ from its run alone"]


def test_learning_is_a_clear_rise_or_a_solved_task_held() -> None:
    assert learned(0.40, 0.40 + CLEAR_GAIN + 1e-9)
    assert not learned(0.40, 0.44)  # too little to tell from noise
    assert learned(0.96, 0.93)  # solved by the warm-up, and RL kept it there
    assert learned(SOLVED - 0.02, SOLVED)  # ended solved without a clear rise
    assert not learned(0.99, 0.99 - CLEAR_GAIN - 0.01)  # RL undid part of it
    assert not learned(0.935, 0.852)  # measured at the old RL learning rate
    assert not learned(0.86, 0.88)  # neither risen nor solved


def test_a_policy_variant_carries_its_scheduler_settings_and_a_wrong_one_says_what_to_change() -> (
    None
):
    plain = policy_variant("fifo")
    assert (plain.label, plain.name, plain.env) == ("fifo", "fifo", {})
    variant = policy_variant(" plexrl:hold_s=0:roam_samples=false ")
    assert variant.label == "plexrl:hold_s=0:roam_samples=false"
    assert variant.name == "plexrl"
    assert variant.env == {"PLEXRL_HOLD_S": "0", "PLEXRL_ROAM_SAMPLES": "false"}
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        policy_variant("nope")
    with pytest.raises(ValueError, match=r"not a scheduler setting.*hold_s"):
        policy_variant("plexrl:hold=0")
    with pytest.raises(ValueError, match="not a scheduler setting"):
        policy_variant("plexrl:hold_s")
