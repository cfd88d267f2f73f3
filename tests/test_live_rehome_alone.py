"""Two jobs each alone on a worker, paired later, live: packing (`PLEXRL_PACK_GROUPS`),
every review interval the scheduler asks the policy which jobs alone another job alone
could take within the slowdown budget (`plexrl.policy.lone_pairs`) and reviews one of
each pair (`PLEXRL_REVIEW_ALONE`); it moves beside the other, its new home restores it,
and every job learns bit-identically to its run alone.

Two workers, two jobs of the SDK. A and C are created one after another and train a
few steps: A takes the first worker, C the second (beside A it would be over the
budget: a call here takes a fraction of a second against the second per engine switch
the interference model charges, `PLEXRL_SHARING_SWITCH_S`); they train on until their
reviews as newcomers have kept them there. Then C stops while A trains on: once C is
dormant (no call for `PLEXRL_DORMANT_S`, 15 s here; its duty cycle then reads 0), the
two fit on one worker, though neither was left alone by a neighbour. The next time the
scheduler asks, one of them is reviewed and moves beside the other ("reviewed:
alone"), and both train again after it. Every job's losses are then compared with the
same job's run alone, on the same cluster, with packing and re-homing off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

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

KEY = "tml-rehome-alone"
STEPS = 3
FIRST, SECOND = "worker-0", "worker-1"
DORMANT_S = 15.0


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str], tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    with two_workers(
        tiny_registry,
        tmp_path_factory.mktemp("rehome-alone"),
        "rl",
        KEY,
        # Packing; newcomers reviewed after 5 s of history, and the jobs alone asked
        # about every 5 s (1 x 5 s); a silent job dormant after 15 s.
        {
            "PLEXRL_PACK_GROUPS": "true",
            "PLEXRL_REVIEW_HISTORIES": "1",
            "PLEXRL_DORMANT_S": str(DORMANT_S),
            "PLEXRL_SHARING_LEARN_SAMPLES": "0",
        },
    ) as running:
        yield running


def test_two_jobs_alone_that_fit_together_are_paired(cluster: LocalCluster) -> None:
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    seeds = {"a": 1, "c": 3}
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
    # Both train on until each has been reviewed as a newcomer and kept where it is.
    kept_apart(cluster, ids, losses, train, {"a": FIRST, "c": SECOND})
    assert not rehomed(cluster)

    # C stops; A trains on, alone on its worker, a step every quarter second, until one
    # of the two moved (C dormant after 15 s, then the next ask; bounded in steps and
    # time).
    deadline = time.monotonic() + DORMANT_S + 45.0
    while not rehomed(cluster) and time.monotonic() < deadline and len(losses["a"]) < 600:
        train("a", 1)
        time.sleep(0.25)
    moves = rehomed(cluster)
    assert len(moves) == 1 and "(reviewed: alone)" in moves[0], moves
    moved = next(n for n in ("a", "c") if ids[n] in moves[0])
    other = "c" if moved == "a" else "a"
    home = {"a": FIRST, "c": SECOND}
    assert f"from {home[moved]} to {home[other]}" in moves[0], moves
    # Both train again, side by side on the one worker; no second move.
    train("a", STEPS)
    train("c", STEPS)
    assert len(rehomed(cluster)) == 1, rehomed(cluster)
    path = ran_on(cluster, KEY, ids[moved])
    assert path[-STEPS:] == [home[other]] * STEPS and path[0] == home[moved], path
    logs = {n: p.read_text(errors="replace") for n, p in cluster.logs().items()}
    assert f"dropped the copy of {ids[moved]}" in logs[home[moved]]
    assert f"restored {ids[moved]}" in logs[home[other]]

    # Every job learns as it does alone.
    cluster.kill("scheduler", graceful=True)
    cluster.restart("scheduler", env={"PLEXRL_PACK_GROUPS": "false", "PLEXRL_REHOME": "false"})
    for name, seed in seeds.items():
        assert alone(cluster, KEY, seed, len(losses[name])) == losses[name], name
