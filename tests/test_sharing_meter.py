"""The costs of sharing as the worker measures them on its own calls
(`plexrl_worker.sharing`), and as the scheduler learns them from the workers
(`plexrl.policy.costs.learned`): the engine switch, the share of the device a released tail
takes from a call beside it, and how much slower the tail decodes then."""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import msgspec
import pytest
from prometheus_client import REGISTRY

from plexrl.messages import (
    Datum,
    ForwardBackwardInput,
    Function,
    JobSpec,
    LoraSpec,
    LossFn,
    PhaseRequest,
    SampleInput,
    SamplingParams,
    SharingMeasured,
    TensorArray,
)
from plexrl.models import ModelRegistry, init_tiny
from plexrl.policy import PolicyConfig
from plexrl.policy.costs import SharingCosts, by_worker, learned, moved
from plexrl_scheduler import metrics
from plexrl_scheduler.main import learn_costs_of
from plexrl_scheduler.state import ClusterState
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine_thread import EngineThread
from plexrl_worker.sharing import SharingMeter
from tests.test_scheduler_state import Clock, beat
from tests.test_tail_release import engine_runner

BASE = "plexrl/tiny-qwen3"
FB = Function.FORWARD_BACKWARD


def _call(meter: SharingMeter, job: str, seconds: float, work: int = 10) -> None:
    mark = meter.call_began(job)
    meter.call_ended(mark, job, FB, work, seconds)


def test_a_change_of_job_costs_what_its_call_takes_over_the_jobs_own_pace() -> None:
    meter = SharingMeter()
    _call(meter, "a", 1.0)
    _call(meter, "a", 1.0)  # a's pace: 0.1 s per token
    _call(meter, "b", 2.0, work=20)  # b's first call: no pace of b's yet to compare with
    _call(meter, "b", 2.0, work=20)
    _call(meter, "a", 1.3)  # after b: 0.3 s over a's pace
    _call(meter, "b", 2.1, work=20)  # after a: 0.1 s over b's pace
    _call(meter, "a", 1.2)  # after b (its state swapped in first: not its compute): 0.2 s
    measured = meter.measured()
    assert measured.switches == 3
    assert measured.switch_s == pytest.approx(0.2)
    assert measured.shared_calls == 0 and measured.tail_steps == 0


def test_a_tail_beside_a_call_takes_its_share_and_decodes_slower() -> None:
    meter = SharingMeter()
    _call(meter, "b", 1.0)
    _call(meter, "b", 1.0)
    meter.batch_ran(frozenset({"a"}))
    meter.tails += 1  # a's batch released: its tail decodes on
    for _ in range(3):
        meter.tail_step(0.01, beside=False)
    _call(meter, "b", 1.25 + 0.0)  # after a's batch: a switch (none measured: 0 s)
    _call(meter, "b", 1.6)  # the tail took 1 - 1/1.6 of the device from it
    meter.tail_step(0.03, beside=True)
    meter.tail_step(0.05, beside=True)
    meter.tails -= 1
    _call(meter, "b", 1.0)  # alone again
    measured = meter.measured()
    assert measured.shared_calls == 2
    assert measured.tail_share == pytest.approx(((1 - 1 / 1.25) + (1 - 1 / 1.6)) / 2)
    assert measured.tail_steps == 2  # the fewer of 2 beside and 3 alone
    assert measured.tail_contention == pytest.approx(0.04 / 0.01)


def test_a_call_a_tail_met_only_in_part_or_that_failed_is_no_sample() -> None:
    meter = SharingMeter()
    _call(meter, "b", 1.0)
    mark = meter.call_began("b")
    meter.tails += 1  # released while the call ran
    meter.call_ended(mark, "b", FB, 10, 1.5)
    _call(meter, "b", 0.0)  # failed: no seconds
    assert meter.measured().shared_calls == 0
    assert meter.running == 0


