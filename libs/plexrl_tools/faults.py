"""A fixed multi-job LoRA workload through the Tinker SDK, for fault injection.

The fault suite (tests/test_faults.py) and the chaos benchmark (bench/chaos.py) run
it once undisturbed and again while killing services, and compare: every call
answered (none lost), each job's optimizer step counter 1, 2, ... N (none applied
twice or skipped), and every loss and the saved checkpoint's bytes identical.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASE = "plexrl/tiny-qwen3"


@dataclass(frozen=True)
class Workload:
    """What each job does: `steps` of forward_backward + optim_step, then save_state."""

    seeds: tuple[int, ...] = (1, 2)
    """One LoRA job per seed (adapter init and data both follow it)."""
    steps: int = 4
    rank: int = 8
    base_model: str = BASE
    learning_rate: float = 5e-3
    call_timeout_s: float = 300.0
    """Longest the client waits for one call's result: a call never answered counts as
    lost (and says so) instead of holding the run forever."""


@dataclass
class JobOutcome:
    seed: int
    model_id: str = ""
    losses: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    """The `step:max` each optim_step reported: 1..N when no step ran twice."""
    checkpoint_sha256: str = ""
    errors: list[str] = field(default_factory=list)
    """Calls the client saw fail (a lost call, from the client's side)."""
    call_s: list[float] = field(default_factory=list)
    """Wall seconds of each training step (forward_backward + optim_step)."""
    client: Any = None
    """The job's training client, to call it again."""


@dataclass(frozen=True)
class Comparison:
    lost: int
    """Calls that failed or never answered."""
    duplicated: int
    """Optimizer steps applied more than once (or skipped)."""
    not_identical: int
    """Jobs whose losses or checkpoint bytes differ from the undisturbed run."""


def batch(seed: int, step: int) -> list[Any]:
    return random_data(seed * 1000 + step, 2, (6, 12))


def random_data(seed: int, count: int, lengths: tuple[int, int]) -> list[Any]:
    """`count` cross-entropy datums (SDK types) of random tokens drawn from `seed`, each
    sequence `lengths[0]` to `lengths[1] - 1` tokens long, every target weighted 1."""
    from tinker import types

    rng = random.Random(seed)
    data = []
    for _ in range(count):
        tokens = [rng.randrange(5, 600) for _ in range(rng.randrange(*lengths))]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                    "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32"),
                },
            )
        )
    return data


class StoreCheckpoints:
    """A tenant's checkpoint bytes read through the state-store's API, whatever keeps its
    blobs (a directory, or the object store of the host bed); `urls` are tried in turn."""

    def __init__(self, urls: list[str], token: str) -> None:
        self._urls = urls
        self._headers = {"authorization": f"Bearer {token}"}

    def sha256(self, tenant: str, model_id: str, name: str) -> str:
        import httpx

        path = f"tinker://{model_id.replace('tinker://', '')}/weights/{name}"
        headers = {**self._headers, "x-plexrl-tenant": tenant}
        for url in self._urls:
            try:
                listed = httpx.get(f"{url}/v1/checkpoints", headers=headers, timeout=30)
                listed.raise_for_status()
                for record in listed.json():
                    if record["path"] == path:
                        blob = httpx.get(
                            f"{url}/v1/blobs/{record['blob_key']}", headers=headers, timeout=60
                        )
                        blob.raise_for_status()
                        return hashlib.sha256(blob.content).hexdigest()
                return ""
            except httpx.HTTPError:
                continue  # that replica is away: the next
        return ""


Checkpoints = Path | StoreCheckpoints
"""Where a run's checkpoints are read: the state-store's blob directory, or its API."""


def checkpoint_sha256(blobs: Checkpoints, tenant: str, model_id: str, name: str) -> str:
    """The sha256 of a `save_state(name)` checkpoint's bytes: read through the
    state-store's API, or in its directory (found through the copy of its record the
    state-store keeps beside the blobs)."""
    if isinstance(blobs, StoreCheckpoints):
        return blobs.sha256(tenant, model_id, name)
    path = f"tinker://{model_id.replace('tinker://', '')}/weights/{name}"
    for copy in sorted((blobs / "#records" / "ckpt" / tenant).rglob("*.json")):
        record = json.loads(copy.read_bytes())
        blob = blobs / record["blob_key"]
        if record["path"] == path and blob.is_file():
            return hashlib.sha256(blob.read_bytes()).hexdigest()
    return ""


