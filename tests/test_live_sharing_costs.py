"""The costs of sharing, learned live: the worker measures what a change of job costs its
engine on its own calls and says so in its heartbeat; once the pool measured it often
enough (`PLEXRL_SHARING_LEARN_SAMPLES`, 4 here), the scheduler predicts with the
measured figure instead of its setting (the GPU assumption of 1 s by default), logs it
and shows both on its health body. Two SDK jobs take turns on one worker."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from plexrl_tools.cluster import ClusterConfig, LocalCluster
from tests.rehome_fixtures import create, scheduler_log, step

pytestmark = pytest.mark.integration

KEY = "tml-sharing-costs"
LEAST = 4


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str], tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path_factory.mktemp("sharing-costs"),
        "sc",
        workers=1,
        api_keys=f"{KEY}=t",
        worker_threads=1,
        env={"PLEXRL_SHARING_LEARN_SAMPLES": str(LEAST)},
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    with LocalCluster(config) as running:
        yield running


def health(cluster: LocalCluster) -> dict[str, Any]:
    c = cluster.config
    return httpx.get(f"{c.scheme}://{c.host}:{c.scheduler_port}/healthz", timeout=10).json()


def test_the_scheduler_predicts_with_the_switch_its_worker_measured(cluster: LocalCluster) -> None:
    before = health(cluster)["sharing"]
    assert before["predicted"] == before["set"]
    assert before["set"]["switch_s"] == 1.0  # the GPU assumption until measured
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    a, b = create(service, 1), create(service, 2)
    for _ in range(LEAST + 2):  # each job's calls after the other's: a change of job each
        step(a)
        step(b)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sharing = health(cluster)["sharing"]
        if sharing["predicted"]["switch_s"] != sharing["set"]["switch_s"]:
            break
        time.sleep(0.5)
    # A LoRA job's adapter on this CPU engine: no sleep and wake, a few ms at most.
    assert sharing["predicted"]["switch_s"] < 0.1, sharing
    # Stragglers' costs need released tails beside calls: none here, still as set.
    assert sharing["predicted"]["tail_min_share"] == sharing["set"]["tail_min_share"]
    assert any("as the workers measured them" in line for line in scheduler_log(cluster))
    # The worker's own report, and the scheduler's, as the API shows them.
    cluster_view = httpx.get(
        f"{cluster.config.gateway_url}/plexrl/v1/cluster", headers={"X-API-Key": KEY}
    ).json()
    assert cluster_view["scheduler"]["sharing"]["predicted"] == sharing["predicted"]
    (worker,) = cluster_view["workers"]
    assert worker["sharing"]["switches"] >= LEAST
