"""Infrastructure of its own, for runs that kill it: a Kafka broker and a Redis
(`PrivateInfra`), or a Redis primary with a replica and three Sentinels (`RedisGroup`).

`scripts/infra.sh` on other ports (its state under `.plexrl/infra/kafka-PORT` and
`redis-PORT`, or a directory of the caller's): configured exactly as the shared pair is,
and the shared pair other runs use is never touched. Used by the fault suite and
`bench/chaos.py` to kill -9 the broker or Redis in the middle of a run, and by the
Sentinel tests to fail a primary over; the host bed (`plexrl_tools.hostbed`) runs the same
script inside its hosts.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from plexrl_tools.cluster import free_port, free_ports

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "scripts" / "infra.sh"
STATE = ROOT / ".plexrl" / "infra"

Part = Literal["broker", "redis"]


def infra_sh(
    command: str,
    env: dict[str, str],
    timeout_s: float,
    prefix: tuple[str, ...] = (),
) -> None:
    """Run `scripts/infra.sh command` with `env` added (`prefix`: a command to run it
    under, e.g. `ip netns exec HOST`); raises with its error output when it fails."""
    done = subprocess.run(
        [*prefix, str(INFRA), command],
        env={**os.environ, "PLEXRL_INFRA_TIMEOUT": str(int(timeout_s)), **env},
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
    )
    if done.returncode != 0:
        shown = " ".join(f"{k}={v}" for k, v in env.items())
        raise RuntimeError(
            f"scripts/infra.sh {command} ({shown}) failed with {done.returncode}:\n"
            f"{done.stderr[-3000:]}"
        )


def pid_alive(file: Path) -> int | None:
    """The pid in `file` if that process lives."""
    try:
        pid = int(file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def kill_and_wait(pid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL `pid` (a crash: no clean shutdown) and wait until it is gone."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _port_pair() -> int:
    """A free port whose next port is free too (the broker's controller listens there)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports found for a private Kafka broker")


class PrivateInfra:
    """`up` starts both (minutes the first time: Kafka's jars come from Maven Central),
    or only the `parts` asked for; `kill` sends SIGKILL to one, `down` stops them cleanly
    (Redis fsyncs its append-only file), `up` again restarts them on the same data."""

    def __init__(
        self,
        kafka_port: int | None = None,
        redis_port: int | None = None,
        parts: tuple[Part, ...] = ("broker", "redis"),
        settings: dict[str, str] | None = None,
    ) -> None:
        """`settings`: more of infra.sh's environment (e.g. the broker's TLS listeners,
        PLEXRL_KAFKA_TLS_DIR and its ports)."""
        self.parts = parts
        self.settings = dict(settings or {})
        self.kafka_port = kafka_port if kafka_port is not None else _port_pair()
        self.redis_port = redis_port if redis_port is not None else free_port()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self) -> dict[str, str]:
        """What a service (or a client) needs to use this pair."""
        return {"PLEXRL_KAFKA_BOOTSTRAP": self.bootstrap, "PLEXRL_REDIS_URL": self.redis_url}

    def up(self, timeout_s: float = 300.0) -> None:
        self._infra("up", timeout_s)

    def down(self) -> None:
        self._infra("down", 120.0)

    def kill(self, part: Part) -> None:
        """SIGKILL the broker or Redis (a crash: no clean shutdown) and wait until it is gone."""
        pid = self.pid(part)
        if pid is None:
            raise RuntimeError(f"the private {part} is not running (no live pid file)")
        kill_and_wait(pid)

    def wipe_redis(self) -> None:
        """Lose Redis's data on disk (a run without persistence, or a lost volume); with
        Redis down."""
        shutil.rmtree(STATE / f"redis-{self.redis_port}" / "data", ignore_errors=True)

    def remove(self) -> None:
        """After `down`: delete this pair's data, logs and configs under .plexrl/infra."""
        for part in self.parts:
            name = f"kafka-{self.kafka_port}" if part == "broker" else f"redis-{self.redis_port}"
            shutil.rmtree(STATE / name, ignore_errors=True)

    def pid(self, part: Part) -> int | None:
        if part == "broker":
            return pid_alive(STATE / f"kafka-{self.kafka_port}" / "kafka.pid")
        return pid_alive(STATE / f"redis-{self.redis_port}" / "redis.pid")

    def _infra(self, command: str, timeout_s: float) -> None:
        env = {
            "PLEXRL_KAFKA_PORT": str(self.kafka_port),
            "PLEXRL_REDIS_PORT": str(self.redis_port),
            "PLEXRL_INFRA_PARTS": " ".join("kafka" if p == "broker" else p for p in self.parts),
            **self.settings,
        }
        infra_sh(command, env, timeout_s)


