"""The gateway's Prometheus metrics (served on its own port at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "plexrl_gateway_requests_total", "HTTP requests answered", ["endpoint", "method", "status"]
)
LATENCY = Histogram(
    "plexrl_gateway_request_seconds",
    "Time to answer an HTTP request (retrieve_future includes its long-poll)",
    ["endpoint"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
FUTURES_WAITING = Gauge(
    "plexrl_gateway_futures_waiting", "retrieve_future calls waiting for a result right now"
)
RESULTS_DELIVERED = Counter(
    "plexrl_gateway_results_delivered_total", "Results handed to clients", ["kind", "status"]
)
TRY_AGAIN = Counter(
    "plexrl_gateway_try_again_total", "retrieve_future calls answered 'try again' (timed out)"
)
NOTICES_SWEPT = Counter(
    "plexrl_gateway_notices_swept_total",
    "Completions found in Redis by a sweep rather than announced to this gateway",
)
PUBLISH_LATENCY = Histogram(
    "plexrl_gateway_publish_seconds",
    "Time for Kafka to acknowledge one phase request",
    ["function"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
SEQUENCER_WAITING = Gauge(
    "plexrl_gateway_sequencer_waiting", "Training calls held until a lower seq_id is published"
)


def observe_request(endpoint: str, method: str, status: int, seconds: float) -> None:
    """One answered HTTP request (`plexrl.http_metrics.ObserveRequests`)."""
    REQUESTS.labels(endpoint, method, str(status)).inc()
    LATENCY.labels(endpoint).observe(seconds)
