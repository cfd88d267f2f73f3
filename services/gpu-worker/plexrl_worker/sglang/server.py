"""The SGLang server child process: start, health-check, stop.

SGLang runs in its own virtualenv (scripts/sglang.sh) because sglang==0.5.23 pins torch
and transformers to other versions than the project's lock; the worker talks to it over
HTTP on localhost. The child is the leader of its own process group, since SGLang forks a
scheduler and a detokenizer process that must go with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from plexrl_worker.sglang.errors import SGLangServerError

REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_PYTHON = REPO_ROOT / ".plexrl" / "sglang-venv" / "bin" / "python"


def sglang_python() -> Path:
    """The SGLang venv's interpreter: PLEXRL_SGLANG_PYTHON, else scripts/sglang.sh's."""
    return Path(os.environ.get("PLEXRL_SGLANG_PYTHON") or DEFAULT_PYTHON)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class SGLangServerConfig:
    """How to launch one SGLang server."""

    model_path: str
    """A Hugging Face model directory (config, tokenizer, safetensors)."""
    url: str | None = None
    """An SGLang server that runs already (a sidecar, or one shared by tests): attach to
    it instead of starting a child. Nothing here starts, restarts or stops it; `start`
    checks that it serves `model_path` with the LoRA settings asked for here."""
    python: Path = field(default_factory=sglang_python)
    """The SGLang venv's interpreter (scripts/sglang.sh installs it)."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port at each start."""
    device: str = "cpu"
    """`cpu` runs SGLang's torch-native paths (SGLANG_USE_CPU_ENGINE=1); `cuda` its kernels."""
    max_lora_rank: int = 0
    """0 starts without LoRA support; otherwise the largest adapter rank it will load."""
    max_loras_per_batch: int = 8
    """How many adapters one batch may mix (SGLang keeps this many slots in memory)."""
    lora_target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Modules an adapter may touch (Hugging Face names); SGLang's `all` adds the
    embedding and lm_head."""
    lora_backend: str | None = None
    """SGLang's LoRA kernels; None: `torch_native` on CPU (the others need Triton on a
    GPU), SGLang's default (`csgmv`) elsewhere."""
    max_total_tokens: int | None = 65536
    """KV cache size in tokens. Bounded by default: on CPU SGLang otherwise takes most of
    the free host memory for the KV pool (about 10 GB on a 24 GB machine)."""
    mem_fraction_static: float | None = None
    """Share of device memory for weights and KV cache (SGLang's default when None)."""
    enable_memory_saver: bool = False
    """CUDA only: lets release_memory_occupation hand device memory back (torch_memory_saver)."""
    tp_size: int = 1
    """Tensor-parallel ranks (`--tp-size`): a worker group's devices, one rank each."""
    nnodes: int = 1
    """Hosts the tensor-parallel ranks span (`--nnodes`); with more than one, every host
    runs the same command with its own `node_rank` and one `dist_init_addr`."""
    node_rank: int = 0
    dist_init_addr: str | None = None
    """`host:port` where SGLang's ranks meet across hosts (`--dist-init-addr`)."""
    startup_timeout_s: float = 600.0
    """How long a start may take before it counts as failed (CPU imports alone take minutes
    on a busy 2-core machine)."""
    log_path: Path | None = None
    """Where the child's stdout and stderr go; None discards them."""
    sleep_on_idle: bool = True
    """`--sleep-on-idle`: the server's scheduler waits on its sockets when it has nothing
    to do, instead of polling them in a loop (which holds a whole CPU core)."""
    extra_args: tuple[str, ...] = ()
    """More `sglang serve` flags, appended last."""

    def command(self, port: int) -> list[str]:
        cmd = [
            str(self.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(port),
            "--device",
            self.device,
            "--skip-server-warmup",
        ]
        if self.sleep_on_idle:
            cmd += ["--sleep-on-idle"]
        if self.device == "cpu":
            cmd += ["--attention-backend", "torch_native", "--disable-cuda-graph"]
        if self.max_lora_rank > 0:
            cmd += [
                "--enable-lora",
                "--max-lora-rank",
                str(self.max_lora_rank),
                "--max-loras-per-batch",
                str(self.max_loras_per_batch),
                "--lora-target-modules",
                *self.lora_target_modules,
            ]
            backend = self.lora_backend or ("torch_native" if self.device == "cpu" else None)
            if backend is not None:
                cmd += ["--lora-backend", backend]
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.enable_memory_saver:
            cmd += ["--enable-memory-saver"]
        if self.tp_size > 1:
            cmd += ["--tp-size", str(self.tp_size)]
        if self.nnodes > 1:
            cmd += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank)]
        if self.dist_init_addr is not None:
            cmd += ["--dist-init-addr", self.dist_init_addr]
        return [*cmd, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.device == "cpu":
            # SGLang's CPU engine: torch-native layers unless the Intel AMX kernels exist.
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        # The worker's own venv must not leak into the child's imports.
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        return env


class SGLangServer:
    """One child `sglang.launch_server`; `start` returns once /health_generate answers 200."""

    def __init__(
        self, config: SGLangServerConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: object | None = None
        self.port = 0
        self._ready = False
        self.starts = 0
        """How many times the child was started (1 + restarts); 1 once attached."""

    @property
    def attached(self) -> bool:
        """Serving through a server this process did not start (`config.url`)."""
        return self.config.url is not None

    @property
    def url(self) -> str:
        if self.config.url is not None:
            return self.config.url.rstrip("/")
        return f"http://{self.config.host}:{self.port}"

    def alive(self) -> bool:
        if self.attached:
            return self.starts > 0  # not ours to watch: its failures surface per call
        return self._proc is not None and self._proc.poll() is None

    def wait_exit(self, timeout_s: float) -> bool:
        """True once the child has exited (False if it still runs after `timeout_s`)."""
        if self.attached:
            return False
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def start(self) -> None:
        """Start the child (unless `launch` did) and wait until it generates."""
        if self.attached:
            if self.starts == 0:
                self._wait_healthy()
                check_attached(self.config, self._get("/server_info"))
                self.starts += 1
            return
        if self._ready and self.alive():
            return
        self.launch()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self._ready = True

    def launch(self) -> None:
        """Start the child without waiting for it to load (`start` then waits): the
        load runs in its own processes meanwhile."""
        if self.attached or self.alive():
            return
        if not self.config.python.exists():
            raise SGLangServerError(
                f"no SGLang interpreter at {self.config.python}; run scripts/sglang.sh "
                "(or set PLEXRL_SGLANG_PYTHON to an SGLang 0.5.23 venv's python)"
            )
        self.port = self.config.port or free_port(self.config.host)
        log_path = self.config.log_path
        out: int | object = subprocess.DEVNULL
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = out = log_path.open("ab")
        self._proc = subprocess.Popen(
            self.config.command(self.port),
            env=self.config.environment(),
            stdin=subprocess.DEVNULL,
            stdout=out,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._ready = False
        self.starts += 1

    def _get(self, route: str) -> dict[str, object]:
        r = httpx.get(self.url + route, timeout=30.0)
        if r.status_code != 200:
            raise SGLangServerError(f"SGLang {route} at {self.url} answered {r.status_code}")
        answer = r.json()
        if not isinstance(answer, dict):
            raise SGLangServerError(f"SGLang {route} at {self.url} answered {answer!r}")
        return answer

    def _wait_healthy(self) -> None:
        deadline = self._clock() + self.config.startup_timeout_s
        with httpx.Client(timeout=30.0) as client:
            while True:
                if not self.attached and not self.alive():
                    code = self._proc.returncode if self._proc is not None else None
                    raise SGLangServerError(
                        f"the SGLang server exited with status {code} while starting; "
                        f"see {self.config.log_path or 'its log (set log_path to keep it)'}"
                    )
                try:
                    if client.get(f"{self.url}/health_generate").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if self._clock() > deadline:
                    within = f"within {self.config.startup_timeout_s:.0f}s"
                    raise SGLangServerError(
                        f"no SGLang server answered /health_generate at {self.url} {within}; "
                        "start it, or unset PLEXRL_SGLANG_URL to let the worker start its own"
                        if self.attached
                        else f"the SGLang server did not answer /health_generate {within}; "
                        f"raise startup_timeout_s or see {self.config.log_path or 'its log'}"
                    )
                time.sleep(1.0)

    def healthy(self, timeout_s: float = 30.0) -> bool:
        """Alive and generating: SGLang's /health_generate runs one token when idle."""
        if not self.alive():
            return False
        try:
            r = httpx.get(f"{self.url}/health_generate", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the child and the scheduler and detokenizer processes it forked (an
        attached server is left running)."""
        if self.attached:
            self.starts = 0
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace_s)
        if proc is not None:
            # SGLang's children can outlive a leader killed from outside.
            _signal_group(proc.pid, signal.SIGKILL)
        log, self._log = self._log, None
        if log is not None:
            log.close()  # type: ignore[attr-defined]

    def kill(self) -> None:
        """Kill the child abruptly (what a crash looks like); for tests and chaos."""
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)


def check_attached(config: SGLangServerConfig, info: dict[str, object]) -> None:
    """Raise SGLangServerError, saying what differs, unless the running server whose
    /server_info is `info` serves `config.model_path` with the LoRA it asks for."""
    where = config.url or "the attached server"
    served = info.get("model_path")
    if not isinstance(served, str) or Path(served).resolve() != Path(config.model_path).resolve():
        raise SGLangServerError(
            f"the SGLang server at {where} serves {served!r}, not {config.model_path!r}; "
            "start it with --model-path set to this worker's base model directory"
        )
    if config.max_lora_rank <= 0:
        return
    rank = info.get("max_lora_rank")
    if not info.get("enable_lora") or not isinstance(rank, int) or rank < config.max_lora_rank:
        raise SGLangServerError(
            f"the SGLang server at {where} has enable_lora={info.get('enable_lora')!r}, "
            f"max_lora_rank={rank!r}; this worker needs --enable-lora --max-lora-rank "
            f"{config.max_lora_rank} or more"
        )
    targets = info.get("lora_target_modules")
    served_targets = set(targets) if isinstance(targets, list | tuple | set) else set()
    missing = set(config.lora_target_modules) - served_targets
    if "all" not in served_targets and missing:
        raise SGLangServerError(
            f"the SGLang server at {where} does not take LoRA on {sorted(missing)}; start "
            f"it with --lora-target-modules {' '.join(config.lora_target_modules)}"
        )


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
