"""What a scheduler learns of a job from its calls (`plexrl.policy.history`)."""

from __future__ import annotations

import math
import statistics

import pytest

from plexrl.messages import Function
from plexrl.policy.history import EWMA, UNKNOWN_DUTY, CallHistory, Spread, describe, priors

F = Function


def test_running_means_duty_cycle_and_the_step_loop_come_from_calls_seen():
    h = CallHistory()
    assert h.duty_cycle(now=100.0, min_history_s=10.0) == UNKNOWN_DUTY  # no home yet
    h.homed(now=0.0)
    for function in (F.CREATE, F.SAMPLE, F.FORWARD_BACKWARD, F.FORWARD_BACKWARD, F.OPTIM_STEP):
        h.arrived(function)
    assert h.step_calls == ()  # no whole step seen yet
    h.arrived(F.SAMPLE)
    assert h.step_calls == (F.SAMPLE, F.FORWARD_BACKWARD, F.FORWARD_BACKWARD, F.OPTIM_STEP)
    h.observe(F.SAMPLE, 4.0, swap_s=1.0)
    h.observe(F.SAMPLE, 2.0)
    assert h.durations[F.SAMPLE] == pytest.approx(4.0 + EWMA * (2.0 - 4.0))
    assert h.busy_s == pytest.approx(7.0)
    assert h.duty_cycle(now=5.0, min_history_s=10.0) == UNKNOWN_DUTY
    assert h.duty_cycle(now=14.0, min_history_s=10.0) == pytest.approx(0.5)


def test_a_job_borrows_its_kinds_figures_for_what_it_has_not_shown():
    old, new = CallHistory(), CallHistory()
    old.homed(0.0)
    old.arrived(F.SAMPLE)
    old.arrived(F.FORWARD_BACKWARD)
    old.arrived(F.SAMPLE)
    old.observe(F.SAMPLE, 3.0)
    old.observe(F.FORWARD_BACKWARD, 1.0)
    new.homed(90.0)
    new.arrived(F.SAMPLE)
    new.observe(F.SAMPLE, 5.0)
    learned = priors([("7B", old), ("7B", new)], now=100.0, min_history_s=50.0)
    assert learned["7B"].duty_cycle == pytest.approx(0.04)
    seen = describe(new, learned["7B"], now=100.0, min_history_s=50.0)
    assert seen.duty_cycle == pytest.approx(0.04)
    assert seen.durations == {F.SAMPLE: 5.0, F.FORWARD_BACKWARD: 1.0}
    assert seen.step_calls == (F.SAMPLE, F.FORWARD_BACKWARD)
    # With a history of its own, its own duty cycle counts.
    assert describe(old, learned["7B"], 100.0, 50.0).duty_cycle == pytest.approx(0.04)
    assert describe(new, None, 100.0, 5.0).duty_cycle == pytest.approx(0.5)


def test_a_newcomer_is_bounded_by_its_kinds_busiest_tenth():
    histories = []
    for busy in range(1, 11):  # ten jobs of one kind, busy 1..10 s of their first 100 s
        h = CallHistory()
        h.homed(0.0)
        h.arrived(F.SAMPLE)
        h.observe(F.SAMPLE, float(busy))
        histories.append(("7B", h))
    learned = priors(histories, now=100.0, min_history_s=50.0)["7B"]
    assert learned.duty_cycle == pytest.approx(0.055)
    assert learned.duty_high == pytest.approx(0.09)  # the ninth of ten
    newcomer = CallHistory()
    newcomer.homed(90.0)
    seen = describe(newcomer, learned, now=100.0, min_history_s=50.0)
    assert (seen.duty_cycle, seen.duty_bound) == (pytest.approx(0.055), pytest.approx(0.09))
    # Its own history ends the bound; so does having no kind to borrow from.
    assert describe(histories[0][1], learned, 100.0, 50.0).duty_bound == 0.0
    assert describe(newcomer, None, 100.0, 50.0).duty_bound == 0.0


def test_a_spread_is_the_log_standard_deviation_of_what_it_saw() -> None:
    spread = Spread()
    assert spread.sigma == 0.0
    spread.add(100.0)
    assert spread.sigma == 0.0  # one duration says nothing of a spread
    spread.add(0.0)  # not a duration: ignored
    for seconds in (400.0, 200.0):
        spread.add(seconds)
    logs = [math.log(s) for s in (100.0, 400.0, 200.0)]
    assert spread.n == 3 and spread.sigma == pytest.approx(statistics.stdev(logs))
    # Scaled alike, durations spread alike.
    scaled = Spread()
    for seconds in (1.0, 4.0, 2.0):
        scaled.add(seconds)
    assert scaled.sigma == pytest.approx(spread.sigma)
