"""Shared fixtures: the real Kafka and Redis that scripts/infra.sh starts, and a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import pytest_asyncio

from plexrl.models import PLEXRL_JSON
from plexrl.service_auth import new_token
from plexrl.stores import Stores
from plexrl_tools import preload
from plexrl_tools.cluster import SERVICE_MODULES, ClusterConfig, LocalCluster, preload_services
from plexrl_tools.cluster import free_port as free_port  # re-exported to the tests

if TYPE_CHECKING:
    from plexrl_tools.private_infra import SeaweedFs
    from plexrl_worker.sglang import SGLangSampler

# No model hub is reachable: every Hugging Face lookup must stay local (read at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
KAFKA = os.environ.get("PLEXRL_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
REDIS = os.environ.get("PLEXRL_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where integration tests were collected, the services of the clusters they start
    are forked from processes that import them once (plexrl_tools.preload), begun here
    to import while the first tests run: a worker's start then costs about a second,
    not 15-20 s of CPU, each of the suite's dozens of times. PLEXRL_PRELOAD=0 starts
    every service as a new interpreter."""
    if os.environ.get("PLEXRL_PRELOAD", "1") == "0":
        return
    if any(item.get_closest_marker("integration") for item in items):
        preloader = preload.shared()
        preloader.warm(list(SERVICE_MODULES))
        preload_services(preloader)


def _answers(hostport: str) -> bool:
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def infra() -> dict[str, str]:
    """Kafka and Redis, started by the project's own script if nothing answers."""
    redis_hostport = REDIS.split("//", 1)[1].split("/", 1)[0]
    if not (_answers(KAFKA) and _answers(redis_hostport)):
        subprocess.run([str(ROOT / "scripts" / "infra.sh"), "up"], check=True)
    return {"kafka": KAFKA, "redis": REDIS}


@pytest.fixture()
def cluster_id() -> str:
    """A fresh cluster id: its own topics, consumer groups and Redis keys."""
    return "t" + uuid.uuid4().hex[:10]


@pytest_asyncio.fixture
async def stores(infra: dict[str, str], cluster_id: str) -> AsyncIterator[Stores]:
    """Every Redis store under the test's own cluster id; its keys are deleted after."""
    store = Stores.from_url(infra["redis"], cluster_id, ttl_s=60)
    yield store
    keys = [k async for k in store.keys.redis.scan_iter(match=f"{cluster_id}:*", count=1000)]
    if keys:
        await store.keys.redis.delete(*keys)
    await store.close()


@pytest.fixture(scope="session")
def tiny_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A model registry holding one tiny Qwen3 model (random weights, local tokenizer)."""
    from plexrl.models import init_tiny

    root = tmp_path_factory.mktemp("models")
    init_tiny(root / "tiny-qwen3")
    yield root


def _sglang(python: Path, tiny_registry: Path, log_dir: Path) -> SGLangSampler:
    from plexrl_worker.sglang import SGLangSampler, SGLangServerConfig

    config = SGLangServerConfig(
        model_path=str(tiny_registry / "tiny-qwen3"),
        python=python,
        max_lora_rank=64,
        lora_target_modules=(*SGLangServerConfig.lora_target_modules, "lm_head"),
        startup_timeout_s=900,
        log_path=log_dir / "server.log",
    )
    return SGLangSampler(config)


def _started(sampler: SGLangSampler) -> SGLangSampler:
    try:
        sampler.start()
    except Exception:
        log = sampler.server.config.log_path
        if log is not None and log.exists():
            print(log.read_text()[-5000:])
        raise
    return sampler


@pytest.fixture(scope="session", autouse=True)
def _sglang_early(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangSampler | None]:
    """Where a collected test uses `sglang_sampler`, its server is launched with the
    session and loads (35-40 s on 2 cores with the bytecode scripts/sglang.sh compiles)
    in its own processes while the tests before it run. Nothing of it runs on a thread
    here: pytest walks the logging module's loggers unlocked around every test, and a
    thread's first HTTP client registers new ones."""
    wanted = any(
        "sglang_sampler" in getattr(item, "fixturenames", ()) for item in request.session.items
    )
    if not wanted:
        yield None
        return
    from plexrl_worker.sglang import sglang_python

    if not sglang_python().exists():
        yield None
        return
    registry = request.getfixturevalue("tiny_registry")
    sampler = _sglang(sglang_python(), registry, tmp_path_factory.mktemp("sglang"))
    try:
        sampler.launch()
    except Exception:  # surfaces again where `sglang_sampler` starts its own
        sampler.stop()
        yield None
        return
    try:
        yield sampler
    finally:
        sampler.stop()


@pytest.fixture(scope="session")
def sglang_sampler(
    tiny_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
    _sglang_early: SGLangSampler | None,
) -> Iterator[SGLangSampler]:
    """One real SGLang server on this CPU for the session (a start takes 35-40 s on 2
    cores, launched early by `_sglang_early`): tests/test_sglang.py drives it directly
    and the worker in tests/test_sglang_worker.py attaches to it (PLEXRL_SGLANG_URL), so
    it is started with the worker's own LoRA settings (rank up to 64, the unembedding
    too)."""
    python = require_sglang()
    if _sglang_early is not None:
        yield _started(_sglang_early)  # stopped by `_sglang_early`
        return
    sampler = _started(_sglang(python, tiny_registry, tmp_path_factory.mktemp("sglang")))
    yield sampler
    sampler.stop()


