"""A worker group's rank side: N ranks, one device each, training jobs sharded with
FSDP2 and swapping or snapshotting each rank's own shard. See docs/worker_group.md."""

from plexrl_worker.group.config import GroupConfig
from plexrl_worker.group.launch import GroupCallError, Leader, RankLostError, start_group
from plexrl_worker.group.rank import RankEngine

__all__ = ["GroupCallError", "GroupConfig", "Leader", "RankEngine", "RankLostError", "start_group"]