def test_the_scheduler_predicts_with_what_the_workers_measured_once_they_measured_enough() -> None:
    setting = SharingCosts(switch_s=1.0, tail_min_share=0.25, tail_contention=1.25)
    w1 = SharingMeasured(switch_s=0.002, switches=15, tail_share=0.2, shared_calls=4)
    w2 = SharingMeasured(
        switch_s=0.004,
        switches=5,
        tail_share=0.3,
        shared_calls=4,
        tail_contention=1.5,
        tail_steps=30,
    )
    now = learned(setting, [w1, w2, None], least=20)
    assert now.switch_s == pytest.approx(0.0025)  # 20 samples between them, weighted
    assert now.tail_min_share == 0.25  # 8 samples: the setting still
    assert now.tail_contention == pytest.approx(1.5)
    assert learned(setting, [w1, w2], least=0) == setting  # learning off
    assert moved(setting, now)
    assert not moved(now, learned(now, [w1, w2], least=20))
    # Measured out of the policy's range: held inside it.
    odd = SharingMeasured(tail_share=0.95, shared_calls=50, tail_contention=0.8, tail_steps=50)
    held = learned(setting, [odd], least=20)
    assert held.tail_min_share < 0.9 and held.tail_contention == 1.0


def test_a_worker_whose_costs_stand_apart_is_predicted_with_its_own() -> None:
    pool = SharingCosts(switch_s=0.01, tail_min_share=0.2, tail_contention=1.5)
    # A slower engine on w1: its switch 5x the pool's, its stragglers decoding 3x slower.
    apart = SharingMeasured(switch_s=0.05, switches=30, tail_contention=3.0, tail_steps=40)
    alike = SharingMeasured(switch_s=0.0101, switches=30, tail_contention=1.52, tail_steps=40)
    few = SharingMeasured(switch_s=0.5, switches=3)
    measured = {"w0": alike, "w1": apart, "w2": few, "w3": None}
    own = by_worker(pool, measured, {}, least=20)
    assert list(own) == ["w1"]  # w0 within the pool's figures, w2 and w3 too few samples
    assert own["w1"] == SharingCosts(switch_s=0.05, tail_min_share=0.2, tail_contention=3.0)
    # A figure moving less than the rule's thresholds keeps the one predicted with.
    nudged = {
        "w1": SharingMeasured(switch_s=0.051, switches=31, tail_contention=3.01, tail_steps=41)
    }
    assert by_worker(pool, nudged, own, least=20)["w1"] is own["w1"]
    assert by_worker(pool, {"w0": alike}, own, least=20) == {}  # w1 gone: the pool's
    assert by_worker(pool, measured, own, least=0) == {}  # learning off


def test_the_scheduler_predicts_a_group_with_its_workers_figures_where_they_stand_apart() -> None:
    clock = Clock()
    state = ClusterState(clock=clock)
    fast = SharingMeasured(switch_s=0.01, switches=30, tail_contention=1.5, tail_steps=40)
    slow = SharingMeasured(switch_s=0.05, switches=30, tail_contention=3.0, tail_steps=40)
    for worker, measured in (("w0", fast), ("w1", fast), ("w2", slow)):
        state.on_heartbeat(msgspec.structs.replace(beat(worker), sharing=measured))
    policy = learn_costs_of(state, PolicyConfig(name="plexrl"), least=20)
    # The pool: the three workers' mean, which the policy predicts every group with...
    assert policy.sharing.switch_s == pytest.approx(0.07 / 3)
    assert policy.sharing.tail_contention == pytest.approx(2.0)
    # ...but w2's, whose worker measured its own apart from it (w0's and w1's 0.010 s
    # against the pool's 0.023 s are too, by more than a tenth).
    views = state.snapshot().workers
    assert views["w2"].sharing == replace(policy.sharing, switch_s=0.05, tail_contention=3.0)
    assert views["w0"].sharing == replace(policy.sharing, switch_s=0.01, tail_contention=1.5)
    metrics.observe_costs(policy.sharing, state.sharing)
    assert _gauge("w2", "tail_contention") == 3.0 and _gauge("w0", "switch_s") == 0.01
    # Once the pool's figures are its own (w2 gone), a group is predicted with the pool's.
    del state.workers["w2"]
    policy = learn_costs_of(state, policy, least=20)
    assert policy.sharing.switch_s == pytest.approx(0.01)
    assert state.snapshot().workers["w0"].sharing is None
    metrics.observe_costs(policy.sharing, state.sharing)
    assert _gauge("w0", "switch_s") is None and _gauge("w2", "switch_s") is None


def _gauge(worker: str, cost: str) -> float | None:
    labels = {"worker": worker, "cost": cost}
    return REGISTRY.get_sample_value("plexrl_scheduler_worker_sharing_cost", labels)


