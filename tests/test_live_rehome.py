"""Re-homing live: a job placed on a newcomer's figures moves between calls once its own
are known, its new home restores it from its snapshot and logged calls, its old home
drops its copy, and it learns bit-identically to its run alone.

Two workers, three jobs of the SDK created one after another with nothing known of
them: A and B go to a worker each, C beside A (the least slowed while all three look
alike). A and C then train back to back while B stays idle: once they have the history
a review waits for (`PLEXRL_REVIEW_HISTORIES` times the 5 s a job's own figures need;
2 here), one of A and C is better beside B by its own figures, and the scheduler moves
it there (a fixed pool moves a job for a predicted gain). Every job's losses are then
compared with the same job's run alone, on the same cluster, with re-homing off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker

from plexrl_tools.cluster import LocalCluster
from tests.rehome_fixtures import alone, ran_on, rehomed, step, two_workers

pytestmark = pytest.mark.integration

KEY = "tml-rehome"


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str], tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with two_workers(
        tiny_registry,
        tmp_path_factory.mktemp("rehome"),
        "rh",
        KEY,
        # Reviewed after 10 s of history (2 x 5 s), not the default 40 s.
        {"PLEXRL_REVIEW_HISTORIES": "2"},
    ) as running:
        yield running


def test_a_newcomer_moves_once_its_figures_are_known_and_learns_as_alone(
    cluster: LocalCluster,
) -> None:
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    seeds = {"a": 1, "b": 2, "c": 3}
    clients = {
        name: service.create_lora_training_client(
            base_model="plexrl/tiny-qwen3", rank=4, seed=seed
        ).result()
        for name, seed in seeds.items()
    }
    losses: dict[str, list[float]] = {"a": [], "c": []}
    moved = threading.Event()

    def train(name: str) -> None:
        # Until a job moved and a few steps after, within bounds of count and time.
        deadline = time.monotonic() + 150.0
        after = 0
        while len(losses[name]) < 2000 and time.monotonic() < deadline and after < 5:
            losses[name].append(step(clients[name]))
            if moved.is_set():
                after += 1

    threads = [threading.Thread(target=train, args=(n,)) for n in losses]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 150.0
    while not rehomed(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    moved.set()
    for t in threads:
        t.join(timeout=180.0)
    assert rehomed(cluster), "no job was re-homed"
    # One of the busy jobs trained on one worker, then on the other.
    paths = {n: ran_on(cluster, KEY, str(clients[n].model_id)) for n in losses}
    changed = [n for n, path in paths.items() if len(set(path)) == 2]
    assert len(changed) == 1, paths
    path = paths[changed[0]]
    switch = path.index(path[-1])
    assert path == [path[0]] * switch + [path[-1]] * (len(path) - switch), path  # once
    # The old home dropped its copy; the new one restored the job.
    moved_id = str(clients[changed[0]].model_id)
    logs = {n: p.read_text(errors="replace") for n, p in cluster.logs().items()}
    old = [text for n, text in logs.items() if path[0] in n]
    new = [text for n, text in logs.items() if path[-1] in n]
    assert old and f"dropped the copy of {moved_id}" in old[0]
    assert new and f"restored {moved_id}" in new[0]
    # Every job learns as it does alone (re-homing off, one job at a time).
    cluster.kill("scheduler", graceful=True)
    cluster.restart("scheduler", env={"PLEXRL_REHOME": "false"})
    for name in losses:
        assert alone(cluster, KEY, seeds[name], len(losses[name])) == losses[name], name
