"""The host bed: a PlexRL cluster spread over several hosts of this one machine.

Hosts are network namespaces on a bridge (`plexrl_tools.hostnet`), each with its own address.
On them run what a real deployment runs on separate machines:

- Kafka as a three-node KRaft quorum, one broker per host (`scripts/infra.sh` with
  `PLEXRL_KAFKA_VOTERS`): every topic with three replicas, two in sync for a write;
- Redis, a primary and two replicas on three hosts, and three Sentinels on three hosts that
  fail the primary over (Debian's `redis-sentinel`);
- SeaweedFS on a host of its own, the S3 object store of the disk tier;
- the services (`BedLayout.services`): gpu-workers on two hosts, the schedulers, gateways
  and state-store replicas on others, each bound to its host's address.

Every service finds the others through settings alone (`service_env`): Kafka's three
brokers, the Sentinels, the object store, the state-store and scheduler URLs. The faults
(`partition`, `degrade`, `kill_host`, `revive_host`) act on whole hosts: what runs on a
host and its link, as a machine or a cable fails, not a process.

`HostBed` is for tests and benchmarks (the `host_bed` fixture, `bench/chaos.py --hosts`)
and for trying the multi-host setup by hand (`scripts/hosts.sh up|status|down`).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_tools.hostnet import HostNetwork, beds, free_subnet, remove
from plexrl_tools.private_infra import SeaweedFs, infra_sh, seaweedfs_binary, wait_sentinels_ready

KAFKA_PORT = 9092
CONTROLLER_PORT = 9093
REDIS_PORT = 6379
SENTINEL_PORT = 26379
S3_PORT = 8333
PORTS = {"gateway": 8000, "scheduler": 8100, "worker": 8200, "state-store": 8300}
MODULES = {
    "gateway": "plexrl_gateway",
    "scheduler": "plexrl_scheduler",
    "worker": "plexrl_worker",
    "state-store": "plexrl_state_store",
}
MASTER = "plexrl"
BEDS = Path(__file__).resolve().parents[2] / ".plexrl" / "hostbed"


@dataclass(frozen=True)
class BedLayout:
    """Which host runs what."""

    hosts: tuple[str, ...] = ("h1", "h2", "h3", "h4", "h5", "h6")
    brokers: tuple[str, ...] = ("h1", "h2", "h3")
    """One Kafka broker (and KRaft controller) on each."""
    redis_primary: str = "h1"
    redis_replicas: tuple[str, ...] = ("h2", "h3")
    """A write waits for one of them: one host lost leaves a replica to confirm writes."""
    sentinels: tuple[str, ...] = ("h1", "h2", "h3")
    object_store: str = "h6"
    services: tuple[tuple[str, str], ...] = (
        ("state-store-a", "h1"),
        ("state-store-b", "h3"),
        ("scheduler-a", "h2"),
        ("scheduler-b", "h3"),
        ("worker-0", "h4"),
        ("worker-1", "h5"),
        ("gateway-a", "h1"),
        ("gateway-b", "h2"),
    )
    """(service, host), started in this order: `<kind>-<suffix>` names the kind. Two of
    every kind, on different hosts: no host's loss stops the cluster (but the object
    store's, h6, which stands for an external S3)."""

    def of_kind(self, kind: str) -> list[tuple[str, str]]:
        return [(name, host) for name, host in self.services if kind_of(name) == kind]

    def on(self, host: str) -> list[str]:
        """The services a host runs."""
        return [name for name, h in self.services if h == host]


def kind_of(service: str) -> str:
    """`state-store-a` → `state-store`, `worker-0` → `worker`."""
    return service.rsplit("-", 1)[0]