def wait_sentinels_ready(
    sentinels: list[tuple[str, int]], master: str, replicas: int = 1, timeout_s: float = 60.0
) -> None:
    """Until every Sentinel knows the primary's `replicas` (linked and not down) and the
    other Sentinels. A Sentinel learns a replica from the primary's INFO, every 10 s, and
    fails over only to a replica it knows: a primary lost before that ends every
    failover with "no good slave", however long one waits."""
    import redis

    deadline = time.monotonic() + timeout_s
    missing: list[str] = []
    while True:
        missing = []
        for host, port in sentinels:
            try:
                with redis.Redis(host=host, port=port, socket_timeout=2) as sentinel:
                    known = sentinel.sentinel_slaves(master)
                    peers = sentinel.sentinel_sentinels(master)
            except (redis.exceptions.RedisError, OSError):
                missing.append(f"{host}:{port} does not answer")
                continue
            good = [
                r
                for r in known
                if not r.get("is_sdown")
                and not r.get("is_disconnected")
                and r.get("master-link-status") == "ok"
            ]
            if len(good) < replicas or len(peers) < len(sentinels) - 1:
                missing.append(
                    f"{host}:{port} knows {len(good)} of {replicas} replica(s) and "
                    f"{len(peers)} of {len(sentinels) - 1} other Sentinel(s)"
                )
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Sentinels of {master!r} are not ready: {'; '.join(missing)}")
        time.sleep(0.5)


class RedisGroup:
    """A Redis primary, two replicas and three Sentinels on loopback ports of their own,
    with state under `root`: `up`, `kill_primary` (SIGKILL; the Sentinels promote a
    replica), `primary` (where the Sentinels say it is), `replicas`, `pid`, `down`."""

    MASTER = "plexrl"

    def __init__(self, root: Path, down_after_ms: int = 1000) -> None:
        self.root = root
        self.down_after_ms = down_after_ms
        ports = free_ports(6)
        self.redis_ports = (ports[0], ports[1], ports[2])
        self.sentinel_ports = tuple(ports[3:])

    @property
    def sentinels(self) -> str:
        """PLEXRL_REDIS_SENTINELS for this group."""
        return ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)

    def env(self) -> dict[str, str]:
        """What a service needs to use this group (a write waits for one replica)."""
        return {
            "PLEXRL_REDIS_SENTINELS": self.sentinels,
            "PLEXRL_REDIS_SENTINEL_MASTER": self.MASTER,
            "PLEXRL_REDIS_WAIT_REPLICAS": "1",
        }

    def _dir(self, port: int) -> Path:
        """Each process's own state directory: infra.sh locks one per run, and the five
        start and stop at once."""
        return self.root / f"node-{port}"

    def _redis(self, command: str, port: int, replica_of: str = "") -> None:
        env = {
            "PLEXRL_INFRA_DIR": str(self._dir(port)),
            "PLEXRL_INFRA_PARTS": "redis",
            "PLEXRL_REDIS_PORT": str(port),
            "PLEXRL_REDIS_REPLICA_OF": replica_of,
        }
        infra_sh(command, env, 120.0)

    def _sentinel(self, command: str, port: int) -> None:
        env = {
            "PLEXRL_INFRA_DIR": str(self._dir(port)),
            "PLEXRL_INFRA_PARTS": "sentinel",
            "PLEXRL_SENTINEL_PORT": str(port),
            "PLEXRL_SENTINEL_MONITOR": f"{self.MASTER} 127.0.0.1 {self.redis_ports[0]} 2",
            "PLEXRL_SENTINEL_DOWN_MS": str(self.down_after_ms),
        }
        infra_sh(command, env, 120.0)

    def up(self) -> None:
        primary, *replicas = self.redis_ports
        # Installs once, before six starts at once would race them.
        infra_sh("prepare", {"PLEXRL_INFRA_PARTS": "redis sentinel"}, 900.0)
        self._redis("up", primary)
        with ThreadPoolExecutor() as pool:  # the replicas sync while the Sentinels start
            started = [pool.submit(self._redis, "up", r, f"127.0.0.1 {primary}") for r in replicas]
            started += [pool.submit(self._sentinel, "up", p) for p in self.sentinel_ports]
            for future in started:
                future.result()
        wait_sentinels_ready(
            [("127.0.0.1", p) for p in self.sentinel_ports], self.MASTER, replicas=len(replicas)
        )

    def down(self) -> None:
        with ThreadPoolExecutor() as pool:
            stopped = [pool.submit(self._sentinel, "down", p) for p in self.sentinel_ports]
            stopped += [pool.submit(self._redis, "down", p) for p in self.redis_ports]
            for future in stopped:
                future.result()

    def primary(self) -> int:
        """The port the Sentinels name as the primary now."""
        import redis

        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=2) as sentinel:
                    _, primary = sentinel.sentinel_get_master_addr_by_name(self.MASTER)
                    return int(primary)
            except redis.exceptions.ConnectionError:
                continue
        raise RuntimeError(f"no Sentinel of {self.sentinel_ports} answers")

    def replicas(self) -> list[int]:
        """The ports of the servers that are not the primary now."""
        primary = self.primary()
        return [p for p in self.redis_ports if p != primary]

    def pid(self, port: int) -> int | None:
        """The process of the server on `port`, if it runs."""
        return pid_alive(self._dir(port) / f"redis-{port}" / "redis.pid")

    def kill_primary(self) -> int:
        """SIGKILL the primary; returns its port."""
        port = self.primary()
        pid = self.pid(port)
        if pid is None:
            raise RuntimeError(f"the primary on {port} is not running")
        kill_and_wait(pid)
        return port

    def revive(self, port: int) -> None:
        """Start a killed Redis again, as a replica of the primary now."""
        self._redis("up", port, f"127.0.0.1 {self.primary()}")


