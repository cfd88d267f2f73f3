"""Co-sampling: a Run of sample calls takes along the pending sample calls of other jobs
on the same group, so the worker decodes them in one batch (`cobatch` in the gpu-worker).

A job's samples come out the same alone or co-batched, so this changes when calls
finish, never what they return. Only jobs that need no swap join: homed on the Run's
group, over the same base model, with their state on the device already (or none to
move) and not moved by the same plan (re-homed, or evicted by a Run), and only the
leading sample calls of each, so every job's calls still run in its own order. It
applies to any policy's plan, after the policy decided.
"""

from __future__ import annotations

from dataclasses import replace

from plexrl.messages import Function, Tier
from plexrl.policy.actions import Action, Plan, Rehome, Run
from plexrl.policy.snapshot import ClusterSnapshot, JobView

_SAMPLE = Function.SAMPLE


def co_sample(snapshot: ClusterSnapshot, plan: Plan, max_calls: int) -> Plan:
    """`plan` with each all-sample Run extended by other jobs' joinable sample calls, up
    to `max_calls` calls in the Run (oldest first)."""
    if max_calls <= 0:
        return plan
    out: list[Action] | None = None
    kept_out: set[str] | None = None
    for i, action in enumerate(plan):
        if not isinstance(action, Run) or not _all_samples(snapshot, action):
            continue
        if kept_out is None:
            kept_out = _kept_out(plan)
        extended = _extended(snapshot, action, kept_out, max_calls)
        if extended is not action:
            if out is None:
                out = list(plan)
            out[i] = extended
    return plan if out is None else tuple(out)


def _kept_out(plan: Plan) -> set[str]:
    """Jobs that may not join a Run of the plan: those it runs (each in its own Run),
    moves to another group or evicts off a device."""
    out: set[str] = set()
    for action in plan:
        if isinstance(action, Run):
            out.add(action.job_id)
            out.update(m.job_id for m in action.evict)
        elif isinstance(action, Rehome) and action.moves:
            out.add(action.job_id)
    return out


def _all_samples(snapshot: ClusterSnapshot, run: Run) -> bool:
    # A Run is a prefix of its job's pending calls (the policies' `run_of`).
    ids = run.request_ids
    calls = snapshot.calls_view(run.job_id)
    if not ids or len(ids) > len(calls):
        return False
    for rid, call in zip(ids, calls, strict=False):
        if call.request_id != rid or call.function != _SAMPLE:
            return False
    return True


def _extended(snapshot: ClusterSnapshot, run: Run, kept_out: set[str], max_calls: int) -> Run:
    own = snapshot.jobs.get(run.job_id)
    if own is None:
        return run
    joiners = []
    for job in snapshot.homed_view(run.worker_id):
        if job.job_id in kept_out or not _joinable(job, own):
            continue
        for call in snapshot.calls_view(job.job_id):
            if call.function != _SAMPLE:
                break  # later calls of the job wait for this one: keep its order
            joiners.append(call)
    joiners.sort(key=lambda c: (c.arrival_time, c.request_id))
    room = max(0, max_calls - len(run.request_ids))
    extra = tuple(c.request_id for c in joiners[:room])
    return replace(run, request_ids=run.request_ids + extra) if extra else run


def _joinable(job: JobView, own: JobView) -> bool:
    return job.base_model == own.base_model and (job.tier == Tier.DEVICE or job.state_bytes == 0)
