"""The web dashboard: its routes on the real gateway app, and the page in a real headless
Chromium drawing the timeline of a real small run over all four services."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import tinker
from gateway_support import FakePublisher, drop_cluster_keys, unique_cluster
from tinker import types

from plexrl.settings import GatewaySettings
from plexrl.stores import Stores, TimelineEntry
from plexrl_gateway.app import build_app
from plexrl_gateway.components import Gateway
from plexrl_tools.cluster import ClusterConfig, LocalCluster
from tests.conftest import ROOT

KEY = "tml-dash"
ALICE = {"X-API-Key": "tml-alice"}
BASE = "plexrl/tiny-qwen3"
ARTIFACTS = ROOT / ".plexrl" / "artifacts"
STEPS = 4
"""Training steps of each job in the small run."""


# The routes, on the real app with real Redis (only Kafka is faked) -----------------------


@pytest_asyncio.fixture
async def api(
    infra: dict[str, str], tiny_registry: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Stores]]:
    settings = GatewaySettings(
        cluster_id=unique_cluster("dash"),
        kafka_bootstrap=infra["kafka"],
        redis_url=infra["redis"],
        api_keys="tml-alice=alice,tml-bob=bob",
        model_registry=tiny_registry,
        scheduler_url="http://127.0.0.1:9",
        state_store_url="http://127.0.0.1:9",
    )
    stores = Stores.from_url(settings.redis_url, settings.cluster_id, settings.record_ttl_s)
    gateway = Gateway.build(settings, stores, FakePublisher())
    transport = httpx.ASGITransport(app=build_app(gateway))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http, stores
    finally:
        await gateway.close()
        await drop_cluster_keys(stores, settings.cluster_id)
        await stores.close()


async def test_root_redirects_to_the_dashboard(api: tuple[httpx.AsyncClient, Stores]) -> None:
    http, _ = api
    response = await http.get("/")
    assert response.status_code == 307 and response.headers["location"] == "/dashboard"


async def test_the_page_loads_only_from_the_gateway(
    api: tuple[httpx.AsyncClient, Stores],
) -> None:
    http, _ = api
    page = await http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/dashboard.js"' in page.text
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        asset = await http.get(f"/dashboard/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        # No CDN: the only absolute URL in the bundle is the SVG namespace.
        assert asset.text.replace("http://www.w3.org/2000/svg", "").count("://") == 0
    missing = await http.get("/dashboard/secrets.txt")
    assert missing.status_code == 404 and "/dashboard" in missing.json()["error"]


async def create_model(http: httpx.AsyncClient) -> str:
    body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}
    session = (await http.post("/api/v1/create_session", json=body, headers=ALICE)).json()
    model = {
        "session_id": session["session_id"],
        "model_seq_id": 0,
        "base_model": BASE,
        "lora_config": {"rank": 8, "train_unembed": True},
        "type": "create_model",
    }
    response = await http.post("/api/v1/create_model", json=model, headers=ALICE)
    assert response.status_code == 200, response.text
    return str(response.json()["model_id"])


async def test_job_details_carry_residency_accounting_and_recent_activity(
    api: tuple[httpx.AsyncClient, Stores],
) -> None:
    http, stores = api
    busy, quiet = await create_model(http), await create_model(http)
    t = time.time() - 30
    # busy: forward_backward + optim_step three times, 10 s apart; the first swapped in.
    for i in range(3):
        for function, offset in (("forward_backward", 0.0), ("optim_step", 1.0)):
            await stores.timeline.append_timeline(
                TimelineEntry(
                    worker_id="worker-0",
                    job_id=busy,
                    request_id=f"r{i}-{function}",
                    function=function,
                    started_at=t + 10 * i + offset,
                    swap_s=0.25 if i == 0 and offset == 0 else 0.0,
                    compute_s=0.5,
                    ok=True,
                )
            )
    await stores.usage.add_usage(busy, {"calls": 6.0, "device_s": 3.25})
    await stores.usage.mark_active(busy, t)
    await stores.usage.mark_active(busy, t + 21.5)

    response = await http.get("/plexrl/v1/jobs", params={"details": "true"}, headers=ALICE)
    assert response.status_code == 200, response.text
    by_id = {j["job"]["job_id"]: j for j in response.json()}
    assert list(by_id) == [busy, quiet]  # oldest first: the order colours are given in
    activity = by_id[busy]["activity"]
    assert activity["calls"] == 6 and activity["steps"] == 3 and activity["swaps"] == 1
    assert activity["steps_per_min"] == pytest.approx(6.0)  # 2 steps over 20 s
    assert activity["last_at"] == pytest.approx(t + 21.5)
    accounting = by_id[busy]["accounting"]
    assert accounting["device_s"] == 3.25 and accounting["dedicated_device_s"] == 21.5
    assert by_id[quiet]["activity"] == {
        "calls": 0,
        "steps": 0,
        "steps_per_min": None,
        "swaps": 0,
        "last_at": None,
    }
    # Without `details` the list is the records, as before.
    plain = (await http.get("/plexrl/v1/jobs", headers=ALICE)).json()
    assert [j["job_id"] for j in plain] == [busy, quiet] and "activity" not in plain[0]
    bad = await http.get(
        "/plexrl/v1/jobs", params={"details": "true", "window_s": 0}, headers=ALICE
    )
    assert 400 <= bad.status_code < 500 and "window_s" in bad.text


# The page in a real browser, on a real small run -----------------------------------------


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        message = "chromium is not installed; scripts/chromium.sh installs Debian's package"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_chromium(args: list[str], profile: Path) -> str:
    command = [
        chromium(),
        "--headless",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={profile}",
        # The page refreshes every 2 s: let it load, read the API and redraw a few times.
        "--virtual-time-budget=8000",
        *(["--no-sandbox"] if os.geteuid() == 0 else []),  # Chromium's sandbox refuses root
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class Elements(HTMLParser):
    """Every element's tag and attributes, in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))