def run_job(
    service: Any,
    workload: Workload,
    seed: int,
    blobs: Checkpoints,
    tenant: str,
    on_step: Callable[[JobOutcome, int], None] | None = None,
) -> JobOutcome:
    from tinker import types

    out = JobOutcome(seed)
    adam = types.AdamParams(learning_rate=workload.learning_rate)
    # The call whose answer the job waits for: a lost call's report names it.
    waiting = "create_lora_training_client"
    try:
        wait = workload.call_timeout_s
        client = service.create_lora_training_client(
            base_model=workload.base_model, rank=workload.rank, seed=seed
        ).result(timeout=wait)
        out.model_id, out.client = client.model_id, client
        for step in range(workload.steps):
            start = time.perf_counter()
            fb = client.forward_backward(batch(seed, step), "cross_entropy")
            opt = client.optim_step(adam)
            waiting = f"forward_backward of step {step + 1}"
            out.losses.append(float(fb.result(timeout=wait).metrics["loss:sum"]))
            waiting = f"optim_step of step {step + 1}"
            out.steps.append(int(opt.result(timeout=wait).metrics["step:max"]))
            out.call_s.append(time.perf_counter() - start)
            if on_step is not None:  # after each step, from the job's own thread
                on_step(out, step + 1)
        name = f"final-{seed}"
        waiting = "save_state"
        client.save_state(name).result(timeout=wait)
        out.checkpoint_sha256 = checkpoint_sha256(blobs, tenant, out.model_id, name)
    except TimeoutError:
        out.errors.append(
            f"a call was not answered within {workload.call_timeout_s:g} s: {waiting}"
            + (f" of {out.model_id}" if out.model_id else "")
        )
    except Exception as exc:  # the client saw an error: the fault lost a call
        out.errors.append(f"{waiting}: {type(exc).__name__}: {exc}")
    return out


def run_workload(
    service: Any,
    workload: Workload,
    blobs: Checkpoints,
    tenant: str,
    on_step: Callable[[JobOutcome, int], None] | None = None,
) -> list[JobOutcome]:
    """Every job at once, one thread each (so they share the workers), in seed order."""
    outcomes: dict[int, JobOutcome] = {}

    def one(seed: int) -> None:
        outcomes[seed] = run_job(service, workload, seed, blobs, tenant, on_step)

    threads = [threading.Thread(target=one, args=(s,)) for s in workload.seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [outcomes[s] for s in workload.seeds]


def differences(reference: list[JobOutcome], disturbed: list[JobOutcome]) -> list[str]:
    """How each job that is not bit-identical differs from its undisturbed run."""
    found = []
    for ref, got in zip(reference, disturbed, strict=True):
        if got.losses != ref.losses:
            first = next(
                (i for i, (a, b) in enumerate(zip(ref.losses, got.losses, strict=False)) if a != b),
                min(len(ref.losses), len(got.losses)),
            )
            found.append(f"job {got.seed}: losses differ from step {first + 1}")
        elif got.checkpoint_sha256 == "":
            found.append(f"job {got.seed}: its final checkpoint was not found")
        elif got.checkpoint_sha256 != ref.checkpoint_sha256:
            found.append(f"job {got.seed}: its final checkpoint's bytes differ")
    return found


def compare(reference: list[JobOutcome], disturbed: list[JobOutcome]) -> Comparison:
    lost = duplicated = not_identical = 0
    for ref, got in zip(reference, disturbed, strict=True):
        lost += len(got.errors) + max(0, len(ref.losses) - len(got.losses))
        expected_steps = list(range(1, len(got.steps) + 1))
        duplicated += sum(1 for a, b in zip(got.steps, expected_steps, strict=True) if a != b)
        same = (
            got.losses == ref.losses
            and got.checkpoint_sha256 == ref.checkpoint_sha256
            and got.checkpoint_sha256 != ""
        )
        not_identical += 0 if same else 1
    return Comparison(lost, duplicated, not_identical)
