"""A Kafka broker and a Redis of their own, for runs that kill them.

`scripts/infra.sh` on other ports (its state under `.plexrl/infra/kafka-PORT` and
`redis-PORT`): the broker and Redis are configured exactly as the shared pair is, and
the shared pair other runs use is never touched. Used by the fault suite and
`bench/chaos.py` to kill -9 the broker or Redis in the middle of a run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Literal

from plexrl.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "scripts" / "infra.sh"
STATE = ROOT / ".plexrl" / "infra"

Part = Literal["broker", "redis"]


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
    ) -> None:
        self.parts = parts
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
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30.0
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

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
            file = STATE / f"kafka-{self.kafka_port}" / "kafka.pid"
        else:
            file = STATE / f"redis-{self.redis_port}" / "redis.pid"
        try:
            pid = int(file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if Path(f"/proc/{pid}").exists() else None

    def _infra(self, command: str, timeout_s: float) -> None:
        env = {
            **os.environ,
            "PLEXRL_KAFKA_PORT": str(self.kafka_port),
            "PLEXRL_REDIS_PORT": str(self.redis_port),
            "PLEXRL_INFRA_TIMEOUT": str(int(timeout_s)),
            "PLEXRL_INFRA_PARTS": " ".join("kafka" if p == "broker" else p for p in self.parts),
        }
        done = subprocess.run(
            [str(INFRA), command], env=env, capture_output=True, text=True, timeout=timeout_s + 60
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"scripts/infra.sh {command} (kafka {self.kafka_port}, redis {self.redis_port})"
                f" failed with {done.returncode}:\n{done.stderr[-3000:]}"
            )