def kafka_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, base64url without padding, never starting
    with '-' (as Kafka's own: the storage tool would read such an id as an option)."""
    while True:
        text = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        if not text.startswith("-"):
            return text


class HostCluster(LocalCluster):
    """The services of a bed: LocalCluster's processes, each on its host."""

    def __init__(self, config: ClusterConfig, bed: HostBed) -> None:
        super().__init__(config)
        self._bed = bed

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        c = self.config
        return {
            **os.environ,
            "PLEXRL_CLUSTER_ID": c.cluster_id,
            "PLEXRL_MODEL_REGISTRY": str(c.model_registry),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PLEXRL_SERVICE_TOKEN": self.service_token,
            **self._bed.service_env(),
            **c.env,
            **extra,
        }

    def start(self, timeout_s: float = 600.0) -> None:
        c = self.config
        for name, host_name in self._bed.layout.services:
            kind = kind_of(name)
            host = self._bed.net.hosts[host_name]
            port = PORTS[kind]
            env_kind = kind.upper().replace("-", "_")
            extra = {
                f"PLEXRL_{env_kind}_HOST": host.address,
                f"PLEXRL_{env_kind}_PORT": str(port),
            }
            if kind == "worker":
                extra["PLEXRL_WORKER_ID"] = name
                if c.worker_threads is not None:
                    extra["PLEXRL_WORKER_THREADS"] = str(c.worker_threads)
            elif kind == "gateway":
                extra["PLEXRL_API_KEYS"] = c.api_keys
            elif kind == "scheduler":
                extra["PLEXRL_POLICY"] = c.policy
                extra["PLEXRL_SCHEDULER_ID"] = name
            elif kind == "state-store":
                extra["PLEXRL_STATE_STORE_ID"] = name
                extra["PLEXRL_STATE_STORE_DIR"] = str(c.state_dir / "blobs" / name)
            self._spawn(name, MODULES[kind], port, extra, host.address, host.prefix())
        try:
            self.wait_healthy(timeout_s)
            self.wait_workers_known(timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_workers_known(self, timeout_s: float) -> None:
        """Until a scheduler that leads has heard every worker's heartbeat."""
        workers = len(self._bed.layout.of_kind("worker"))
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while True:
                for url in self._bed.scheduler_urls():
                    try:
                        body = http.get(f"{url}/healthz").json()
                    except (httpx.HTTPError, ValueError):
                        continue
                    known = body.get("workers", {})
                    if sum(bool(v) for v in known.values()) >= workers:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no scheduler knew {workers} workers after {timeout_s}s")
                time.sleep(0.3)


class Balancer:
    """HAProxy (Debian's) at one address of the root namespace (the bridge's), in front of
    every gateway: clients send every call there, and it spreads them over the gateways
    that answer their health check (every second; two misses take one out). A gateway
    lost mid-request costs that request a 502/503, which the SDK sends again."""

    def __init__(self, root: Path, host: str, port: int, backends: list[tuple[str, str]]) -> None:
        self.root = root
        self.url = f"http://{host}:{port}"
        self._host, self._port = host, port
        self._backends = backends
        self._process: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        servers = "\n".join(
            f"  server {name} {url.removeprefix('http://')} check" for name, url in self._backends
        )
        return f"""# Written by plexrl_tools.hostbed.Balancer.
global
  maxconn 4096
defaults
  mode http
  timeout connect 2s
  # retrieve_future holds a request up to PLEXRL_FUTURE_WAIT_S (25 s) before answering.
  timeout client 120s
  timeout server 120s
  # A connection refused or timed out is tried on the next gateway (nothing was sent).
  retries 2
  option redispatch
frontend gateways
  bind {self._host}:{self._port}
  default_backend gateways
backend gateways
  balance roundrobin
  option httpchk GET /healthz
  http-check expect status 200
  # A gateway marked down (its host lost: nothing answers, nothing is refused) has its
  # open requests cut at once, so the SDK sends them again instead of waiting them out.
  default-server inter 1s fall 2 rise 2 on-marked-down shutdown-sessions
{servers}
"""

    def up(self, timeout_s: float = 30.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "haproxy.cfg"
        config.write_text(self.config())
        with (self.root / "haproxy.log").open("ab") as log:
            self._process = subprocess.Popen(
                ["haproxy", "-db", "-f", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(f"haproxy exited; see {self.root / 'haproxy.log'}")
                try:
                    if http.get(f"{self.url}/healthz").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no gateway answered through {self.url}")
                time.sleep(0.2)

    def down(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


@dataclass
class HostBed:
    """A bed's hosts, its infrastructure on them and its services; `up` builds it all,
    `down` removes every trace of it."""

    root: Path
    """Data, logs and the bed's description (`bed.json`) go here."""
    model_registry: Path
    api_keys: str = "tml-dev=dev"
    layout: BedLayout = field(default_factory=BedLayout)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every service."""
    worker_threads: int | None = 1
    bed_id: str = field(default_factory=lambda: secrets.token_hex(3))
    cluster_id: str = field(default_factory=lambda: "bed" + secrets.token_hex(4))

    def __post_init__(self) -> None:
        subnet = free_subnet(int(self.bed_id, 16))
        self.net = HostNetwork(self.bed_id, list(self.layout.hosts), subnet)
        self.kafka_id = kafka_cluster_id()
        binary = seaweedfs_binary()
        if binary is None:
            raise RuntimeError("SeaweedFS is not built: run scripts/seaweedfs.sh build")
        store_host = self.net.hosts[self.layout.object_store]
        self.object_store = SeaweedFs(
            binary,
            self.root / store_host.name / "seaweedfs",
            host=store_host.address,
            prefix=store_host.prefix(),
            s3_port=S3_PORT,
        )
        self.balancer = Balancer(
            self.root / "balancer",
            self.net.gateway,
            PORTS["gateway"],
            [(name, self.url_of(name)) for name, _ in self.layout.of_kind("gateway")],
        )
        self.cluster = HostCluster(
            ClusterConfig(
                model_registry=self.model_registry,
                state_dir=self.root / "services",
                cluster_id=self.cluster_id,
                api_keys=self.api_keys,
                worker_threads=self.worker_threads,
                env=self.env,
            ),
            self,
        )

    # Addresses -------------------------------------------------------------------------

    def address(self, host: str) -> str:
        return self.net.hosts[host].address

    def host_of(self, service: str) -> str:
        return dict(self.layout.services)[service]

    def url_of(self, service: str) -> str:
        return f"http://{self.address(self.host_of(service))}:{PORTS[kind_of(service)]}"

    def urls(self, kind: str) -> list[str]:
        return [self.url_of(name) for name, _ in self.layout.of_kind(kind)]

    def scheduler_urls(self) -> list[str]:
        return self.urls("scheduler")

    @property
    def gateway_url(self) -> str:
        """Where clients send calls: the balancer in front of every gateway."""
        return self.balancer.url

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{self.address(h)}:{KAFKA_PORT}" for h in self.layout.brokers)

    @property
    def sentinels(self) -> str:
        return ",".join(f"{self.address(h)}:{SENTINEL_PORT}" for h in self.layout.sentinels)

    def service_env(self) -> dict[str, str]:
        """What every service of the bed is told about the others: settings only."""
        return {
            "PLEXRL_KAFKA_BOOTSTRAP": self.bootstrap,
            "PLEXRL_KAFKA_REPLICATION_FACTOR": "3",
            "PLEXRL_KAFKA_MIN_INSYNC_REPLICAS": "2",
            "PLEXRL_REDIS_URL": "redis://sentinel-named/0",
            "PLEXRL_REDIS_SENTINELS": self.sentinels,
            "PLEXRL_REDIS_SENTINEL_MASTER": MASTER,
            "PLEXRL_REDIS_WAIT_REPLICAS": "1",
            "PLEXRL_REDIS_SOCKET_TIMEOUT_S": "2",
            "PLEXRL_REDIS_CONNECT_TIMEOUT_S": "1",
            "PLEXRL_STATE_STORE_URL": ",".join(self.urls("state-store")),
            "PLEXRL_STATE_STORE_TIMEOUT_S": "10",
            "PLEXRL_SCHEDULER_URL": ",".join(self.scheduler_urls()),
            **self.object_store.env(bucket=self.cluster_id),
        }

    def redis_target(self) -> Any:
        """A client's view of the bed's Redis (through its Sentinels)."""
        from plexrl.redis_target import RedisTarget
        from plexrl.settings import parse_sentinels

        return RedisTarget(sentinels=parse_sentinels(self.sentinels), master=MASTER)

    # Infrastructure on the hosts ----------------------------------------------------

    def _infra(self, host: str, part: str, command: str, env: dict[str, str]) -> None:
        h = self.net.hosts[host]
        base = {
            "PLEXRL_INFRA_HOST": h.address,
            # A directory per part: infra.sh locks one per run, and a host's parts start
            # at once (Kafka's `up` waits for its quorum, which needs other hosts).
            "PLEXRL_INFRA_DIR": str(self.root / host / part),
            "PLEXRL_INFRA_PARTS": part,
        }
        infra_sh(command, {**base, **env}, 300.0, prefix=h.prefix())

    def _kafka(self, host: str, command: str = "up") -> None:
        brokers = enumerate(self.layout.brokers)
        voters = ",".join(f"{i + 1}@{self.address(h)}:{CONTROLLER_PORT}" for i, h in brokers)
        self._infra(
            host,
            "kafka",
            command,
            {
                "PLEXRL_KAFKA_PORT": str(KAFKA_PORT),
                "PLEXRL_KAFKA_CONTROLLER_PORT": str(CONTROLLER_PORT),
                "PLEXRL_KAFKA_NODE_ID": str(self.layout.brokers.index(host) + 1),
                "PLEXRL_KAFKA_VOTERS": voters,
                "PLEXRL_KAFKA_CLUSTER_ID": self.kafka_id,
                "PLEXRL_KAFKA_HEAP": os.environ.get("PLEXRL_BED_KAFKA_HEAP", "384m"),
            },
        )

    def _redis(self, host: str, command: str = "up", replica_of: str = "") -> None:
        self._infra(
            host,
            "redis",
            command,
            {
                "PLEXRL_REDIS_PORT": str(REDIS_PORT),
                "PLEXRL_REDIS_REPLICA_OF": replica_of,
            },
        )

    def _sentinel(self, host: str, command: str = "up") -> None:
        primary = self.address(self.layout.redis_primary)
        self._infra(
            host,
            "sentinel",
            command,
            {
                "PLEXRL_SENTINEL_PORT": str(SENTINEL_PORT),
                "PLEXRL_SENTINEL_MONITOR": f"{MASTER} {primary} {REDIS_PORT} 2",
                "PLEXRL_SENTINEL_DOWN_MS": os.environ.get("PLEXRL_BED_SENTINEL_DOWN_MS", "1500"),
            },
        )

    def _infra_up(self) -> None:
        # Installs and the jar fetch once, before the parts start at once on every host.
        infra_sh("prepare", {"PLEXRL_INFRA_PARTS": "kafka redis sentinel"}, 900.0)
        self._redis(self.layout.redis_primary)
        replica_of = f"{self.address(self.layout.redis_primary)} {REDIS_PORT}"
        with ThreadPoolExecutor(max_workers=9) as pool:
            started = [pool.submit(self._kafka, h) for h in self.layout.brokers]
            started += [
                pool.submit(self._redis, h, "up", replica_of) for h in self.layout.redis_replicas
            ]
            started += [pool.submit(self._sentinel, h) for h in self.layout.sentinels]
            started.append(pool.submit(self.object_store.up))
            for future in started:
                future.result()
        wait_sentinels_ready(
            [(self.address(h), SENTINEL_PORT) for h in self.layout.sentinels],
            MASTER,
            replicas=len(self.layout.redis_replicas),
        )

    # Lifecycle ----------------------------------------------------------------------

    def up(self, timeout_s: float = 900.0) -> None:
        """Build the hosts, start the infrastructure, then the services."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.net.create()
        try:
            self._describe()
            self._infra_up()
            self.cluster.start(timeout_s)
            self.balancer.up()
        except BaseException:
            self.down()
            raise

    def _describe(self) -> None:
        """`bed.json` (and a link under .plexrl/hostbed/): what `scripts/hosts.sh status`
        shows and `down` removes."""
        description = {
            "bed": self.bed_id,
            "root": str(self.root),
            "cluster_id": self.cluster_id,
            "subnet": str(self.net.subnet),
            "hosts": {name: h.address for name, h in self.net.hosts.items()},
            "services": {name: self.url_of(name) for name, _ in self.layout.services},
            "env": self.service_env(),
            "service_token": self.cluster.service_token,
            "gateway": self.gateway_url,
        }
        (self.root / "bed.json").write_text(json.dumps(description, indent=2))
        BEDS.mkdir(parents=True, exist_ok=True)
        (BEDS / f"{self.bed_id}.json").write_text(json.dumps(description, indent=2))

    def down(self) -> None:
        """Stop the services, then kill whatever else runs on the hosts and remove them."""
        try:
            self.balancer.down()
            self.cluster.stop(timeout_s=20.0)
        finally:
            self.net.destroy()
            (BEDS / f"{self.bed_id}.json").unlink(missing_ok=True)

    # Faults ---------------------------------------------------------------------------

    def partition(self, host: str) -> None:
        self.net.partition(host)

    def heal(self, host: str) -> None:
        self.net.heal(host)

    def degrade(self, host: str, loss: float = 0.1, delay_ms: float = 50.0) -> None:
        self.net.degrade(host, loss, delay_ms)

    def kill_host(self, host: str) -> list[str]:
        """The host is lost at once: cut off, and every process on it killed; returns the
        services it ran."""
        self.net.partition(host)
        self.net.kill_all(host)
        return self.layout.on(host)

    def revive_host(self, host: str, timeout_s: float = 600.0) -> None:
        """The host comes back on its disk: link healed, its infrastructure and services
        started again (a Redis that was primary comes back as a replica of the primary
        the Sentinels name now)."""
        self.net.heal(host)
        jobs = []
        with ThreadPoolExecutor(max_workers=6) as pool:
            if host in self.layout.brokers:
                jobs.append(pool.submit(self._kafka, host))
            if host == self.layout.redis_primary or host in self.layout.redis_replicas:
                jobs.append(pool.submit(self._revive_redis, host))
            if host in self.layout.sentinels:
                jobs.append(pool.submit(self._sentinel, host))
            if host == self.layout.object_store:
                jobs.append(pool.submit(self.object_store.up))
            for future in jobs:
                future.result()
        for name in self.layout.on(host):
            self.cluster.restart(name, timeout_s)

    def _revive_redis(self, host: str) -> None:
        primary = self.redis_primary()
        replica_of = "" if primary == host else f"{self.address(primary)} {REDIS_PORT}"
        self._redis(host, "up", replica_of)

    # What the bed says now ----------------------------------------------------------

    def redis_primary(self) -> str:
        """The host of the Redis primary, as the Sentinels that answer say."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        by_address = {h.address: name for name, h in self.net.hosts.items()}
        for host in self.layout.sentinels:
            try:
                with redis.Redis(
                    host=self.address(host),
                    port=SENTINEL_PORT,
                    socket_timeout=1,
                    socket_connect_timeout=0.5,
                    retry=Retry(NoBackoff(), 0),
                ) as sentinel:
                    address, _ = sentinel.sentinel_get_master_addr_by_name(MASTER)
                    text = address.decode() if isinstance(address, bytes) else str(address)
                    return by_address[text]
            except (redis.exceptions.RedisError, OSError, TypeError):
                continue
        raise RuntimeError("no Sentinel of the bed answers")

    def scheduler_leader(self) -> str | None:
        """The scheduler that holds the lease, by its own /healthz."""
        with httpx.Client(timeout=2.0) as http:
            for name, _ in self.layout.of_kind("scheduler"):
                try:
                    body = http.get(f"{self.url_of(name)}/healthz").json()
                except (httpx.HTTPError, ValueError):
                    continue
                if body.get("role", "leader") == "leader":
                    return name
        return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description="the host bed: a PlexRL cluster over network namespaces (docs/deploy.md)"
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--root", type=Path, default=None, help="state directory of `up`")
    parser.add_argument("--api-keys", default="tml-dev=dev")
    args = parser.parse_args()
    if args.command == "up":
        from plexrl.models import init_tiny

        root = args.root or BEDS / f"bed-{secrets.token_hex(3)}"
        registry = root / "models"
        if not (registry / "tiny-qwen3").exists():
            init_tiny(registry / "tiny-qwen3")
        bed = HostBed(root, registry, api_keys=args.api_keys)
        bed.up()
        print(json.dumps(json.loads((root / "bed.json").read_text()), indent=2))
        return
    if args.command == "status":
        found = sorted(BEDS.glob("*.json")) if BEDS.is_dir() else []
        for description in found:
            print(description.read_text())
        running = beds()
        print(f"namespaces of beds on this machine: {running or 'none'}")
        sys.exit(0 if running else 1)
    for bed_id in beds():  # down: every bed of this machine, and its files
        remove(bed_id)
        described = BEDS / f"{bed_id}.json"
        if described.is_file():
            root = Path(json.loads(described.read_text())["root"])
            if root.is_relative_to(BEDS):
                shutil.rmtree(root, ignore_errors=True)
            described.unlink()
        print(f"removed bed {bed_id}")


if __name__ == "__main__":
    main()
