"""Re-homing a job left alone, live: packing (`PLEXRL_PACK_GROUPS`), a job whose last
neighbour leaves its worker is reviewed again and joins a job alone on the other worker,
where both stay within the slowdown budget, and its own worker is freed; its new home
restores it from its snapshot and logged calls, its old home drops its copy, and it
learns bit-identically to its run alone.

Two workers, three jobs of the SDK. A and C are created one after another and train a
few steps: A takes the first worker, C the second (beside A it would be over the
budget); they train on until their reviews as newcomers have kept them there (each
alone on its worker holds a direct lease, which the scheduler takes back for the
review). Then both stop. A call here takes a fraction of a second against the second
per engine switch the interference model charges by default
(`PLEXRL_SHARING_SWITCH_S`), so two jobs are within the 5 % budget together only where
one of them has stopped: dormant, no call for `PLEXRL_DORMANT_S` (15 s here; its duty
cycle then reads 0), which the test waits out. Once A and C are dormant, B is created
and joins A (the first of two equal groups), trains, and is unloaded. A, left alone,
trains again: reviewed, it joins C, still dormant, and the first worker is freed.
Every job's losses are then compared with the same job's run alone, on the same
cluster, with packing and re-homing off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker

from plexrl_tools.cluster import LocalCluster
from tests.rehome_fixtures import (
    alone,
    create,
    homes,
    kept_apart,
    ran_on,
    rehomed,
    step,
    two_workers,
)

pytestmark = pytest.mark.integration

KEY = "tml-rehome-lone"
STEPS = 3
"""Steps each job trains in each of its turns."""
FIRST, SECOND = "worker-0", "worker-1"
DORMANT_S = 15.0
"""How long a silent job takes to turn dormant (`PLEXRL_DORMANT_S`): longer than the
newcomers' reviews take (5 s of history)."""


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str], tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with two_workers(
        tiny_registry,
        tmp_path_factory.mktemp("rehome-lone"),
        "rl",
        KEY,
        # Packing: in a fixed pool a job left alone stays where it is. Newcomers are
        # reviewed after 5 s of history (1 x 5 s), not 40 s; a silent job is dormant
        # after 15 s, not 60 s.
        {
            "PLEXRL_PACK_GROUPS": "true",
            "PLEXRL_REVIEW_HISTORIES": "1",
            "PLEXRL_DORMANT_S": str(DORMANT_S),
            # The premise above: the switch as set, not as the worker measures it.
            "PLEXRL_SHARING_LEARN_SAMPLES": "0",
            # The path under test is the one a neighbour's leaving opens: the jobs alone
            # are not asked about between times (test_live_rehome_alone.py).
            "PLEXRL_REVIEW_ALONE": "false",
        },
    ) as running:
        yield running


def unload(cluster: LocalCluster, model_id: str) -> None:
    """Unload the model through the API and wait until the scheduler has seen it go."""
    with httpx.Client(
        base_url=cluster.config.gateway_url,
        headers={"X-API-Key": KEY, "Accept": "application/json"},
        timeout=60.0,
    ) as http:
        sent = http.post("/api/v1/unload_model", json={"model_id": model_id})
        assert sent.status_code == 200, sent.text
        future = {"request_id": sent.json()["request_id"]}
        for _ in range(3):  # each poll waits up to 25 s for the result
            done = http.post("/api/v1/retrieve_future", json=future)
            if done.status_code != 408:
                break
        assert done.status_code == 200 and done.json()["type"] == "unload_model", done.text


def test_a_job_left_alone_joins_a_job_alone_and_learns_as_alone(cluster: LocalCluster) -> None:
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    seeds = {"a": 1, "b": 2, "c": 3}
    clients: dict[str, tinker.TrainingClient] = {}
    losses: dict[str, list[float]] = {name: [] for name in seeds}
    ids: dict[str, str] = {}

    def train(name: str, steps: int) -> None:
        losses[name] += [step(clients[name]) for _ in range(steps)]

    for name in ("a", "c"):  # one after another: C's admission sees A
        clients[name] = create(service, seeds[name])
        ids[name] = str(clients[name].model_id)
        train(name, STEPS)
    assert [homes(cluster).get(ids[n]) for n in ("a", "c")] == [FIRST, SECOND]
    # Both train on until each has been reviewed as a newcomer, active, and kept where
    # it is (together they would be over the budget): the move below is then the
    # review of a job left alone, not a newcomer's first.
    kept_apart(cluster, ids, losses, train, {"a": FIRST, "c": SECOND})
    # Both stop until they are dormant (and a margin for their last calls' completions
    # to reach the scheduler). B then finds two equal groups, each within the budget.
    time.sleep(DORMANT_S + 4.0)
    before = len(losses["a"])  # A's steps before B came and left

    clients["b"] = create(service, seeds["b"])
    ids["b"] = str(clients["b"].model_id)
    train("b", STEPS)
    assert homes(cluster)[ids["b"]] == FIRST, homes(cluster)
    assert not rehomed(cluster)
    unload(cluster, ids["b"])

    # A, left alone, trains again: until it moved and a few steps after, within bounds.
    deadline = time.monotonic() + 60.0
    after = 0
    while len(losses["a"]) < 100 and time.monotonic() < deadline and after < STEPS:
        train("a", 1)
        if rehomed(cluster):
            after += 1
    moves = rehomed(cluster)
    moved = f"re-homed {ids['a']} from {FIRST} to {SECOND} (reviewed: left alone)"
    assert len(moves) == 1 and moved in moves[0], moves
    # A trained on the first worker, then, once B had left, on the second; B and C
    # never moved.
    path = ran_on(cluster, KEY, ids["a"])
    assert SECOND in path, path
    switch = path.index(SECOND)
    assert switch >= before and path == [FIRST] * switch + [SECOND] * (len(path) - switch), path
    assert ran_on(cluster, KEY, ids["b"]) == [FIRST] * STEPS
    assert ran_on(cluster, KEY, ids["c"]) == [SECOND] * len(losses["c"])
    # The old home dropped its copy; the new one restored the job.
    logs = {n: p.read_text(errors="replace") for n, p in cluster.logs().items()}
    assert f"dropped the copy of {ids['a']}" in logs[FIRST]
    assert f"restored {ids['a']}" in logs[SECOND]

    # Every job learns as it does alone: one job at a time, no re-homing, in a fixed
    # pool (packing would keep the second of these runs waiting for a group: the jobs
    # on both workers, restored or just run, are not dormant).
    cluster.kill("scheduler", graceful=True)
    cluster.restart("scheduler", env={"PLEXRL_PACK_GROUPS": "false", "PLEXRL_REHOME": "false"})
    for name, seed in seeds.items():
        assert alone(cluster, KEY, seed, len(losses[name])) == losses[name], name
