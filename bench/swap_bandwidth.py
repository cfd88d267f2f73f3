"""Tier bandwidths of a job-state swap, measured on this machine's device.

The simulator prices every swap from state bytes and tier bandwidths (`swap` in a
workload's `cluster`); this measures them for real: a full fine-tuning job (weights,
gradients, AdamW moments) of a locally built model on the engine's device, moved
device -> host and back by `TorchEngine.offload` / `onload` (what the worker's
residency manager calls), and host -> disk and back as the state store's safetensors
blob. Beside them, the raw copy speeds of the same number of bytes (pageable and
pinned host memory) show what the engine's path leaves on the table.

    .venv/bin/python bench/swap_bandwidth.py                 # CPU here: a small model
    python3 bench/swap_bandwidth.py --hidden 2048 --layers 16  # a ~1B model on a GPU

Ends with one JSON line of its figures (bytes per second, seconds per swap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_model
import torch

from plexrl.messages import (
    AdamParams,
    JobSpec,
    OptimStepInput,
)
from plexrl.models import ModelRegistry, TinyShape, init_tiny
from plexrl_worker.engine import EngineConfig, TorchEngine, state_from_bytes, state_to_bytes

GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` runs after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw_copies(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Bytes per second of plain copies of `nbytes` between host and device memory."""
    n = nbytes // 4
    out: dict[str, float] = {}
    if device.type != "cuda":
        src, dst = torch.empty(n), torch.empty(n)
        out["memcpy"] = nbytes / _timed(partial(dst.copy_, src), device, repeats)
        return out
    on_device = torch.empty(n, device=device)
    for kind, pin in (("pageable", False), ("pinned", True)):
        host = torch.empty(n, pin_memory=pin)
        d2h = partial(host.copy_, on_device)
        h2d = partial(on_device.copy_, host)
        out[f"{kind}_d2h"] = nbytes / _timed(d2h, device, repeats)
        out[f"{kind}_h2d"] = nbytes / _timed(h2d, device, repeats)
        del host, d2h, h2d
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=0, help="default 4 x hidden")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    heads = max(args.hidden // 128, 4)
    shape = TinyShape(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=heads // 2 if heads % 2 == 0 else heads,
    )
    with tempfile.TemporaryDirectory(prefix="plexrl-swap-") as tmp:
        root = Path(tmp)
        print(f"building a {args.layers}-layer, {args.hidden}-wide model ...", file=sys.stderr)
        init_tiny(root / "models" / "bench", shape=shape)
        registry = ModelRegistry(root / "models")
        engine = TorchEngine(registry, EngineConfig(device=device_name))
        spec = JobSpec(base_model="plexrl/tiny-qwen3", lora=None, seed=1)
        engine.create("job", spec)
        # One training step so that gradients and AdamW moments exist: a full state.
        engine.forward_backward("job", bench_model.batch(shape.vocab_size, 4, 32))
        engine.optim_step("job", OptimStepInput(adam=AdamParams(learning_rate=1e-4)))
        engine.forward_backward("job", bench_model.batch(shape.vocab_size, 4, 32))
        state = engine.offload("job")
        nbytes = sum(t.numel() * t.element_size() for t in state.tensors.values())
        params = (
            sum(t.numel() for k, t in state.tensors.items() if k.startswith("weights."))
            or nbytes // 16
        )

        def round_trip() -> None:
            engine.onload("job", state)
            engine.offload("job")

        # Each timed call does one move each way; time them apart by subtracting.
        both_s = _timed(round_trip, device, args.repeats)
        engine.onload("job", state)
        start = time.perf_counter()
        engine.offload("job")
        _sync(device)
        offload_s = time.perf_counter() - start
        start = time.perf_counter()
        engine.onload("job", state)
        _sync(device)
        onload_s = time.perf_counter() - start
        blob = root / "state.safetensors"

        def write() -> None:
            data = state_to_bytes(state)
            with blob.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        write_s = _timed(write, torch.device("cpu"), args.repeats)
        read_s = _timed(
            lambda: state_from_bytes(blob.read_bytes()), torch.device("cpu"), args.repeats
        )
        raw = raw_copies(nbytes, device, args.repeats)
    figures: dict[str, object] = {
        "bench": "swap_bandwidth",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": params,
        "state_bytes": nbytes,
        "engine_round_trip_s": both_s,
        "engine_offload_s": offload_s,
        "engine_onload_s": onload_s,
        "engine_offload_bytes_per_s": nbytes / offload_s,
        "engine_onload_bytes_per_s": nbytes / onload_s,
        "engine_round_trip_bytes_per_s": 2 * nbytes / both_s,
        "disk_write_bytes_per_s": nbytes / write_s,
        "disk_read_bytes_per_s": nbytes / read_s,
        **{f"raw_{k}_bytes_per_s": v for k, v in raw.items()},
    }
    print(f"state: {nbytes / GB:.2f} GB ({params / 1e6:.0f} M parameters) on {figures['device']}")
    print("| move | GB/s |")
    print("|---|---:|")
    for key, value in figures.items():
        if key.endswith("bytes_per_s"):
            print(f"| {key[: -len('_bytes_per_s')]} | {float(value) / GB:.2f} |")  # type: ignore[arg-type]
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
