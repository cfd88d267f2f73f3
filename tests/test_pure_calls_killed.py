"""Pure calls under a worker kill, through the tinker SDK on the shared cluster.

A dispatch of sample calls reads nothing before it runs: a call redelivered after its
worker died runs again, and the first record made of it answers it (docs/reliability.md,
"Unnumbered calls"). So a batch of seeded samples cut by a SIGKILL of its worker, and
restarted, answers every call, each with the tokens of an undisturbed run."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import tinker
from tinker import types

from plexrl_tools.cluster import LocalCluster

pytestmark = pytest.mark.integration

KEY = "tml-pure-kill"
BASE = "plexrl/tiny-qwen3"
CALLS = 48
START_TIMEOUT_S = 600.0


def sampled(sampler: Any) -> list[list[list[int]]]:
    """Every call's sequences, sent all at once and read in order."""
    futures = [
        sampler.sample(
            types.ModelInput.from_ints([5, 6, 7 + i % 5]),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=48, seed=100 + i, temperature=1.0),
        )
        for i in range(CALLS)
    ]
    return [[list(s.tokens) for s in f.result(timeout=600).sequences] for f in futures]


def test_seeded_samples_cut_by_a_worker_kill_answer_as_undisturbed(
    shared_services: LocalCluster,
) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    service = tinker.ServiceClient(base_url=shared_services.config.gateway_url, api_key=KEY)
    sampler = service.create_sampling_client(base_model=BASE)
    started = time.monotonic()
    expected = sampled(sampler)
    undisturbed_s = time.monotonic() - started
    (victim,) = [n for n in shared_services.names() if n.startswith("worker")]
    killed_at: list[float] = []

    def kill_and_restart() -> None:
        time.sleep(min(0.5, undisturbed_s / 8))  # inside the batch
        shared_services.kill(victim)
        killed_at.append(time.monotonic())
        shared_services.restart(victim, START_TIMEOUT_S)

    killer = threading.Thread(target=kill_and_restart)
    killer.start()
    try:
        got = sampled(sampler)
        answered_at = time.monotonic()
    finally:
        killer.join()
    assert killed_at and killed_at[0] < answered_at, "the kill fell after the batch"
    assert not shared_services.exited(victim)
    assert got == expected