@dataclass(frozen=True)
class Run:
    cluster: LocalCluster
    job_ids: list[str]
    started_at: float

    def url(self) -> str:
        """The dashboard, its window the run so far and a minute: the run's calls fill
        most of the chart, and still fall inside it when Chromium takes tens of seconds
        to start on a loaded machine (the page takes the key from the URL)."""
        window = math.ceil(time.time() - self.started_at) + 60
        return f"{self.cluster.config.gateway_url}/dashboard?key={KEY}&window={window}"


@pytest.fixture(scope="module")
def small_run(
    infra: dict[str, str], tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    """Three LoRA jobs on two workers with room for one job state each (so the worker
    with two jobs swaps), a few training steps each."""
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path_factory.mktemp("dash-cluster"),
        "dash",
        workers=2,
        api_keys=f"{KEY}=dash",
        worker_threads=1,
        worker_device_bytes=400_000,
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    cluster = LocalCluster(config)
    cluster.start(timeout_s=600)  # the services import torch: slow on a busy machine
    try:
        service = tinker.ServiceClient(base_url=config.gateway_url, api_key=KEY)
        clients = [
            service.create_lora_training_client(base_model=BASE, rank=4, seed=i).result()
            for i in range(3)
        ]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[6, 7, 8, 9, 10], dtype="int64"),
                "weights": types.TensorData(data=[1.0] * 5, dtype="float32"),
            },
        )
        adam = types.AdamParams(learning_rate=1e-3)
        started = time.time()

        def train(client: Any) -> None:
            for _ in range(STEPS):
                client.forward_backward([datum], "cross_entropy").result()
                client.optim_step(adam).result()
                # A reward stall, as in RLVR: the job's worker may run another job's call.
                time.sleep(0.3)

        with ThreadPoolExecutor(max_workers=len(clients)) as pool:
            list(pool.map(train, clients))
        yield Run(cluster, [c.model_id for c in clients], started)
    finally:
        cluster.stop()


@pytest.mark.integration
def test_the_dashboard_draws_the_timeline_of_a_real_run(small_run: Run, tmp_path: Path) -> None:
    job_ids = small_run.job_ids
    dom = run_chromium(["--dump-dom", small_run.url()], tmp_path / "profile-dom")
    parser = Elements()
    parser.feed(dom)
    body = next(attrs for tag, attrs in parser.found if tag == "body")
    assert body.get("data-state") == "ok", dom[-3000:]
    bars = [a for tag, a in parser.found if tag == "rect" and "bar" in (a.get("class") or "")]
    # Every job of the run has its calls drawn, on the workers that ran them.
    assert {a["data-job"] for a in bars} >= set(job_ids), bars
    assert {a["data-worker"] for a in bars} <= {"worker-0", "worker-1"}
    assert {a["data-function"] for a in bars} >= {"forward_backward", "optim_step"}
    # Three jobs on two workers that each hold one state: some call had to swap one in.
    assert any(tag == "rect" and a.get("class") == "swap" for tag, a in parser.found)
    rows = {a["data-job"] for tag, a in parser.found if tag == "tr" and "data-job" in a}
    assert rows == set(job_ids)
    workers = {a["data-worker"] for tag, a in parser.found if tag == "tr" and "data-worker" in a}
    assert workers == {"worker-0", "worker-1"}

    shot = tmp_path / "dashboard.png"
    run_chromium(
        [f"--screenshot={shot}", "--window-size=1400,680", small_run.url()],
        tmp_path / "profile-shot",
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    kept = ARTIFACTS / "dashboard.png"
    shutil.copyfile(shot, kept)
    print(f"dashboard screenshot: {kept}")
