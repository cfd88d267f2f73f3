"""PlexRL beside a public Tinker-API server: the same SDK workload, the same machine.

    scripts/peer.sh && scripts/sdk_matrix.sh && scripts/infra.sh up     # once
    .venv/bin/python bench/peer.py                  # K = 1 and 4 jobs, 20 steps each

The peer is SkyRL's tx (`skyrl-tx` 0.3.0 from PyPI, in its own virtualenv: scripts/peer.sh),
a Tinker API server whose JAX backend trains and samples many LoRA adapters of one base
model together. PlexRL runs as one gpu-worker with the four services. Both serve the same
tiny Qwen3 (random weights: this measures speed, not learning) and are driven by the same
client: K jobs at once, each a LoRA training client of rank 8 running GRPO-style steps —
save weights for sampling, 8 prompts × 4 samples × 16 tokens, then `forward_backward`
(importance_sampling) over the 32 sequences and `optim_step` — through the tinker SDK
0.16.1 (scripts/sdk_matrix.sh's side install; tx 0.3.0 predates the `client/config` route
newer SDKs call first). The figure is the steps of all K jobs together per second while
every job is past its first `--warmup` steps and none has finished (`steady`; the peer
compiles its JAX programs for each new shape in its first steps), with the whole run's
rate beside it; each server is measured in turn, alone on the machine.

What is adapted for the peer, in a copy of the model it gets: tx reads configs the way
transformers 4 writes them (`rope_theta` at the top level, a tokenizer class that 4.x
knows), and it starts its engine as `uv run --extra … -m tx.tinker.engine`, which assumes
a source checkout: a `uv` on its PATH runs the module with the peer's own Python instead.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / ".plexrl" / "sdk" / "tinker-0.16.1"
PEER_PYTHON = ROOT / ".plexrl" / "peer-venv" / "bin" / "python"
KEY = "tml-bench-peer"
PROMPTS, SAMPLES, TOKENS, RANK = 8, 4, 16, 8


# The client: runs under the old SDK, in a process of its own ---------------------------------


def client_main(url: str, model: str, jobs: int, steps: int) -> None:
    """K jobs at once against `url`; prints each job's step end times as one JSON line."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=KEY)

    def job(seed: int) -> list[float]:
        rng = random.Random(seed)
        client = service.create_lora_training_client(base_model=model, rank=RANK)
        params = types.SamplingParams(max_tokens=TOKENS, temperature=1.0)
        adam = types.AdamParams(learning_rate=1e-4)
        ends = []
        for _ in range(steps):
            sampler = client.save_weights_and_get_sampling_client()
            if hasattr(sampler, "result"):  # a future in later SDKs
                sampler = sampler.result()
            prompts = [[rng.randrange(3, 700) for _ in range(8)] for _ in range(PROMPTS)]
            futures = [
                sampler.sample(types.ModelInput.from_ints(p), SAMPLES, params) for p in prompts
            ]
            data = []
            for prompt, future in zip(prompts, futures, strict=True):
                sequences = future.result().sequences
                # A verifiable stand-in reward: the share of even tokens.
                rewards = [
                    sum(t % 2 == 0 for t in s.tokens) / max(len(s.tokens), 1) for s in sequences
                ]
                mean = sum(rewards) / len(rewards)
                for seq, reward in zip(sequences, rewards, strict=True):
                    tokens = prompt + list(seq.tokens)
                    pad = [0.0] * (len(prompt) - 1)
                    data.append(
                        types.Datum(
                            model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={
                                "target_tokens": tokens[1:],
                                "logprobs": pad + list(seq.logprobs or [0.0] * len(seq.tokens)),
                                "advantages": pad + [reward - mean] * len(seq.tokens),
                            },
                        )
                    )
            client.forward_backward(data, "importance_sampling").result()
            client.optim_step(adam).result()
            ends.append(time.monotonic())
        return ends

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        ends = list(pool.map(job, range(jobs)))
    print(json.dumps({"ends": ends}))


def drive(url: str, model: str, jobs: int, steps: int, warmup: int) -> dict[str, Any]:
    """Run the client under SDK 0.16.1; each job's steady steps/s and their sum."""
    env = {**os.environ, "PYTHONPATH": str(SDK), "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    cmd = [sys.executable, __file__, "--client", url, model, str(jobs), str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the client failed against {url}:\n{done.stderr[-3000:]}")
    ends: list[list[float]] = json.loads(done.stdout.strip().splitlines()[-1])["ends"]
    return steady(ends, warmup)


def steady(ends: list[list[float]], warmup: int) -> dict[str, Any]:
    """Steps per second of all jobs together while every job was past its first `warmup`
    steps and none had finished: the step ends inside (latest end of a job's step
    `warmup`, earliest end of a job's last step], over that window's length (the peer
    compiles its JAX programs for each new shape in its first steps). Also the rate from
    the first step's end to the last (warm-up included), and each job's step seconds."""
    start, stop = max(e[warmup - 1] for e in ends), min(e[-1] for e in ends)
    inside = sum(1 for e in ends for t in e if start < t <= stop)
    if stop <= start or inside == 0:
        raise SystemExit("the jobs did not overlap past their warm-up; raise --steps")
    first, last = min(e[0] for e in ends), max(e[-1] for e in ends)
    whole = sum(len(e) - 1 for e in ends) / (last - first)
    steps = [[round(b - a, 3) for a, b in pairwise(e)] for e in ends]
    return {
        "steps_per_s": round(inside / (stop - start), 3),
        "whole_run_steps_per_s": round(whole, 3),
        "step_s": steps,
    }


