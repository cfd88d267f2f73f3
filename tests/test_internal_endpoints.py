"""Internal endpoints name no tenant's jobs: a tenant runs training, saving and sampling on
a real cluster (all four services) while every service's /metrics and /healthz are
read over and over, and none of those bodies may carry one of its ids.

Which job each worker runs is on the scheduler's /status, for the gateway alone: it needs
the cluster's service token, and the gateway shows each tenant only its own.
"""

from __future__ import annotations

import os
import threading

import httpx
import pytest
import tinker
from tinker import types

from plexrl_tools.cluster import ClusterConfig, LocalCluster

pytestmark = pytest.mark.integration

KEY = "tml-internal"


@pytest.fixture(scope="module")
def cluster(shared_services: LocalCluster) -> LocalCluster:
    return shared_services


def internal_urls(c: ClusterConfig) -> list[str]:
    ports = [c.scheduler_port, c.worker_port(0), c.state_store_port, c.gateway_port]
    return [f"http://127.0.0.1:{p}/{path}" for p in ports for path in ("metrics", "healthz")]


class Scraper:
    """Reads every internal endpoint in a loop (a Prometheus, a health checker) and keeps
    each body it got, until stopped."""

    def __init__(self, urls: list[str]) -> None:
        self._urls = urls
        self._stop = threading.Event()
        self.bodies: dict[str, list[str]] = {u: [] for u in urls}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._scrape()  # once more after the run: what the counters kept

    def _scrape(self) -> None:
        with httpx.Client(timeout=10) as http:
            for url in self._urls:
                self.bodies[url].append(http.get(url).text)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._scrape()


def run_tenant(base_url: str) -> set[str]:
    """Train a LoRA, save it, sample from it: returns every id of the tenant's it made."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
    trainer = service.create_lora_training_client(base_model="plexrl/tiny-qwen3", rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[6, 7, 8, 9], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * 4, dtype="float32"),
        },
    )
    for _ in range(2):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4)).result()
    jobs = httpx.get(f"{base_url}/plexrl/v1/jobs", headers={"X-API-Key": KEY}).json()
    session = trainer.model_id.split(":")[0]
    return {j["job_id"] for j in jobs} | {trainer.model_id, session}


def test_metrics_and_healthz_of_every_service_name_no_job_of_a_tenant(
    cluster: LocalCluster,
) -> None:
    c = cluster.config
    with Scraper(internal_urls(c)) as scraper:
        ids = run_tenant(c.gateway_url)
    assert len(ids) >= 3, ids  # the session, the model, its sampling session
    for url, bodies in scraper.bodies.items():
        assert bodies, url
        leaked = {i for i in ids for body in bodies if i in body}
        assert not leaked, (url, leaked)
    healthz = httpx.get(f"http://127.0.0.1:{c.worker_port(0)}/healthz").json()
    assert sum(healthz["resident_jobs"].values()) >= 1  # counted, not named


def test_which_job_runs_where_needs_the_service_token(cluster: LocalCluster) -> None:
    c = cluster.config
    url = f"http://127.0.0.1:{c.scheduler_port}/status"
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"authorization": "Bearer not-it"})
    assert wrong.status_code == 401 and "PLEXRL_SERVICE_TOKEN" in wrong.text
    status = httpx.get(url, headers={"authorization": f"Bearer {cluster.service_token}"})
    assert status.status_code == 200 and "inflight" in status.json()
    # The gateway holds the token: its cluster view still reaches the scheduler.
    view = httpx.get(f"{c.gateway_url}/plexrl/v1/cluster", headers={"X-API-Key": KEY}).json()
    assert view["scheduler"]["reachable"] and isinstance(view["scheduler"]["inflight"], dict)
