"""How densely the own policy is expected to pack each job, known before anything runs:
for a shared cluster's layout sized by the expected packing (`partition: packed`).

The layout of a shared cluster fixes how many groups each model size gets. Sized by
the group time the jobs' calls hold (`shared`), it would be right if every size packed
as densely as its idle time allows; sized by whole runs (`dedicated`), if every size
packed alike. Within a slowdown budget the packing is what the interference prediction
admits, so this sizes each job's need by its run alone over the jobs a group is
predicted to hold within the budget: copies of the job itself, the prediction the
policy's admission makes (`plexrl.policy.plexrl_policy.predicted_slowdown`, with the
costs of sharing the executor charges). Each job's figures are its step model's means,
the view the live scheduler would have of it once it has a history.
"""

from __future__ import annotations

from collections.abc import Callable

from plexrl.messages import Function
from plexrl.policy.costs import SharingCosts
from plexrl.policy.plexrl_policy import predicted_slowdown
from plexrl.policy.snapshot import CallEstimates, JobView
from plexrl_sim.dedicated import alone_reference_s
from plexrl_sim.workload import JobFactory, JobSpec, Steps

MOST_PER_GROUP = 8
"""The densest packing considered (the prediction's own bound is the budget)."""


def expected_view(job: JobSpec, steps: Steps, alone_s: float) -> JobView:
    """The job as the scheduler would see it with a history: each call's mean seconds,
    its calls per step, its duty cycle over its step alone (`alone_s`, its whole run
    alone), its stragglers' and its stalls' mean seconds, its loop."""
    fb_calls = max(steps.fb_calls, 1)
    seconds = {
        Function.SAMPLE: float(steps.dense_s.mean()),
        Function.FORWARD_BACKWARD: float(steps.fb_s.mean()) / fb_calls,
        Function.OPTIM_STEP: steps.optim_s,
    }
    calls = [Function.SAMPLE, *([Function.FORWARD_BACKWARD] * fb_calls), Function.OPTIM_STEP]
    if steps.save_s > 0:
        seconds[Function.SAVE] = steps.save_s
        calls.append(Function.SAVE)
    busy = float(steps.exclusive_s.mean())
    step_alone = alone_s / max(steps.n, 1)
    return JobView(
        job_id=job.job_id,
        state_bytes=0,
        estimates=CallEstimates(seconds),
        duty_cycle=min(1.0, busy / step_alone) if step_alone > 0 else 1.0,
        step_calls=tuple(calls),
        tail_s=float(steps.tail_s.mean()),
        stall_s=float(steps.reward_s.mean()),
        staleness=steps.staleness,
    )


def jobs_per_group(view: JobView, costs: SharingCosts, budget: float) -> int:
    """How many copies of the job one group holds with each predicted within `budget`
    (at least one: a job alone is never refused a group)."""
    n = 1
    while n < MOST_PER_GROUP and predicted_slowdown(view, [view] * n, costs) <= budget:
        n += 1
    return n


def expected_packing(
    factory: JobFactory, costs: SharingCosts, budget: float
) -> Callable[[JobSpec], float]:
    """Each job's expected jobs per group (`jobs_per_group` of its `expected_view`)."""

    def per_group(job: JobSpec) -> float:
        steps = factory.steps(job)
        view = expected_view(job, steps, alone_reference_s(factory, job, costs))
        return float(jobs_per_group(view, costs, budget))

    return per_group
