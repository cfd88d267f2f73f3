"""The live preemption check, run against the torch sampler (tests/test_preemption.py) and
SGLang (tests/test_sglang_worker.py): a long rollout of one job yields to a short
training call of another on the same worker, and samples what it sampled alone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import tinker
from tinker import types

BASE = "plexrl/tiny-qwen3"


def finish_times(futures: dict[str, Any]) -> dict[str, tuple[float, Any]]:
    """Each future's result and when it came (monotonic), waited for on threads."""

    def wait(future: Any) -> tuple[float, Any]:
        result = future.result()
        return time.monotonic(), result

    with ThreadPoolExecutor(len(futures)) as pool:
        waiting = {name: pool.submit(wait, f) for name, f in futures.items()}
        return {name: w.result() for name, w in waiting.items()}


class Scene:
    """A trainer job and a base-model sampling session on one cluster, with what each
    call of theirs takes measured first (the scheduler's estimates come from it)."""

    def __init__(
        self, gateway_url: str, key: str, params: types.SamplingParams, num_samples: int
    ) -> None:
        service = tinker.ServiceClient(base_url=gateway_url, api_key=key)
        self.trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
        self.sampler = service.create_sampling_client(base_model=BASE).result()
        self.params = params
        self.num_samples = num_samples
        self.datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[6, 7, 8, 9, 10], dtype="int64")
            },
        )
        self.train().result()
        started = time.monotonic()
        self.alone = self.rollout().result()
        self.rollout_s = time.monotonic() - started
        self.loss = self.train().result().metrics["loss:sum"]

    def rollout(self) -> Any:
        prompt = types.ModelInput.from_ints([21, 22, 15, 9])
        return self.sampler.sample(
            prompt=prompt, num_samples=self.num_samples, sampling_params=self.params
        )

    def train(self) -> Any:
        """A forward_backward (no optimizer step ever: its loss never changes)."""
        return self.trainer.forward_backward([self.datum], "cross_entropy")

    def preempting(self) -> tuple[Any, Any]:
        """A rollout, and once it runs, a training call that should preempt it."""
        long = self.rollout()
        time.sleep(min(0.5, self.rollout_s / 4))
        return long, self.train()


def tokens(output: Any) -> list[list[int]]:
    return [s.tokens for s in output.sequences]


def check_a_rollout_yields(
    gateway_url: str, key: str, params: types.SamplingParams, num_samples: int
) -> None:
    """The rollout (`params`, deterministic: seeded or greedy) is preempted for a
    neighbour's forward_backward, which finishes first; the timeline shows the
    preemption; the rollout's tokens are those it sampled alone."""
    scene = Scene(gateway_url, key, params, num_samples)
    since = time.time()
    long, short = scene.preempting()
    done = finish_times({"long": long, "short": short})
    assert done["short"][0] < done["long"][0], scene.rollout_s  # it did not wait for it all
    assert done["short"][1].metrics["loss:sum"] == scene.loss
    # Paused and resumed, the rollout samples what it sampled alone.
    assert tokens(done["long"][1]) == tokens(scene.alone)

    with httpx.Client(base_url=gateway_url, headers={"X-API-Key": key}, timeout=30) as http:
        timeline = http.get("/plexrl/v1/timeline", params={"since": since}).json()
    preempted = [e for e in timeline if e["function"] == "sample" and e.get("preempted")]
    assert preempted, timeline
    released_at = preempted[0]["tail_released_at"]
    trained = [e for e in timeline if e["function"] == "forward_backward"]
    assert trained and trained[0]["started_at"] >= released_at - 0.01
