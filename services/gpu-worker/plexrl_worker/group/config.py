"""How a worker group starts: its size, its devices and its rendezvous."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class GroupConfig:
    """One group of ranks; rank r runs on device r of `device_type` of the leader's
    host, or (from `local_ranks` on) on another host's devices."""

    world_size: int = 2
    """Ranks in the group, one process and one device each; rank 0 leads."""
    device_type: Literal["cpu", "cuda"] = "cpu"
    """`cpu`: every rank on the CPU, joined by gloo. `cuda`: rank r on `cuda:r`, joined
    by NCCL (the command channel still goes over gloo, on the host)."""
    master_addr: str = "127.0.0.1"
    """Address of the rendezvous store the leader serves."""
    master_port: int = 0
    """Port of the rendezvous store; 0 lets the leader's store pick a free one."""
    rendezvous_timeout_s: float = 60.0
    """How long the leader waits for every rank to join (a rank that fails to start
    surfaces as an error after this long, with its exit code)."""
    collective_timeout_s: float = 30.0
    """The longest any collective may wait for a peer. A dead peer is usually seen at
    once (its sockets close); a hung one after this long. Keep it above the longest
    compute one rank may do between two collectives."""
    start_method: Literal["spawn", "forkserver"] = "spawn"
    """How follower processes start. `forkserver` imports torch and the engine once in a
    server process and forks each rank from it (seconds saved per rank on a busy host;
    CPU only). Plain `fork` is not offered: a process that has run autograd cannot fork
    a child that runs it. CUDA needs `spawn`."""
    num_threads: int | None = None
    """Intra-op CPU threads per rank (None: torch's default). Ranks sharing a host's
    cores should split them: oversubscribed cores make each rank several times slower."""
    local_ranks: int | None = None
    """Ranks the leader starts on its own host (0 .. local_ranks - 1, None: all of them);
    the others are started on their hosts (`launch.follow`) and join the rendezvous,
    which then needs a fixed `master_port` reachable from there."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size is {self.world_size}; a group has at least one rank")
        if self.device_type == "cuda":
            if self.start_method != "spawn":
                raise ValueError("CUDA ranks cannot be forked; use start_method='spawn'")
            have = torch.cuda.device_count()
            if have < self.started_here:
                raise ValueError(
                    f"{self.started_here} ranks on this host need as many CUDA devices, but "
                    f"{have} are visible; lower world_size (or local_ranks) or use "
                    "device_type='cpu'"
                )
        if self.collective_timeout_s <= 0 or self.rendezvous_timeout_s <= 0:
            raise ValueError("timeouts must be positive seconds")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads is {self.num_threads}; use 1 or more, or None")
        if self.local_ranks is not None and not 1 <= self.local_ranks <= self.world_size:
            raise ValueError(
                f"local_ranks is {self.local_ranks}; it must be 1 to world_size "
                f"({self.world_size}), or None for every rank on this host"
            )
        if self.started_here < self.world_size and not self.master_port:
            raise ValueError(
                "ranks on other hosts need a fixed rendezvous port: set master_port "
                "(PLEXRL_WORKER_RENDEZVOUS_PORT)"
            )

    @property
    def started_here(self) -> int:
        """Ranks the leader starts on its own host."""
        return self.world_size if self.local_ranks is None else self.local_ranks

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self, rank: int) -> str:
        """The torch device of `rank` (on another host: its index among that host's)."""
        if self.device_type != "cuda":
            return "cpu"
        return f"cuda:{rank if rank < self.started_here else rank - self.started_here}"
