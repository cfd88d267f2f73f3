"""The worker's pause of a preempted batch: held until the next dispatch lets go of it,
or for a grace period if none comes; the sampler's pause and resume hooks run once."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from preempt_support import BASE, Scene, check_a_rollout_yields, finish_times, tokens
from tinker import types

from plexrl.failpoints import arm, armed
from plexrl_tools.cluster import ClusterConfig, LocalCluster
from plexrl_worker.preemption import Preemption


def test_a_hold_lasts_until_the_claiming_dispatch_opens_it() -> None:
    hooks: list[str] = []

    async def pause() -> None:
        hooks.append("pause")

    async def resume() -> None:
        hooks.append("resume")

    async def main() -> None:
        p = Preemption(pause=pause, resume=resume, grace_s=0.05)
        asked = p.yieldable("d1")
        assert await p.ask("d1") and asked.is_set()
        p.finished("d1")
        assert not await p.ask("d1")  # released already: nothing to yield
        await p.hold()
        claimed = p.claim()  # the next dispatch claims it: no expiry
        assert p.paused and claimed is not None
        await asyncio.sleep(0.1)
        assert p.paused and p.paused_seconds() >= 0.1  # not charged to the paused call
        await p.open(claimed)
        assert not p.paused and p.claim() is None
        held = p.paused_seconds()
        await asyncio.sleep(0.02)
        assert p.paused_seconds() == held  # no pause, no more
        await asyncio.wait_for(p.wait_open(), 1.0)

    asyncio.run(main())
    assert hooks == ["pause", "resume"]


def test_a_dispatch_lets_go_only_of_the_hold_it_claimed() -> None:
    async def main() -> None:
        p = Preemption(grace_s=0.05)
        await p.hold()
        claimed = p.claim()
        await p.open()  # its own sample calls join the batch: the pause lifts
        await p.hold()  # and its batch is preempted in turn, for the next dispatch
        await p.open(claimed)  # the claiming dispatch ends: the newer hold stays
        assert p.paused
        nxt = p.claim()
        assert nxt is not None and nxt != claimed
        await p.open(nxt)
        assert not p.paused

    asyncio.run(main())


def test_a_hold_no_dispatch_claims_expires() -> None:
    async def main() -> None:
        p = Preemption(grace_s=0.05)
        await p.hold()
        assert p.paused
        await asyncio.wait_for(p.wait_open(), 1.0)
        assert not p.paused and p.preempted == 1

    asyncio.run(main())


# Live: the scheduler preempts a long rollout for a neighbour's training call -------------


@pytest.mark.integration
def test_a_long_rollout_yields_to_a_short_training_call_and_samples_the_same(
    shared_cluster: ClusterConfig,
) -> None:
    # About a second of decoding on two cores; seeded, so the rollout is reproducible.
    params = types.SamplingParams(max_tokens=400, temperature=1.0, seed=11)
    check_a_rollout_yields(shared_cluster.gateway_url, "tml-preempt", params, num_samples=16)


@pytest.mark.integration
def test_a_worker_killed_while_a_rollout_is_preempted_answers_it_after_a_restart(
    infra: dict[str, str], tiny_registry: Path, tmp_path: Path
) -> None:
    # The preempted rollout's dispatch was acknowledged at its release: after the crash
    # Kafka does not bring it back; the scheduler must (it sees the restart in the next
    # heartbeat). The worker timeout is long, so this is a restart, never a lost worker.
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path,
        "prk",
        api_keys="tml-preempt-kill=prk",
        worker_threads=1,
        env={"PLEXRL_WORKER_TIMEOUT_S": "300"},
    )
    os.environ["HF_HUB_OFFLINE"] = "1"
    params = types.SamplingParams(max_tokens=400, temperature=1.0, seed=11)
    with LocalCluster(config) as cluster:
        scene = Scene(config.gateway_url, "tml-preempt-kill", params, num_samples=16)
        metrics = f"http://127.0.0.1:{config.worker_port(0)}/metrics"
        long, short = scene.preempting()
        deadline = time.monotonic() + 10
        while _counter(metrics, "plexrl_worker_preempted_batches_total") < 1:
            assert time.monotonic() < deadline, "no preemption"
            time.sleep(0.02)
        cluster.kill("worker-0")  # kill -9, the rollout paused or just resumed
        cluster.restart("worker-0")
        assert short.result(timeout=120).metrics["loss:sum"] == scene.loss
        assert tokens(long.result(timeout=120)) == tokens(scene.alone)
        log = cluster.logs()["scheduler"].read_text()
    assert "worker-0 restarted: requeued" in log  # the rollout was lost with it


def _metrics(config: ClusterConfig) -> str:
    return f"http://127.0.0.1:{config.worker_port(0)}/metrics"


def _counter(url: str, name: str) -> float:
    for line in httpx.get(url, timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# Live: an asynchronous job's training yields to a neighbour's rollout between slices -------

SLICE_KEY = "tml-slice"


class Training:
    """An asynchronous trainer job (staleness 1) whose forward_backward the worker runs in
    16 micro-batches, and a base-model sampling session beside it on one worker; what
    each takes alone measured first."""

    def __init__(self, gateway_url: str, worker_metrics: str, own: bool = False) -> None:
        """With `own`, the rollouts are the trainer's own, of its saved sampler weights."""
        self.metrics = worker_metrics
        self.trained = 0
        """forward_backward calls sent so far (each adds to the job's gradients)."""
        service = self.service = tinker.ServiceClient(base_url=gateway_url, api_key=SLICE_KEY)
        self.trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
        declared = httpx.post(
            f"{gateway_url}/plexrl/v1/jobs/{self.trainer.model_id}/options",
            json={"staleness": 1},
            headers={"X-API-Key": SLICE_KEY},
        )
        assert declared.status_code == 200, declared.text
        self.sampler: tinker.SamplingClient = (
            self.trainer.save_weights_and_get_sampling_client("own").result()
            if own
            else service.create_sampling_client(base_model=BASE).result()
        )
        # 256 rows of 64 tokens; the cluster's workers cut 1,024 tokens a micro-batch.
        self.data = [
            types.Datum(
                model_input=types.ModelInput.from_ints([5 + (r * 7 + i) % 600 for i in range(64)]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(
                        data=[5 + (r * 7 + i + 1) % 600 for i in range(64)], dtype="int64"
                    )
                },
            )
            for r in range(256)
        ]
        self.train().result()
        started = time.monotonic()
        self.alone = self.train().result()
        self.train_s = time.monotonic() - started
        self.sampled = self.rollout().result()

    def train(self) -> Any:
        """A forward_backward (no optimizer step ever: its outputs never change)."""
        self.trained += 1
        return self.trainer.forward_backward(self.data, "cross_entropy")

    def rollout(self) -> Any:
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5)
        prompt = types.ModelInput.from_ints([21, 22, 15, 9])
        return self.sampler.sample(prompt=prompt, num_samples=2, sampling_params=params)

    def preempting(self) -> tuple[Any, Any]:
        """A training call, and once it runs, a short rollout that should preempt it."""
        long = self.train()
        time.sleep(self.train_s / 4)
        return long, self.rollout()

    def preempted(self, attempts: int = 4) -> tuple[Any, Any]:
        """`preempting` until the worker preempts the training call (on a loaded machine
        the call may end before the rollout's preemption reaches it: the scheduler
        leaves a call past its expected end alone); those two calls, still running."""
        for _ in range(attempts):
            before = _counter(self.metrics, "plexrl_worker_preempted_training_total")
            long, short = self.preempting()
            deadline = time.monotonic() + 4 * self.train_s + 10
            while time.monotonic() < deadline:
                if _counter(self.metrics, "plexrl_worker_preempted_training_total") > before:
                    return long, short
                time.sleep(0.02)
            assert _same_training(long.result(timeout=180), self.alone)
            short.result(timeout=180)
        raise AssertionError(f"no preemption in {attempts} tries")


