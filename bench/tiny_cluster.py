"""What the live-scheduling benchmarks (fairness, preemption) share: a local cluster
of the tiny Qwen3 under the live policy, and a datum of given tokens for it."""

from __future__ import annotations

from pathlib import Path

from tinker import types

from plexrl.models import init_tiny
from plexrl_tools.cluster import ClusterConfig


def config(root: Path, prefix: str, workers: int, api_keys: str) -> ClusterConfig:
    """Build the tiny Qwen3 in `root`/models; a cluster of `workers` one-thread workers
    under the `plexrl` policy, its state in `root`/cluster."""
    init_tiny(root / "models" / "tiny-qwen3")
    return ClusterConfig.on_free_ports(
        root / "models",
        root / "cluster",
        prefix,
        workers=workers,
        api_keys=api_keys,
        worker_threads=1,
        policy="plexrl",
    )


def datum(tokens: list[int]) -> types.Datum:
    """A cross-entropy datum: each token after the first is the previous one's target."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")},
    )
