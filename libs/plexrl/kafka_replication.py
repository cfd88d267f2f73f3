"""How the topics the services create are replicated: a rule of its own, so that the
settings can check it without importing the Kafka client."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopicReplication:
    """How the topics the services create are replicated (settings
    `PLEXRL_KAFKA_REPLICATION_FACTOR`, `PLEXRL_KAFKA_MIN_INSYNC_REPLICAS`)."""

    factor: int = 1
    """Copies of each partition, on that many brokers: 1 on one broker; 3 across hosts, so
    a broker (or its host) can be lost without losing a message."""
    min_insync: int = 1
    """Copies that must hold a message before an `acks=all` send succeeds (the topic's
    `min.insync.replicas`): 2 of 3 keeps accepting writes with one broker down, and an
    acknowledged message is on two brokers. With fewer in sync, sends fail (retried)."""

    def __post_init__(self) -> None:
        if self.factor < 1 or self.min_insync < 1:
            raise ValueError(
                f"topic replication {self.factor} and min.insync.replicas {self.min_insync} "
                "must both be at least 1"
            )
        if self.min_insync > self.factor:
            raise ValueError(
                f"min.insync.replicas {self.min_insync} is above the replication factor "
                f"{self.factor}: no send could ever succeed; lower "
                "PLEXRL_KAFKA_MIN_INSYNC_REPLICAS or raise PLEXRL_KAFKA_REPLICATION_FACTOR"
            )
