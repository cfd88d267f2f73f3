"""A worker with PLEXRL_SAMPLER=sglang, through the unmodified tinker SDK against all four
services: sampling runs in SGLang (a real server on this CPU), the worker says so, and
what SGLang cannot do here is a clear 4xx."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import pytest
import tinker
from preempt_support import check_a_rollout_yields
from tinker import types

from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_worker.sglang import SGLangSampler

pytestmark = pytest.mark.integration

KEY = "tml-sglang-worker"
BASE = "plexrl/tiny-qwen3"


@pytest.fixture(scope="module")
def cluster(
    infra: dict[str, str],
    tiny_registry: Path,
    sglang_sampler: SGLangSampler,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalCluster]:
    state = tmp_path_factory.mktemp("sglang-cluster")
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        state,
        "sgl",
        api_keys=f"{KEY}=sgl",
        worker_threads=1,
        env={
            "PLEXRL_SAMPLER": "sglang",
            "PLEXRL_SGLANG_DIR": str(state / "sglang"),
            # The session's server (tests/conftest.py): a start of its own costs minutes.
            "PLEXRL_SGLANG_URL": sglang_sampler.server.url,
            # On CPU the worker would keep SGLang's memory; here it hands it to training.
            "PLEXRL_SGLANG_YIELD": "training",
        },
    )
    cluster = LocalCluster(config)
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_lora_jobs_samples_come_from_sglang_through_the_sdk(cluster: LocalCluster) -> None:
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=[6, 7, 8, 9, 10], dtype="int64")},
    )
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = client.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    out = sampler.sample(prompt, 2, greedy).result()
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert 0 < len(seq.tokens) <= 6 and len(seq.logprobs or []) == len(seq.tokens)
    assert out.sequences[0].tokens == out.sequences[1].tokens  # greedy: the same
    # The base model through SGLang too.
    base = service.create_sampling_client(base_model=BASE)
    assert base.sample(prompt, 1, greedy).result().sequences[0].tokens

    # A training call takes the device from SGLang; the next sample takes it back, and
    # what it serves has not changed (no optimizer step in between).
    released = _worker_counter(cluster, "plexrl_worker_sglang_releases_total")
    client.forward_backward([datum], "cross_entropy").result()
    assert _worker_counter(cluster, "plexrl_worker_sglang_releases_total") > released
    again = sampler.sample(prompt, 2, greedy).result()
    assert [q.tokens for q in again.sequences] == [q.tokens for q in out.sequences]
    assert [q.logprobs for q in again.sequences] == [q.logprobs for q in out.sequences]

    with httpx.Client(base_url=cluster.config.gateway_url, headers={"X-API-Key": KEY}) as http:
        workers = http.get("/plexrl/v1/workers", timeout=30).json()
    assert workers and all(w["sampler"] == "sglang" for w in workers)


def test_a_seeded_call_is_a_clear_4xx(cluster: LocalCluster) -> None:
    service = tinker.ServiceClient(base_url=cluster.config.gateway_url, api_key=KEY)
    sampler = service.create_sampling_client(base_model=BASE)
    seeded = types.SamplingParams(max_tokens=4, seed=7)
    # A user error (the SDK does not retry it), saying what to change.
    with pytest.raises(tinker.RequestFailedError, match="seed"):
        sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, seeded).result()


def test_a_long_rollout_in_sglang_yields_to_a_short_training_call(cluster: LocalCluster) -> None:
    # Greedy (SGLang takes no seed here): the same tokens paused and continued. Long
    # enough that a training call (about 0.6 s here, more on a loaded machine: it
    # releases SGLang's memory first) is under half of what is left of it when it
    # arrives: 16 x 200 tokens (about 1.9 s alone under CI's load) were too short.
    params = types.SamplingParams(max_tokens=300, temperature=0.0)
    check_a_rollout_yields(cluster.config.gateway_url, KEY, params, num_samples=16)
    assert _worker_counter(cluster, "plexrl_worker_preempted_batches_total") >= 1


def _worker_counter(cluster: LocalCluster, name: str) -> float:
    """A counter's value on worker-0's /metrics."""
    url = f"http://127.0.0.1:{cluster.config.worker_port(0)}/metrics"
    for line in httpx.get(url, timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
