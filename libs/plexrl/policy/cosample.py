"""Co-sampling: a Run of sample calls takes along the pending sample calls of other jobs
on the same group, so the worker decodes them in one batch (`cobatch` in the gpu-worker).

A job's samples come out the same alone or co-batched, so this changes when calls
finish, never what they return. Only jobs that need no swap join: homed on the Run's
group, over the same base model, with their state on the device already (or none to
move), and only the leading sample calls of each, so every job's calls still run in its
own order. It applies to any policy's plan, after the policy decided.
"""

from __future__ import annotations

from dataclasses import replace

from plexrl.messages import Function, Tier
from plexrl.policy.actions import Plan, Run
from plexrl.policy.snapshot import ClusterSnapshot, JobView


def co_sample(snapshot: ClusterSnapshot, plan: Plan, max_calls: int) -> Plan:
    """`plan` with each all-sample Run extended by other jobs' joinable sample calls, up
    to `max_calls` calls in the Run (oldest first)."""
    running = {a.job_id for a in plan if isinstance(a, Run)}
    out = []
    for action in plan:
        if isinstance(action, Run) and _all_samples(snapshot, action):
            action = _extended(snapshot, action, running, max_calls)
        out.append(action)
    return tuple(out)


def _all_samples(snapshot: ClusterSnapshot, run: Run) -> bool:
    functions = {c.request_id: c.function for c in snapshot.calls_of(run.job_id)}
    return bool(run.request_ids) and all(
        functions.get(rid) == Function.SAMPLE for rid in run.request_ids
    )


def _extended(snapshot: ClusterSnapshot, run: Run, running: set[str], max_calls: int) -> Run:
    own = snapshot.jobs.get(run.job_id)
    if own is None:
        return run
    joiners = []
    for job in snapshot.homed(run.worker_id):
        if job.job_id in running or not _joinable(job, own):
            continue
        for call in snapshot.calls_of(job.job_id):
            if call.function != Function.SAMPLE:
                break  # later calls of the job wait for this one: keep its order
            joiners.append(call)
    joiners.sort(key=lambda c: (c.arrival_time, c.request_id))
    room = max(0, max_calls - len(run.request_ids))
    extra = tuple(c.request_id for c in joiners[:room])
    return replace(run, request_ids=run.request_ids + extra) if extra else run


def _joinable(job: JobView, own: JobView) -> bool:
    return job.base_model == own.base_model and (job.tier == Tier.DEVICE or job.state_bytes == 0)
