"""Kafka topic names and the layout created at start-up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topics:
    """A cluster's topic names; the default cluster id gives the design's names."""

    cluster_id: str = "plexrl"

    @property
    def requests(self) -> str:
        """PhaseRequest, keyed by job id: gateway → scheduler."""
        return f"{self.cluster_id}.requests"

    @property
    def completions(self) -> str:
        """PhaseCompletion, keyed by job id: worker → scheduler, gateway."""
        return f"{self.cluster_id}.completions"

    @property
    def events(self) -> str:
        """Worker and job events, keyed by worker id."""
        return f"{self.cluster_id}.events"

    @property
    def dlq(self) -> str:
        """Messages that could not be parsed or handled."""
        return f"{self.cluster_id}.dlq"

    def dispatch(self, worker_id: str) -> str:
        """Dispatch for one worker group, keyed by job id."""
        return f"{self.cluster_id}.dispatch.{worker_id}"

    def control(self, worker_id: str) -> str:
        """PreemptBatch, keyed by dispatch id: scheduler → one worker group, read beside its
        dispatches (a dispatch topic waits while the worker runs the one before)."""
        return f"{self.cluster_id}.control.{worker_id}"

    def group(self, name: str) -> str:
        """A consumer group name scoped to this cluster."""
        return f"{self.cluster_id}-{name}"


@dataclass(frozen=True)
class TopicLayout:
    """Partition counts; more partitions let more scheduler shards and gateways read."""

    requests_partitions: int = 4
    """Keyed by job id: per-job order holds within a partition."""
    completions_partitions: int = 4
    events_partitions: int = 2


def core_topics(topics: Topics, layout: TopicLayout = TopicLayout()) -> dict[str, int]:
    """The topics every deployment has, with their partition counts."""
    return {
        topics.requests: layout.requests_partitions,
        topics.completions: layout.completions_partitions,
        topics.events: layout.events_partitions,
        topics.dlq: 1,
    }
