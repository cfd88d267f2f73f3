"""The command channel: the leader's calls to every rank, and every rank's answer.

Bytes travel as uint8 tensors over a CPU (gloo) process group, so the channel works
the same under NCCL: only the model's collectives use the device group. Each transfer
is two collectives (its length, then its bytes); a dead peer makes either one raise
(gloo sees the closed socket at once; a hung peer is caught by the group's timeout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Channel:
    """Broadcast from rank 0; gather to rank 0. Every rank must make the same calls."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0 passes the payload; every rank gets it back."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        buffer = torch.empty(int(size), dtype=torch.uint8)
        if self.rank == 0:
            assert payload is not None
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        dist.broadcast(buffer, src=0, group=self._group)
        return buffer.numpy().tobytes()

    def gather(self, payload: bytes) -> list[bytes] | None:
        """Every rank's payload, in rank order, on rank 0; None on the others."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self._group)
        width = max(int(s) for s in sizes)
        buffer = torch.zeros(width, dtype=torch.uint8)
        if payload:
            buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = (
            [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
            if self.rank == 0
            else None
        )
        dist.gather(buffer, gathered, dst=0, group=self._group)
        if gathered is None:
            return None
        return [g[: int(s)].numpy().tobytes() for g, s in zip(gathered, sizes, strict=True)]
