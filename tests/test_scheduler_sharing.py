"""The costs of sharing the live scheduler's policy predicts with: its settings.

The plexrl policy prices placement and admission with an engine switch, the stragglers'
least share of a worker and their contention (`plexrl.policy.costs.SharingCosts`);
a pool sets them from measurements of its workers, the defaults being assumptions
for a GPU (the workers' own measurements replace them as they come:
tests/test_sharing_meter.py, tests/test_live_sharing_costs.py).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from plexrl.messages import Function
from plexrl.policy import JobView, PolicyConfig
from plexrl.policy.costs import SharingCosts
from plexrl.policy.plexrl_policy import predicted_slowdown
from plexrl.policy.snapshot import CallEstimates
from plexrl.settings import SchedulerSettings
from plexrl_scheduler.main import policy_config


def settings(monkeypatch: pytest.MonkeyPatch, **env: str) -> SchedulerSettings:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return SchedulerSettings()


def test_by_default_the_policy_predicts_with_the_gpu_assumptions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = policy_config(settings(monkeypatch))
    assert config.sharing == SharingCosts() == PolicyConfig().sharing


def test_a_pool_sets_the_costs_its_workers_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    # (About the live CPU engine's figures: no engine to put to sleep, stragglers holding
    # about a fifth of the worker and decoding several times slower per step while
    # another job's calls run.)
    chosen = settings(
        monkeypatch,
        PLEXRL_SHARING_SWITCH_S="0",
        PLEXRL_SHARING_TAIL_MIN_SHARE="0.2",
        PLEXRL_SHARING_TAIL_CONTENTION="6.5",
    )
    config = policy_config(chosen)
    assert config.sharing == SharingCosts(switch_s=0.0, tail_min_share=0.2, tail_contention=6.5)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("PLEXRL_SHARING_SWITCH_S", "-1"),
        ("PLEXRL_SHARING_TAIL_MIN_SHARE", "0.95"),
        ("PLEXRL_SHARING_TAIL_MIN_SHARE", "-0.1"),
        ("PLEXRL_SHARING_TAIL_CONTENTION", "0.8"),
        ("PLEXRL_SHARING_LEARN_SAMPLES", "-1"),
    ],
)
def test_a_cost_out_of_range_is_refused_by_its_name(
    monkeypatch: pytest.MonkeyPatch, key: str, value: str
) -> None:
    with pytest.raises(ValidationError) as err:
        settings(monkeypatch, **{key: value})
    assert key.removeprefix("PLEXRL_").lower() in str(err.value)


def test_the_costs_set_move_the_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two jobs that sample and train on one worker: free sharing predicts their waits
    # alone, dearer stragglers predict more.
    def job(job_id: str) -> JobView:
        return JobView(
            job_id,
            state_bytes=10**9,
            home="w0",
            duty_cycle=0.3,
            estimates=CallEstimates(
                {Function.SAMPLE: 60.0, Function.FORWARD_BACKWARD: 30.0, Function.OPTIM_STEP: 5.0}
            ),
            tail_s=20.0,
        )

    free = policy_config(
        settings(
            monkeypatch,
            PLEXRL_SHARING_SWITCH_S="0",
            PLEXRL_SHARING_TAIL_MIN_SHARE="0",
            PLEXRL_SHARING_TAIL_CONTENTION="1",
        )
    ).sharing
    dear = policy_config(
        settings(
            monkeypatch,
            PLEXRL_SHARING_SWITCH_S="1",
            PLEXRL_SHARING_TAIL_MIN_SHARE="0.4",
            PLEXRL_SHARING_TAIL_CONTENTION="2",
        )
    ).sharing
    a, b = job("a"), job("b")
    assert predicted_slowdown(a, [b], free) < predicted_slowdown(a, [b], dear)
