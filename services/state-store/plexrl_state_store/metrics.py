"""The state-store's Prometheus metrics (served by its own app at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

BLOB_WRITTEN_BYTES = Counter(
    "plexrl_state_store_blob_written_bytes_total",
    "Bytes of blobs stored (checkpoints and states offloaded to the disk tier)",
)
BLOB_READ_BYTES = Counter(
    "plexrl_state_store_blob_read_bytes_total",
    "Bytes of blobs read back (checkpoint loads, states onloaded from the disk tier)",
)
BLOBS_DELETED = Counter("plexrl_state_store_blobs_deleted_total", "Blobs deleted")
CHECKPOINTS_RECORDED = Counter(
    "plexrl_state_store_checkpoints_recorded_total", "Checkpoint records written"
)
FENCED_WRITES = Counter(
    "plexrl_state_store_fenced_writes_total",
    "Blob writes, checkpoint records and deletes refused because the writing call's "
    "lease no longer stood (its job was re-homed)",
)
DISK_FULL = Counter(
    "plexrl_state_store_disk_full_total", "Blob writes refused because the disk was full"
)
REQUESTS = Counter(
    "plexrl_state_store_requests_total",
    "HTTP requests answered",
    ["endpoint", "method", "status"],
)
LATENCY = Histogram(
    "plexrl_state_store_request_seconds",
    "Time to answer an HTTP request (blob transfers included)",
    ["endpoint", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def observe_request(endpoint: str, method: str, status: int, seconds: float) -> None:
    """One answered HTTP request (`plexrl.http_metrics.ObserveRequests`)."""
    REQUESTS.labels(endpoint, method, str(status)).inc()
    LATENCY.labels(endpoint, method).observe(seconds)
