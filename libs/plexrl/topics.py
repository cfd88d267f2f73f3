"""Kafka topic names and the layout created at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.messages import dispatch_topic

REQUESTS = "plexrl.requests"
COMPLETIONS = "plexrl.completions"
EVENTS = "plexrl.events"
DLQ = "plexrl.dlq"


@dataclass(frozen=True)
class TopicLayout:
    """Partition counts; more partitions let more scheduler shards and gateways read."""

    requests_partitions: int = 4
    """Keyed by job id: per-job order holds within a partition."""
    completions_partitions: int = 4
    events_partitions: int = 2
    dispatch_partitions: int = 1
    """One per worker topic: a worker runs its dispatches in order."""


def core_topics(layout: TopicLayout) -> dict[str, int]:
    """The topics every deployment has, with their partition counts."""
    return {
        REQUESTS: layout.requests_partitions,
        COMPLETIONS: layout.completions_partitions,
        EVENTS: layout.events_partitions,
        DLQ: 1,
    }


__all__ = [
    "COMPLETIONS",
    "DLQ",
    "EVENTS",
    "REQUESTS",
    "TopicLayout",
    "core_topics",
    "dispatch_topic",
]