def _same_training(a: Any, b: Any) -> bool:
    return a.metrics == b.metrics and [o["logprobs"].data for o in a.loss_fn_outputs] == [
        o["logprobs"].data for o in b.loss_fn_outputs
    ]


@dataclass
class Slicing:
    """One cluster whose worker cuts a forward_backward into micro-batches of 1,024
    tokens, shared by the tests below (each makes jobs of its own; a test that kills
    the worker restarts it)."""

    config: ClusterConfig
    cluster: LocalCluster
    failpoints: Path


@pytest.fixture(scope="module")
def slicing(
    infra: dict[str, str], tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Slicing]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    failpoints = tmp_path_factory.mktemp("failpoints")
    config = ClusterConfig.on_free_ports(
        tiny_registry,
        tmp_path_factory.mktemp("slicing"),
        "psl",
        api_keys=f"{SLICE_KEY}=psl",
        worker_threads=1,
        env={
            "PLEXRL_WORKER_MAX_BATCH_TOKENS": "1024",
            "PLEXRL_WORKER_TIMEOUT_S": "300",
            "PLEXRL_FAILPOINTS_DIR": str(failpoints),
        },
    )
    with LocalCluster(config) as cluster:
        yield Slicing(config, cluster, failpoints)


@pytest.mark.integration
def test_an_asynchronous_jobs_training_yields_to_a_neighbours_rollout_and_trains_the_same(
    slicing: Slicing,
) -> None:
    config = slicing.config
    scene = Training(config.gateway_url, _metrics(config))
    since = time.time()
    long, short = scene.preempted()
    done = finish_times({"long": long, "short": short})
    assert done["short"][0] < done["long"][0], scene.train_s  # it did not wait for it all
    # Paused and resumed between micro-batches, the call computes what it did alone.
    assert _same_training(done["long"][1], scene.alone)
    assert tokens(done["short"][1]) == tokens(scene.sampled)
    with httpx.Client(
        base_url=config.gateway_url, headers={"X-API-Key": SLICE_KEY}, timeout=30
    ) as http:
        timeline = http.get("/plexrl/v1/timeline", params={"since": since}).json()
    trained = [e for e in timeline if e["function"] == "forward_backward" and e.get("preempted")]
    assert trained, timeline
    # The rollout that preempted it is the last (an attempt that saw no preemption
    # finished its own rollout first).
    sampled = [e["started_at"] for e in timeline if e["function"] == "sample"]
    assert sampled and max(sampled) >= trained[-1]["tail_released_at"] - 0.01