SEAWEEDFS = ROOT / "scripts" / "seaweedfs.sh"


def seaweedfs_binary() -> Path | None:
    """The `weed` binary scripts/seaweedfs.sh built, if it did."""
    done = subprocess.run([str(SEAWEEDFS), "path"], capture_output=True, text=True)
    path = Path(done.stdout.strip())
    return path if done.returncode == 0 and path.is_file() else None


class SeaweedFs:
    """SeaweedFS in one process (`weed server -s3`: master, volume server, filer and the
    S3 gateway) with its data under `root`, bound to `host`; `prefix` runs it under
    another command (`ip netns exec HOST` on the host bed). `up` returns once the S3
    gateway answers; `kill` is SIGKILL, `down` a clean stop."""

    def __init__(
        self,
        binary: Path,
        root: Path,
        host: str = "127.0.0.1",
        prefix: tuple[str, ...] = (),
        s3_port: int | None = None,
    ) -> None:
        self.binary = binary
        self.root = root
        self.host = host
        self.prefix = prefix
        # Each of master, volume, filer and S3 has an HTTP and a gRPC port.
        ports = free_ports(8)
        self.s3_port = s3_port if s3_port is not None else ports[0]
        self._ports = ports[1:]
        self.access_key = "plexrl-" + os.urandom(4).hex()
        self.secret_key = os.urandom(16).hex()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    def env(self, bucket: str = "plexrl") -> dict[str, str]:
        """What a state-store needs to keep its blobs here."""
        return {
            "PLEXRL_STATE_STORE_S3_ENDPOINT": self.endpoint,
            "PLEXRL_STATE_STORE_S3_BUCKET": bucket,
            "PLEXRL_STATE_STORE_S3_ACCESS_KEY": self.access_key,
            "PLEXRL_STATE_STORE_S3_SECRET_KEY": self.secret_key,
        }

    def up(self, timeout_s: float = 120.0) -> None:
        import json

        import httpx

        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        identity = {
            "name": "plexrl",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3_grpc = self._ports
        command = [
            *self.prefix,
            str(self.binary),
            "server",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-dir={data}",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            # Small volumes: a test's blobs are megabytes, and each volume is a file.
            "-master.volumeSizeLimitMB=256",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-volume.max=0",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={s3_grpc}",
            f"-s3.config={config}",
        ]
        log = (self.root / "weed.log").open("ab")
        self._process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                tail = (self.root / "weed.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"SeaweedFS exited with {self._process.returncode}:\n{tail}")
            try:
                # Unauthenticated: a 403 says the S3 gateway is up.
                if httpx.get(self.endpoint, timeout=2.0).status_code in (200, 403):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SeaweedFS's S3 gateway did not answer within {timeout_s}s")
            time.sleep(0.3)

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def down(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (its shutdown can take half a minute)."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
