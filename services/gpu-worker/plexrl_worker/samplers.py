"""Which sampler a worker's `sample` calls go through (`PLEXRL_SAMPLER`).

- `torch` (default): the torch engine's co-batching decode loop (`engine.cobatch`), bit-
  identical per job whatever shares the batch, seeded per sample.
- `sglang`: an SGLang server per base model (`plexrl_worker.sglang`), started with the
  worker, or one that runs already (`PLEXRL_SGLANG_URL`: attached, never restarted or
  stopped by the worker; its weights are pushed back to the base before a base sample).
  The torch engine still trains and still installs sampler weights from checkpoints;
  this side hands them to SGLang: LoRA weights as a named adapter (loaded once per
  sampler path: a path's weights never change), full weights pushed in place
  (`update_weights_from_disk`, never a restart), the base model by pushing its own
  weights back when another full set was pushed last. Calls run at once and SGLang
  batches them (across adapters too). An RL loop saves new sampler weights every step,
  so at most `max_adapters` adapters stay loaded: beyond that the least recently
  sampled ones that no call is reading are unloaded (and their files removed); a later
  call on one loads it again.

  With `yield_device` (PLEXRL_SGLANG_YIELD), SGLang hands the device to training: before
  a training call that finds no sample running, every server releases its weights and
  KV cache (`release_memory_occupation`); the next sample takes them back first
  (`resume_memory_occupation`). What it serves does not change across the round trip.

The gateway, the policy and the Tinker API do not change with the sampler; the worker
reports which one it runs in its heartbeat.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from plexrl.messages import JobSpec, SampleInput, SampleOutput
from plexrl.models import ModelRegistry
from plexrl_worker import metrics
from plexrl_worker.engine import BASE_PREFIX
from plexrl_worker.sglang.files import write_full_weights, write_lora_adapter
from plexrl_worker.sglang.sampler import SGLangSampler
from plexrl_worker.sglang.server import SGLangServerConfig

SAMPLERS = ("torch", "sglang")

SamplerWeights = Callable[[str], tuple[JobSpec, Path, dict[str, torch.Tensor]]]
"""An installed sampler set's spec, base directory and weights, by its id (the torch
side installs every set; SGLang loads them from there)."""


class SGLangSampling:
    """Sample calls through SGLang; thread-safe (`sample` runs on many threads at once)."""

    kind = "sglang"

    def __init__(
        self,
        weights: SamplerWeights,
        registry: ModelRegistry,
        workdir: Path,
        *,
        device: str = "cpu",
        max_lora_rank: int = 64,
        yield_device: bool = False,
        max_adapters: int = 64,
        attach_url: str | None = None,
        tp_size: int = 1,
    ) -> None:
        self.yield_device = yield_device
        self._max_adapters = max_adapters
        self._adapters_lock = threading.Lock()
        """Guards `_recent` and `_reading`, and is held while an adapter is loaded or
        unloaded, so no call starts reading one that is being unloaded."""
        self._recent: dict[str, SGLangSampler] = {}
        """Loaded adapters by name (and the server holding each), least recently used
        first."""
        self._reading: dict[str, int] = {}
        """Calls sampling through each adapter now: never unloaded under them."""
        self._weights = weights
        self._registry = registry
        self._workdir = workdir
        self._device = device
        self._max_lora_rank = max_lora_rank
        self._attach_url = attach_url
        self._tp_size = tp_size
        """Tensor-parallel ranks of each server: a worker group's devices."""
        self._servers: dict[Path, SGLangSampler] = {}
        self._pushed: dict[Path, Path | None] = {}
        """Per base model, the full weights pushed into its server last (absent: its own;
        None: not known, as on a server the worker attached to)."""
        self._lock = threading.Lock()
        self._full_lock = threading.Lock()
        """Held while a call samples pushed full weights: one set at a time per server."""
        self._hand = threading.Lock()
        """Guards `_running` and the release / resume of the servers' memory."""
        self._running = 0
        """Sample calls inside SGLang now: the memory is never released under them."""

    def start(self) -> None:
        """Start a server for every base model (minutes each on CPU)."""
        for name in self._registry.models():
            self._server(self._registry.resolve(name))

    def stop(self) -> None:
        with self._lock:
            for server in self._servers.values():
                server.stop()
            self._servers.clear()

    def release_for_training(self) -> bool:
        """Release every server's device memory to a training call, unless a sample is
        running or `yield_device` is off; True when something was released."""
        if not self.yield_device:
            return False
        with self._hand:
            if self._running:
                return False
            with self._lock:
                servers = [s for s in self._servers.values() if not s.released]
            for server in servers:
                server.release_memory()
                metrics.SGLANG_RELEASES.inc()
            return bool(servers)

    def pause(self) -> None:
        """Pause generation on every server (a preempted batch, `plexrl_worker.preemption`):
        running requests are retracted (their KV cache freed) and wait; they finish with
        the same tokens after `resume`."""
        with self._lock:
            servers = list(self._servers.values())
        for server in servers:
            server.pause_generation("retract")

    def resume(self) -> None:
        with self._lock:
            servers = list(self._servers.values())
        for server in servers:
            server.continue_generation()

    def sample(self, weights_id: str, inp: SampleInput) -> SampleOutput:
        """`sample` of the weights the torch engine knows as `weights_id` (installed)."""
        with self._hand:
            self._running += 1
            with self._lock:
                released = [s for s in self._servers.values() if s.released]
            try:
                for server in released:  # taken back before any sample runs on it
                    server.resume_memory()
            except BaseException:
                self._running -= 1
                raise
        try:
            return self._sample(weights_id, inp)
        finally:
            with self._hand:
                self._running -= 1

    def _sample(self, weights_id: str, inp: SampleInput) -> SampleOutput:
        if weights_id.startswith(BASE_PREFIX):
            base = self._registry.resolve(weights_id.removeprefix(BASE_PREFIX))
            server = self._server(base)
            with self._full_lock:
                if self._pushed.get(base, base) != base:
                    server.push_weights(base)
                    self._pushed[base] = base
                return server.sample(inp)
        spec, base, tensors = self._weights(weights_id)
        server = self._server(base)
        name = "w" + hashlib.sha256(weights_id.encode()).hexdigest()[:16]
        if spec.lora is not None:
            with self._adapters_lock:
                if name not in server.adapters:
                    rank = spec.lora.rank
                    alpha = float(spec.lora.alpha if spec.lora.alpha is not None else rank)
                    path = write_lora_adapter(
                        self._workdir / name, tensors, rank=rank, alpha=alpha, base_model=str(base)
                    )
                    server.load_adapter(name, path)
                self._recent.pop(name, None)
                self._recent[name] = server
                self._reading[name] = self._reading.get(name, 0) + 1
            try:
                return server.sample(inp, adapter=name)
            finally:
                with self._adapters_lock:
                    self._reading[name] -= 1
                    if not self._reading[name]:
                        del self._reading[name]
                    self._trim_adapters()
        with self._full_lock:
            path = self._workdir / name
            if self._pushed.get(base, base) != path:
                write_full_weights(path, tensors, base_model_dir=base)
                server.push_weights(path)
                self._pushed[base] = path
            return server.sample(inp)

    def _trim_adapters(self) -> None:
        """Unload the least recently used adapters beyond `max_adapters` that no call is
        reading (with `_adapters_lock` held)."""
        excess = len(self._recent) - self._max_adapters
        idle = [n for n in self._recent if n not in self._reading][: max(excess, 0)]
        for name in idle:
            server = self._recent.pop(name)
            server.unload_adapter(name)
            shutil.rmtree(self._workdir / name, ignore_errors=True)
            metrics.SGLANG_ADAPTERS_UNLOADED.inc()

    @property
    def loaded_adapters(self) -> list[str]:
        """Adapter names loaded now, least recently used first."""
        with self._adapters_lock:
            return list(self._recent)

    def _server(self, base: Path) -> SGLangSampler:
        with self._lock:
            server = self._servers.get(base)
            if server is None:
                config = SGLangServerConfig(
                    model_path=str(base),
                    url=self._attach_url,
                    device=self._device,
                    max_lora_rank=self._max_lora_rank,
                    # Without it a release on a GPU would mark the engine, not free memory.
                    enable_memory_saver=self.yield_device and self._device != "cpu",
                    # The tinker SDK trains the unembedding by default (train_unembed).
                    lora_target_modules=(*SGLangServerConfig.lora_target_modules, "lm_head"),
                    log_path=self._workdir / f"sglang-{base.name}.log",
                    tp_size=self._tp_size,
                )
                self._workdir.mkdir(parents=True, exist_ok=True)
                server = self._servers[base] = SGLangSampler(config)
                server.start()
                if server.server.attached:  # whatever it serves, it may not be the base
                    self._pushed[base] = None
            server.ensure_running()
            return server
