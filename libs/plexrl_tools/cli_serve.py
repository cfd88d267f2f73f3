"""`plexrl serve <service>`: run one service in the foreground (SIGTERM stops it cleanly)."""

from __future__ import annotations

import enum
import importlib
from typing import Annotated

import typer


class Service(enum.StrEnum):
    """The four PlexRL services."""

    GATEWAY = "gateway"
    """HTTP API: Tinker and /plexrl/v1."""
    SCHEDULER = "scheduler"
    """Placement, dispatch and swap decisions."""
    GPU_WORKER = "gpu-worker"
    """One device group running model functions."""
    STATE_STORE = "state-store"
    """Disk tier and checkpoint records."""


MODULES = {
    Service.GATEWAY: "plexrl_gateway",
    Service.SCHEDULER: "plexrl_scheduler",
    Service.GPU_WORKER: "plexrl_worker",
    Service.STATE_STORE: "plexrl_state_store",
}


def serve(service: Annotated[Service, typer.Argument(help="Which service to run.")]) -> None:
    """Run a service; configure it with PLEXRL_* environment variables."""
    importlib.import_module(f"{MODULES[service]}.__main__").main()
