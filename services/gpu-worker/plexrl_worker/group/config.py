"""How a worker group starts: its size, its devices and its rendezvous."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class GroupConfig:
    """One group of ranks on one host; rank r runs on device r of `device_type`."""

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

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size is {self.world_size}; a group has at least one rank")
        if self.device_type == "cuda":
            if self.start_method != "spawn":
                raise ValueError("CUDA ranks cannot be forked; use start_method='spawn'")
            have = torch.cuda.device_count()
            if have < self.world_size:
                raise ValueError(
                    f"world_size {self.world_size} needs {self.world_size} CUDA devices, but "
                    f"{have} are visible; lower world_size or use device_type='cpu'"
                )
        if self.collective_timeout_s <= 0 or self.rendezvous_timeout_s <= 0:
            raise ValueError("timeouts must be positive seconds")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads is {self.num_threads}; use 1 or more, or None")

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self, rank: int) -> str:
        """The torch device of `rank`."""
        return f"cuda:{rank}" if self.device_type == "cuda" else "cpu"