# The servers -----------------------------------------------------------------------------


def peer_model(src: Path, dst: Path) -> Path:
    """A copy of the model whose config and tokenizer config transformers 4 reads."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 1e6))
    config.setdefault("rope_scaling", None)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in tok:
        tok["additional_special_tokens"] = tok.pop("extra_special_tokens")
    (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Peer:
    """The tx server as a child process, on a port of its own."""

    def __init__(self, model: Path, work: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        shim = work / "bin"
        shim.mkdir()
        # tx starts its engine with `uv run --extra tinker --extra jax -m tx.tinker.engine
        # ...` (a source checkout's command); this `uv` runs the module with its Python.
        (shim / "uv").write_text(
            '#!/bin/sh\n[ "$1" = run ] && shift\n'
            'while [ "$1" = --extra ]; do shift 2; done\n'
            f'exec "{PEER_PYTHON}" "$@"\n'
        )
        (shim / "uv").chmod(0o755)
        env = {
            **os.environ,
            "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}",
            "HF_HUB_OFFLINE": "1",
            "JAX_PLATFORMS": "cpu",
        }
        cmd = [
            str(PEER_PYTHON), "-m", "tx.tinker.api", "--base-model", str(model),
            "--port", str(port), "--host", "127.0.0.1",
            "--database-url", f"sqlite:///{work / 'tx.db'}",
            "--checkpoints-base", str(work / "checkpoints"),
            "--backend-config", json.dumps({"max_lora_rank": RANK, "max_lora_adapters": 16}),
        ]  # fmt: skip
        self.log = (work / "tx.log").open("w")
        # A session of its own, so closing it stops the engine process tx starts too.
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait(work / "tx.log")

    def _wait(self, log: Path) -> None:
        import httpx

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the peer exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"the peer did not answer in 300 s; see {log}")

    def close(self) -> None:
        """Stop the API server and its engine (its whole process group)."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine, if it outlived the server
        self.proc.wait()
        self.log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", default="1,4", help="comma list of K, jobs at once")
    p.add_argument("--steps", type=int, default=20, help="steps per job")
    p.add_argument("--warmup", type=int, default=10, help="steps per job left out of the rate")
    p.add_argument("--threads", type=int, default=2, help="torch threads of PlexRL's worker")
    args = p.parse_args()
    for need, how in ((PEER_PYTHON, "scripts/peer.sh"), (SDK, "scripts/sdk_matrix.sh")):
        if not need.exists():
            raise SystemExit(f"{need} is missing; run {how} first")
    from plexrl.models import init_tiny
    from plexrl_tools.cluster import ClusterConfig, LocalCluster

    ks = [int(k) for k in args.jobs.split(",")]
    figures: dict[str, dict[int, dict[str, Any]]] = {"plexrl": {}, "peer": {}}
    with tempfile.TemporaryDirectory(prefix="plexrl-bench-peer-") as tmp:
        work = Path(tmp)
        name = "plexrl/tiny-qwen3"
        model = init_tiny(work / "models" / "tiny", name=name)
        config = ClusterConfig.on_free_ports(
            work / "models", work / "cluster", "peer", workers=1,
            worker_threads=args.threads, api_keys=f"{KEY}=bench",
        )  # fmt: skip
        print(f"PlexRL: one worker, {args.threads} torch threads", flush=True)
        with LocalCluster(config):
            for k in ks:
                figures["plexrl"][k] = drive(config.gateway_url, name, k, args.steps, args.warmup)
                print(f"  K={k}: {figures['plexrl'][k]}", flush=True)
        print("peer: skyrl-tx 0.3.0, JAX on CPU", flush=True)
        (work / "peer").mkdir()
        peer = Peer(peer_model(model, work / "peer" / "model"), work / "peer")
        try:
            for k in ks:
                figures["peer"][k] = drive(
                    peer.url, str(work / "peer" / "model"), k, args.steps, args.warmup
                )
                print(f"  K={k}: {figures['peer'][k]}", flush=True)
        finally:
            peer.close()

    print(
        f"\n{'K jobs':>6} {'PlexRL steps/s':>15} {'peer steps/s':>13} {'PlexRL / peer':>14}"
        f" {'whole run: PlexRL / peer':>25}"
    )
    ratios, whole = {}, {}
    for k in ks:
        ours, theirs = figures["plexrl"][k], figures["peer"][k]
        ratios[k] = round(ours["steps_per_s"] / theirs["steps_per_s"], 3)
        whole[k] = round(ours["whole_run_steps_per_s"] / theirs["whole_run_steps_per_s"], 3)
        print(
            f"{k:>6} {ours['steps_per_s']:>15.3f} {theirs['steps_per_s']:>13.3f} "
            f"{ratios[k]:>13.2f}x {whole[k]:>24.2f}x"
        )
    print(
        json.dumps(
            {
                "benchmark": "peer",
                "peer": "skyrl-tx 0.3.0",
                "sdk": "tinker 0.16.1",
                "steps": args.steps,
                "warmup": args.warmup,
                "plexrl_threads": args.threads,
                "figures": figures,
                "plexrl_over_peer": ratios,
                "plexrl_over_peer_whole_run": whole,
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
