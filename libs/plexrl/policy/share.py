"""Tenants' share of a group: who goes first when several tenants' calls wait on it, how
long one tenant's Run may keep the others out, and where a new job is homed.

One engine serves every job of a group, so a tenant's calls queue behind whatever the
other tenants sent. Three rules keep that short; each applies only where jobs of more
than one tenant are homed, so a cluster of one tenant (the simulator's workloads, the
main job) is scheduled exactly as without them.

- **Order (`tenant_order`).** Of the tenants with calls ready on a free group, the one
  whose jobs there used the engine least recently (`JobView.used_s`: engine seconds,
  halved every `history.USAGE_HALF_LIFE_S`) goes first: a light tenant's call goes
  ahead of a heavy tenant's next one. Within one *turn* per tenant, though: a tenant
  that has started a Run there since another ready tenant began waiting (its oldest
  ready call arrived, or its last call ended, whichever was later) goes after it,
  whatever their use. So a tenant's call waits, before its Run starts, for at most the
  Run in progress plus one Run of each other tenant with calls ready there (the bound
  `fifo` keeps by taking tenants in turns), and a heavy tenant is never starved by a
  light one: they alternate at worst.
- **Run length (`beside_other_tenants`).** On a group where another tenant's job is
  homed and active (not dormant: its duty cycle is above 0), a Run stops after about
  `PolicyConfig.tenant_quantum_s` of expected seconds (at least one call) instead of
  the policy's quantum, so that tenant's next call waits behind about one call of this
  one: one heavy `forward_backward`, not a quantum of them.
- **Placement (`foreign_load`).** A new job is homed away from other tenants' load:
  on the group where the duty cycles of other tenants' jobs sum least, among those its
  state fits and whose planned load it keeps within `max_load` (then as the policy
  would choose). An empty group, or one holding only its own tenant's jobs, has none.

Nothing here reorders one job's calls: the policy picks a job, and a Run is a prefix of
its pending calls, in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from plexrl.policy.snapshot import ClusterSnapshot, JobView


def several_tenants(jobs: Iterable[JobView]) -> bool:
    """Whether the jobs belong to more than one tenant."""
    first: str | None = None
    for job in jobs:
        if first is None:
            first = job.tenant
        elif job.tenant != first:
            return True
    return False


@dataclass
class _Tenant:
    used_s: float = 0.0
    started: float = 0.0
    served: float = 0.0
    oldest_call: float = float("inf")

    @property
    def waiting_since(self) -> float:
        return max(self.oldest_call, self.served)


def tenant_order(snapshot: ClusterSnapshot, worker_id: str, ready: Sequence[JobView]) -> list[str]:
    """The tenants of `ready` (jobs homed on the group with calls pending), the one to
    serve first first: those still owed a turn by least recent use (ties: served longest
    ago), then those that had their turn, in the order their turns began."""
    tenants: dict[str, _Tenant] = {}
    for job in snapshot.homed_view(worker_id):
        t = tenants.get(job.tenant)
        if t is None:
            t = tenants[job.tenant] = _Tenant()
        t.used_s += job.used_s
        t.started = max(t.started, job.last_started)
        t.served = max(t.served, job.last_active)
    for job in ready:
        calls = snapshot.calls_view(job.job_id)
        t = tenants.setdefault(job.tenant, _Tenant())
        if calls:
            t.oldest_call = min(t.oldest_call, calls[0].arrival_time)
    waiting = {job.tenant for job in ready}
    # A tenant had its turn if it started after another waiting tenant began waiting:
    # after the earliest such time among the others (the earliest, or the second
    # earliest for the tenant that holds the earliest).
    since = sorted((tenants[name].waiting_since, name) for name in waiting)
    first = since[0]
    second = since[1] if len(since) > 1 else (float("inf"), "")

    def key(name: str) -> tuple[int, float, float, str]:
        t = tenants[name]
        if t.started > (second[0] if first[1] == name else first[0]):
            return (1, t.started, t.used_s, name)
        return (0, t.used_s, t.served, name)

    return sorted(waiting, key=key)


def beside_other_tenants(snapshot: ClusterSnapshot, worker_id: str, job: JobView) -> bool:
    """Whether an active job (duty cycle above 0) of another tenant is homed on the group."""
    for other in snapshot.homed_view(worker_id):
        if other.tenant != job.tenant and other.duty_cycle > 0:
            return True
    return False


def foreign_load(homed: Iterable[JobView], tenant: str) -> float:
    """The summed duty cycles of the jobs of tenants other than `tenant` among `homed`."""
    return sum(j.duty_cycle for j in homed if j.tenant != tenant)