def _engine(root: Path, config: EngineConfig) -> TorchEngine:
    engine = TorchEngine(ModelRegistry(root), config)
    for seed, job in enumerate(("a", "b"), start=1):
        engine.create(job, JobSpec(base_model=BASE, lora=LoraSpec(rank=4), seed=seed))
    return engine


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("meter-models")
    init_tiny(root / "tiny")
    return root


@pytest.fixture(scope="module")
def engine(models: Path) -> TorchEngine:
    return _engine(models, EngineConfig())


def _request(job: str, rid: str, payload: Any, function: Function) -> PhaseRequest:
    return PhaseRequest(
        request_id=rid,
        job_id=job,
        tenant="t",
        function=function,
        payload=payload,
        arrival_time=0.0,
        spec=JobSpec(base_model=BASE, lora=LoraSpec(rank=4)),
    )


def _fb(job: str, i: int) -> PhaseRequest:
    rng = random.Random(i)
    data = []
    for _ in range(4):
        seq = [rng.randrange(5, 700) for _ in range(33)]
        targets = TensorArray.from_list(seq[1:], "int64")
        data.append(Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": targets}))
    inp = ForwardBackwardInput(data=data, loss_fn=LossFn.CROSS_ENTROPY)
    return _request(job, f"{job}-fb{i}", inp, FB)


def _sample(rid: str, samples: int, tokens: int) -> PhaseRequest:
    params = SamplingParams(max_tokens=tokens, seed=len(rid), stop_at_eos=False)
    inp = SampleInput(prompt=[21, 22, 15], num_samples=samples, params=params)
    return _request("a", rid, inp, Function.SAMPLE)


def test_the_worker_measures_its_engine_on_its_own_calls(engine: TorchEngine) -> None:
    """On the live engine: b's training calls alone, then taking turns with a's (the
    switch), then beside a's rollout released at its tail (the share, the contention);
    the tail ends alone."""

    async def main() -> SharingMeasured:
        thread = EngineThread()
        runner = engine_runner(engine, thread)
        try:
            for i in range(3):
                assert (await runner.run(_fb("a", i))).error is None
            for i in range(3):
                assert (await runner.run(_fb("b", i))).error is None
            for i in range(3, 6):  # turns: each a change of job
                await runner.run(_fb("a", i))
                await runner.run(_fb("b", i))
            released = asyncio.Event()

            async def on_tail(running: list[int], remaining: int, total: int) -> None:
                released.set()

            calls = [_sample("short1", 3, 2), _sample("short2", 3, 2), _sample("long", 1, 80)]
            batch = asyncio.create_task(
                runner.run_samples(calls, tail_threshold=0.25, on_tail=on_tail)
            )
            await released.wait()
            for i in range(6, 12):  # beside the tail
                await runner.run(_fb("b", i))
            rans = await batch  # the tail's last steps alone
            assert all(r.error is None for r in rans)
            assert runner.meter.tails == 0 and runner.meter.running == 0
            return runner.meter.measured()
        finally:
            thread.shutdown()

    measured = asyncio.run(main())
    assert measured.switches == 6
    assert measured.switch_s >= 0.0
    assert measured.shared_calls >= 3
    assert 0.0 <= measured.tail_share < 0.9
    assert measured.tail_steps >= 3
    assert measured.tail_contention > 1.0  # the one engine thread: it waits for the calls


class _Held:
    """A sliced call's pause (the edge of this test): notes whether the meter counted
    the call as computing while it was held between two slices."""

    released_at: float | None = None

    def __init__(self, meter: SharingMeter) -> None:
        self.meter = meter
        self.running: list[int] = []

    async def between(self) -> None:
        self.running.append(self.meter.running)
        await asyncio.sleep(0.01)

    def paused_s(self) -> float:
        return 0.0


def test_a_training_call_held_between_slices_is_not_computing(models: Path) -> None:
    """Preempted at a micro-batch, a training call computes nothing: a tail's steps
    meanwhile are not beside a call."""
    engine = _engine(models, EngineConfig(max_batch_tokens=64))  # 4 x 32 tokens: 2 slices

    async def main() -> tuple[list[int], int]:
        thread = EngineThread()
        runner = engine_runner(engine, thread)
        held = _Held(runner.meter)
        try:
            ran = await runner.run(_fb("a", 0), slicing=held)
            assert ran.error is None and ran.slices >= 2
            return held.running, runner.meter.running
        finally:
            thread.shutdown()

    held_running, after = asyncio.run(main())
    assert held_running and set(held_running) == {0}
    assert after == 0
