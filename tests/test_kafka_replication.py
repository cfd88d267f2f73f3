"""Topic replication is a setting: the services create their topics with the factor and
`min.insync.replicas` they are given, and a factor the brokers cannot hold is refused
with a message that names the setting (the three-broker case runs on the host bed,
tests/test_hosts.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from plexrl.kafka import TopicReplication, ensure_topics
from plexrl.settings import CommonSettings


def test_min_insync_above_the_factor_is_refused_naming_the_settings() -> None:
    with pytest.raises(ValueError, match="PLEXRL_KAFKA_MIN_INSYNC_REPLICAS"):
        TopicReplication(factor=1, min_insync=2)
    with pytest.raises(ValueError, match="above the replication factor 2"):
        CommonSettings(kafka_replication_factor=2, kafka_min_insync_replicas=3)


def test_settings_default_to_one_copy_and_read_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert CommonSettings().topic_replication() == TopicReplication(1, 1)
    monkeypatch.setenv("PLEXRL_KAFKA_REPLICATION_FACTOR", "3")
    monkeypatch.setenv("PLEXRL_KAFKA_MIN_INSYNC_REPLICAS", "2")
    assert CommonSettings().topic_replication() == TopicReplication(3, 2)


async def _min_insync(bootstrap: str, topic: str) -> str:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, configs={"min.insync.replicas": None})]
        )
    finally:
        await admin.close()
    resources: list[Any] = responses[0].resources
    entries = resources[0][4]
    return str(dict((e[0], e[1]) for e in entries)["min.insync.replicas"])


@pytest.mark.integration
async def test_topics_are_created_with_the_min_insync_replicas_given(
    infra: dict[str, str],
) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.replicated"
    await ensure_topics(infra["kafka"], {topic: 1}, TopicReplication(1, 1))
    assert await _min_insync(infra["kafka"], topic) == "1"


@pytest.mark.integration
async def test_a_factor_above_the_brokers_is_refused_naming_the_setting(
    infra: dict[str, str],
) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.too-many"
    with pytest.raises(RuntimeError, match="PLEXRL_KAFKA_REPLICATION_FACTOR") as refused:
        await ensure_topics(infra["kafka"], {topic: 1}, TopicReplication(3, 2))
    assert "1 brokers" in str(refused.value)
