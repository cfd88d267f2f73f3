"""Named crash points for the fault suite: a process killed (-9) at an exact line.

`failpoint(name)` does nothing unless the process was started with
`PLEXRL_FAILPOINTS_DIR` set. Then a file called `name` in that directory arms the
point: the first process to reach it removes the file and sends itself SIGKILL, as a
`kill -9` landing between two lines would (no `finally`, no flush, no clean-up). The
test restarts the process and checks that nothing was lost or applied twice. Points
are named `<service>.<where>`; the ones that exist are listed in `POINTS`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

POINTS = {
    "gateway.direct_before_publish": "a call accepted under a direct lease (numbered, in "
    "the outbox) before its dispatch is published to the worker",
    "gateway.direct_published": "a direct call's dispatch acknowledged by Kafka, before "
    "it leaves the outbox (it is published again)",
    "scheduler.direct_granted": "a direct lease granted in Redis, before the scheduler "
    "holds the worker for it",
    "scheduler.direct_revoked": "a direct lease revoked in Redis, before the calls handed "
    "out under it are seen answered",
    "worker.direct_received": "a direct dispatch taken from Kafka, before anything of it runs",
    "worker.direct_committed": "a direct call committed to its job's ledger, before its "
    "completion is recorded or published",
    "worker.released_committed": "a preempted training call, released to the background, "
    "committed to its job's ledger before its completion is recorded or published (its "
    "dispatch acknowledged at the release)",
}


def failpoint(name: str) -> None:
    """Die here (SIGKILL) if the fault suite armed `name`; otherwise nothing. The
    directory is read on each call, not at import: a process forked after the import
    (plexrl_tools.preload) has its own environment."""
    directory = os.environ.get("PLEXRL_FAILPOINTS_DIR")
    if directory is None:
        return
    try:
        (Path(directory) / name).unlink()
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def arm(directory: Path, name: str) -> None:
    """Arm `name` for the processes started with `PLEXRL_FAILPOINTS_DIR=directory`."""
    if name not in POINTS:
        raise ValueError(f"no failpoint {name!r}; the known ones are {sorted(POINTS)}")
    (directory / name).touch()


def armed(directory: Path, name: str) -> bool:
    """Whether `name` is still armed (no process has reached it yet)."""
    return (directory / name).exists()
