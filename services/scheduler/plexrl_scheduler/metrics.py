"""The scheduler's Prometheus metrics (served on its health port at /metrics).

Counters move where the decision is carried out (the Actuator, the Receiver); the
gauges are read off ClusterState once per loop turn by `observe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress

from prometheus_client import Counter, Gauge, Histogram

from plexrl.policy.costs import SharingCosts
from plexrl_scheduler.state import ClusterState

QUEUE_DEPTH = Gauge(
    "plexrl_scheduler_queue_depth", "Calls received and not yet dispatched to a worker"
)
INFLIGHT = Gauge("plexrl_scheduler_inflight_dispatches", "Dispatches a worker is running now")
JOBS = Gauge("plexrl_scheduler_jobs", "Jobs the scheduler knows (admitted or waiting)")
WORKERS_HEALTHY = Gauge(
    "plexrl_scheduler_workers_healthy", "Workers whose last heartbeat is recent enough"
)
DISPATCHES = Counter(
    "plexrl_scheduler_dispatches_total", "Dispatches (runs of calls) sent, by worker", ["worker"]
)
DISPATCHED_CALLS = Counter(
    "plexrl_scheduler_dispatched_calls_total", "Calls sent to workers, by function", ["function"]
)
PREFETCHES = Counter(
    "plexrl_scheduler_prefetches_total", "Prefetch dispatches sent, by worker", ["worker"]
)
TAIL_RELEASES = Counter(
    "plexrl_scheduler_tail_releases_total",
    "Dispatches a worker released beside their running sample batch (the worker freed "
    "for the next), by why: at the batch's tail, or preempted",
    ["worker", "reason"],
)
PREEMPTS = Counter(
    "plexrl_scheduler_preempts_total",
    "Preempts sent: a running sample batch asked to let a waiting job's calls in",
    ["worker"],
)
ROAMED_CALLS = Counter(
    "plexrl_scheduler_roamed_calls_total",
    "Sample calls on saved sampler weights sent to a worker other than their job's home "
    "(plexrl policy, PLEXRL_ROAM_SAMPLES), by that worker",
    ["worker"],
)
REHOMES = Counter(
    "plexrl_scheduler_rehomes_total",
    "Jobs moved to another worker on a review of their home (plexrl policy, "
    "PLEXRL_REHOME), by the worker they left and why they were reviewed: newcomer "
    "(their own figures now known), left alone (their last neighbour gone) or alone "
    "(another job alone could take it)",
    ["worker", "why"],
)
HOLDING_PASSES = Counter(
    "plexrl_scheduler_holding_passes_total",
    "Decision passes that held a free worker for a bursting job's next call "
    "(PLEXRL_HOLD_S; plexrl policy)",
)
EVICTIONS = Counter(
    "plexrl_scheduler_evictions_total",
    "State moves off the device tier the scheduler ordered, by target tier",
    ["tier"],
)
DISPATCH_LATENCY = Histogram(
    "plexrl_scheduler_dispatch_latency_seconds",
    "From a call's arrival at the gateway to its dispatch to a worker (queueing)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
JOBS_ADMITTED = Counter(
    "plexrl_scheduler_jobs_admitted_total", "Jobs given a home worker group", ["worker"]
)
JOBS_REJECTED = Counter(
    "plexrl_scheduler_jobs_rejected_total", "Jobs refused, by reason", ["reason"]
)
JOBS_FINISHED = Counter(
    "plexrl_scheduler_jobs_finished_total", "Jobs unloaded (their state released)"
)
CALLS_FAILED = Counter(
    "plexrl_scheduler_calls_failed_total",
    "Calls answered with an error without running (rejected, unknown job), by code",
    ["code"],
)

DIRECT_LEASES = Counter(
    "plexrl_scheduler_direct_leases_total",
    "Direct leases granted (a job's calls sent straight to its worker by the gateways)",
    ["worker"],
)
DIRECT_REVOKES = Counter(
    "plexrl_scheduler_direct_revokes_total",
    "Direct leases ended, by why: wanted (another call waits for the worker), acting "
    "(the scheduler acts on the worker), lapsed, idle, gone (the job left its home), "
    "lost (the worker died), restart (found by a restarted scheduler)",
    ["reason"],
)
DIRECT_CALLS = Counter(
    "plexrl_scheduler_direct_calls_total",
    "Completions of calls sent straight to a worker under a direct lease, by function",
    ["function"],
)
DIRECT_REQUEUED = Counter(
    "plexrl_scheduler_direct_requeued_total",
    "Calls handed out under a direct lease that the scheduler dispatched itself (their "
    "worker died, or reported idle past the grace with them unanswered)",
)
FOLLOW_UPS = Counter(
    "plexrl_scheduler_follow_ups_total",
    "Dispatches sent to a worker behind its dispatch in flight (the same job's next calls, "
    "no other job waiting there), by worker",
    ["worker"],
)
HELD = Gauge("plexrl_scheduler_direct_held_workers", "Workers a direct lease holds now")
SHARING_COSTS = Gauge(
    "plexrl_scheduler_sharing_cost",
    "The costs of sharing the policy predicts with (switch_s in seconds, tail_min_share "
    "a fraction of a worker, tail_contention a factor), as set or as the workers measured",
    ["cost"],
)
WORKER_SHARING_COSTS = Gauge(
    "plexrl_scheduler_worker_sharing_cost",
    "The costs of sharing the policy predicts a worker's group with, where its own "
    "measurements stand apart from the pool's (the others: plexrl_scheduler_sharing_cost)",
    ["worker", "cost"],
)


def observe(state: ClusterState) -> None:
    """Set the gauges from the cluster view (the scheduler loop's record step)."""
    QUEUE_DEPTH.set(len(state.pending))
    INFLIGHT.set(len(state.inflight))
    JOBS.set(len(state.jobs))
    HELD.set(len(state.held))
    WORKERS_HEALTHY.set(sum(1 for w in state.workers if state.healthy(w)))


_own_costs_shown: set[str] = set()
"""The workers `WORKER_SHARING_COSTS` has series for."""


def observe_costs(sharing: SharingCosts, workers: Mapping[str, SharingCosts]) -> None:
    """The costs of sharing the policy predicts with now: the pool's, and by worker
    those of the groups predicted with their own."""
    _set_costs(SHARING_COSTS, sharing)
    for worker_id, own in workers.items():
        _set_costs(WORKER_SHARING_COSTS, own, worker_id)
    # A worker back on the pool's figures, or gone, loses its series; the others are
    # set in place, never cleared first: /metrics is read on another thread, and a
    # scrape between a clear and the sets would see a worker's series missing.
    for worker_id in _own_costs_shown - workers.keys():
        for name in SharingCosts().figures():
            with suppress(KeyError):  # (a registry cleared under it, as tests do)
                WORKER_SHARING_COSTS.remove(worker_id, name)
    _own_costs_shown.clear()
    _own_costs_shown.update(workers)


def _set_costs(gauge: Gauge, costs: SharingCosts, *labels: str) -> None:
    for name, value in costs.figures().items():
        gauge.labels(*labels, name).set(value)
