"""The gpu-worker's Prometheus metrics (served on its health port at /metrics).

One worker process is one device group, so the scrape target names the worker; the
labels say which function, status or tier. No label names a job or a tenant: whoever can
reach `/metrics` is inside the cluster but is not a tenant, and one tenant's job ids are
never shown to anyone else (per-job device time is in that tenant's `/plexrl/v1/jobs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from plexrl.messages import SharingMeasured, Tier

if TYPE_CHECKING:  # residency records its swaps here
    from plexrl_worker.residency import StateManager

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

BUSY_SECONDS = Counter(
    "plexrl_worker_busy_seconds_total",
    "Device-seconds (swap + compute) spent on calls, by function",
    ["function"],
)
CALLS = Counter(
    "plexrl_worker_calls_total", "Calls run, by function and outcome", ["function", "status"]
)
REPLAYED_CALLS = Counter(
    "plexrl_worker_replayed_calls_total",
    "Redelivered calls answered from their recorded completion instead of running again",
)
COMPUTE_SECONDS = Histogram(
    "plexrl_worker_compute_seconds",
    "Engine time of one call, swaps excluded",
    ["function"],
    buckets=_SECONDS,
)
SAMPLE_BATCH_CALLS = Histogram(
    "plexrl_worker_sample_batch_calls",
    "Sample calls run together in one co-batched group",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
TAIL_RELEASES = Counter(
    "plexrl_worker_tail_releases_total",
    "Sample batches down to their straggling tail, left to finish beside the next dispatch",
)
PREEMPTED_BATCHES = Counter(
    "plexrl_worker_preempted_batches_total",
    "Sample batches the scheduler preempted: released early and paused for one dispatch",
)
PREEMPTED_TRAINING = Counter(
    "plexrl_worker_preempted_training_total",
    "forward_backward calls the scheduler preempted: paused at a micro-batch for one dispatch",
)
SGLANG_RELEASES = Counter(
    "plexrl_worker_sglang_releases_total",
    "Times the SGLang sampler released its device memory (weights, KV cache) to training",
)
SAMPLER_SETS = Gauge(
    "plexrl_worker_sampler_sets",
    "Sampler weight sets the torch engine holds now (at most its max_samplers; the least "
    "recently sampled beyond it are dropped and reinstalled from the state-store if sampled "
    "again)",
)
SGLANG_ADAPTERS_UNLOADED = Counter(
    "plexrl_worker_sglang_adapters_unloaded_total",
    "LoRA adapters the SGLang sampler unloaded as least recently used beyond its bound",
)
SWAP_BYTES = Counter(
    "plexrl_worker_swap_bytes_total",
    "Bytes of job state moved between tiers; each move counts once out of its source "
    "tier and once into its destination",
    ["tier", "direction"],
)
SWAP_SECONDS = Histogram(
    "plexrl_worker_swap_seconds",
    "Time of one state move between tiers",
    ["from_tier", "to_tier"],
    buckets=_SECONDS,
)
RESIDENT_BYTES = Gauge(
    "plexrl_worker_resident_bytes", "Bytes of job state held in each tier", ["tier"]
)
RESIDENT_JOBS = Gauge("plexrl_worker_resident_jobs", "Jobs whose state is in each tier", ["tier"])


def watch(states: StateManager, sampler_sets: Callable[[], float]) -> None:
    """Read the residency gauges off `states` (and the count of sampler sets) at every
    scrape."""
    SAMPLER_SETS.set_function(sampler_sets)

    def bytes_in(tier: Tier) -> Callable[[], float]:
        return lambda: states.bytes_in(tier)

    def jobs_in(tier: Tier) -> Callable[[], float]:
        return lambda: sum(1 for s in states.resident() if s.tier == tier)

    for tier in Tier:
        RESIDENT_BYTES.labels(str(tier)).set_function(bytes_in(tier))
        RESIDENT_JOBS.labels(str(tier)).set_function(jobs_in(tier))


def swapped(from_tier: Tier, to_tier: Tier, nbytes: int, seconds: float) -> None:
    SWAP_BYTES.labels(str(from_tier), "out").inc(nbytes)
    SWAP_BYTES.labels(str(to_tier), "in").inc(nbytes)
    SWAP_SECONDS.labels(str(from_tier), str(to_tier)).observe(seconds)


SHARING_COST = Gauge(
    "plexrl_worker_sharing_cost",
    "What sharing costs this worker, measured on its own calls (switch_s in seconds, "
    "tail_share a fraction of the device, tail_contention a factor per decode step)",
    ["cost"],
)
SHARING_SAMPLES = Gauge(
    "plexrl_worker_sharing_samples", "Samples each measured cost of sharing rests on", ["cost"]
)


def observe_sharing(measured: SharingMeasured) -> None:
    """The meter's figures, as the heartbeat carries them."""
    for cost, value, samples in (
        ("switch_s", measured.switch_s, measured.switches),
        ("tail_share", measured.tail_share, measured.shared_calls),
        ("tail_contention", measured.tail_contention, measured.tail_steps),
    ):
        SHARING_COST.labels(cost).set(value)
        SHARING_SAMPLES.labels(cost).set(samples)