@pytest.mark.integration
def test_an_asynchronous_jobs_training_yields_to_its_own_next_rollout(slicing: Slicing) -> None:
    # The job's rollout lane samples its saved weights while its training lane trains:
    # that sample needs nothing of the training call, and goes past it at a micro-batch.
    config = slicing.config
    scene = Training(config.gateway_url, _metrics(config), own=True)
    long, short = scene.preempted()
    done = finish_times({"long": long, "short": short})
    assert done["short"][0] < done["long"][0], scene.train_s
    assert _same_training(done["long"][1], scene.alone)
    assert tokens(done["short"][1]) == tokens(scene.sampled)


@pytest.mark.integration
def test_a_worker_killed_while_training_is_preempted_answers_it_once_after_a_restart(
    slicing: Slicing,
) -> None:
    # The preempted call's dispatch was acknowledged at its release and its result not
    # committed: after the crash the scheduler sends it again (the restart shows in the
    # next heartbeat) and the job's ledger runs it once, from the restored state.
    config, cluster = slicing.config, slicing.cluster
    scene = Training(config.gateway_url, _metrics(config))
    long, short = scene.preempted()
    cluster.kill("worker-0")  # kill -9, the call paused or running on after its pause
    cluster.restart("worker-0")
    assert _same_training(long.result(timeout=180), scene.alone)
    assert tokens(short.result(timeout=180)) == tokens(scene.sampled)
    log = cluster.logs()["scheduler"].read_text()
    assert "worker-0 restarted: requeued" in log


@pytest.mark.integration
def test_a_released_training_call_committed_before_a_crash_is_answered_not_applied_again(
    slicing: Slicing,
) -> None:
    # Killed after the released call's ledger commit and before its answer: the
    # scheduler sends it again after the restart, and the ledger answers it. Applied
    # once: an optimizer step on top gives what a twin job gets from the same calls.
    config, cluster, failpoints = slicing.config, slicing.cluster, slicing.failpoints
    scene = Training(config.gateway_url, _metrics(config))
    arm(failpoints, "worker.released_committed")  # only a released call's commit reaches it
    long, short = scene.preempted()
    deadline = time.monotonic() + 60
    while armed(failpoints, "worker.released_committed"):
        assert time.monotonic() < deadline, "the released call never committed"
        time.sleep(0.05)
    cluster.wait_exit("worker-0", 30)
    cluster.restart("worker-0")
    assert _same_training(long.result(timeout=180), scene.alone)
    assert tokens(short.result(timeout=180)) == tokens(scene.sampled)
    twin = scene.service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    for _ in range(scene.trained):  # the same calls as the scene's trainer
        twin.forward_backward(scene.data, "cross_entropy").result()
    adam = types.AdamParams(learning_rate=1e-2)
    after = []
    for client in (scene.trainer, twin):
        client.optim_step(adam).result()
        after.append(client.forward_backward(scene.data, "cross_entropy").result())
    assert _same_training(after[0], after[1])


@pytest.mark.integration
def test_only_an_asynchronous_jobs_training_runs_a_micro_batch_at_a_time(
    slicing: Slicing,
) -> None:
    # The scheduler preempts an asynchronous job's training only; a synchronous job's
    # runs whole on the same worker, with the same result.
    config = slicing.config
    service = tinker.ServiceClient(base_url=config.gateway_url, api_key=SLICE_KEY)
    # 32 rows of 64 tokens: two micro-batches of 1,024 tokens.
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5 + (r * 3 + i) % 500 for i in range(64)]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(
                    data=[5 + (r * 3 + i + 1) % 500 for i in range(64)], dtype="int64"
                )
            },
        )
        for r in range(32)
    ]
    since = time.time()
    results, jobs = [], []
    for staleness in (0, 1):
        client = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
        declared = httpx.post(
            f"{config.gateway_url}/plexrl/v1/jobs/{client.model_id}/options",
            json={"staleness": staleness},
            headers={"X-API-Key": SLICE_KEY},
        )
        assert declared.status_code == 200, declared.text
        client.forward_backward(data, "cross_entropy").result()  # the options reached it
        results.append(client.forward_backward(data, "cross_entropy").result())
        jobs.append(client.model_id)
    assert _same_training(results[0], results[1])
    with httpx.Client(
        base_url=config.gateway_url, headers={"X-API-Key": SLICE_KEY}, timeout=30
    ) as http:
        timeline = http.get("/plexrl/v1/timeline", params={"since": since}).json()
    slices = {
        e["job_id"]: e["slices"] for e in timeline if e["function"] == "forward_backward"
    }  # each job's last
    assert [slices[job] for job in jobs] == [0, 2], timeline