SHARED_KEYS = {
    "tml-losses": "losses",
    "tml-sdk-versions": "sdk-versions",
    "tml-preempt": "preempt",
    "tml-e2e-alpha": "alpha",
    "tml-e2e-beta": "beta",
    "tml-export": "exporter",
    "tml-export-other": "someone-else",
    "tml-export-clients": "export-clients",
    "tml-owner": "owner",
    "tml-other": "other",
    "tml-internal": "acme",
    "tml-openai": "openai",
    "tml-aliases": "aliases",
    "tml-trace": "tracer",
    "tml-trace-other": "not-the-tracer",
    "tml-cli": "cli-user",
    "tml-pure-kill": "pure-kill",
}
"""API keys (and their tenants) of the shared cluster: each test module using it has
keys of its own, so no module sees another's jobs or checkpoints."""

SHARED_ALIASES = ("Qwen/Qwen3-8B", "Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-0.6B")
"""Further names the shared cluster serves its tiny Qwen3 under (what recipes and
clients configure)."""
SHARED_NO_CHAT = "plexrl/tiny-nochat"
"""A copy of the tiny Qwen3 whose tokenizer has no chat template."""
SHARED_ENV = {
    # Short checkpoint TTLs are allowed and expired ones swept every second.
    "PLEXRL_CHECKPOINT_TTL_MIN_S": "1",
    "PLEXRL_STATE_STORE_EXPIRY_SWEEP_S": "1",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
}


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps each export's service names."""

    services: ClassVar[set[str]] = set()

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for spans in export.resource_spans:
            for attribute in spans.resource.attributes:
                if attribute.key == "service.name":
                    self.services.add(attribute.value.string_value)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="session")
def otlp_services() -> Iterator[set[str]]:
    """The service names an OTLP/HTTP receiver has seen spans from: the shared cluster
    exports its traces there."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    os.environ["PLEXRL_TEST_OTLP"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield _Collector.services
    server.shutdown()


@pytest.fixture(scope="session")
def shared_registry(tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared cluster's models: the session's tiny Qwen3 (the same files) also served
    under SHARED_ALIASES, and SHARED_NO_CHAT."""
    root = tmp_path_factory.mktemp("shared-models")
    shutil.copytree(tiny_registry / "tiny-qwen3", root / "tiny")
    meta = json.loads((root / "tiny" / PLEXRL_JSON).read_text())
    (root / "tiny" / PLEXRL_JSON).write_text(json.dumps({**meta, "aliases": SHARED_ALIASES}))
    shutil.copytree(tiny_registry / "tiny-qwen3", root / "nochat")
    (root / "nochat" / PLEXRL_JSON).write_text(json.dumps({"name": SHARED_NO_CHAT}))
    (root / "nochat" / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = root / "nochat" / "tokenizer_config.json"
    data = json.loads(tokenizer_config.read_text())
    data.pop("chat_template", None)
    tokenizer_config.write_text(json.dumps(data))
    return root


@pytest.fixture(scope="session")
def shared_services(
    infra: dict[str, str],
    shared_registry: Path,
    otlp_services: set[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalCluster]:
    """One plain cluster (one worker, the tiny Qwen3) for every SDK-level test module that
    needs nothing else of it, each under keys of its own in SHARED_KEYS: a cluster start
    costs 20-35 s on two cores. A module may kill and restart one of its services, and
    must leave it running."""
    config = ClusterConfig.on_free_ports(
        shared_registry,
        tmp_path_factory.mktemp("shared-cluster"),
        "shr",
        api_keys=",".join(f"{key}={tenant}" for key, tenant in SHARED_KEYS.items()),
        worker_threads=1,
        service_token=new_token(),
        env={**SHARED_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": os.environ["PLEXRL_TEST_OTLP"]},
    )
    cluster = LocalCluster(config)
    # Generous: on a loaded two-core machine four services importing torch take minutes.
    cluster.start(timeout_s=600)
    try:
        yield cluster
    finally:
        codes = cluster.stop()
    # SIGTERM stops every service cleanly: each finishes what it holds and exits 0.
    assert codes and all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="session")
def shared_cluster(shared_services: LocalCluster) -> ClusterConfig:
    """The shared cluster's configuration (its gateway URL, ports, directories)."""
    return shared_services.config


@pytest.fixture(scope="module")
def blobs(cluster: LocalCluster) -> Path:
    """The state-store's blob directory of the module's own `cluster` (a module that
    starts one defines that fixture): where `plexrl_tools.faults` reads checkpoints."""
    return cluster.config.state_dir / "blobs"


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFs]:
    """SeaweedFS with its S3 gateway on loopback, for the object-store disk tier (the
    binary scripts/seaweedfs.sh builds; skipped without it, except under CI=true)."""
    from plexrl_tools.private_infra import SeaweedFs, seaweedfs_binary

    binary = seaweedfs_binary()
    if binary is None:
        reason = "no SeaweedFS binary; build it with scripts/seaweedfs.sh build"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI must run the object-store tests, not skip them)")
        pytest.skip(reason)
    store = SeaweedFs(binary, tmp_path_factory.mktemp("seaweedfs"))
    store.up()
    try:
        yield store
    finally:
        store.down()


def require_sglang() -> Path:
    """The SGLang venv's python (scripts/sglang.sh); skips the caller without it, except
    under CI=true, where the SGLang tier must run and its absence fails."""
    from plexrl_worker.sglang import sglang_python

    python = sglang_python()
    if python.exists():
        return python
    reason = f"no SGLang venv at {python}; install it with scripts/sglang.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must run the SGLang tests, not skip them)")
    pytest.skip(reason)
