"""Co-batched sampling: calls of several jobs in one running batch give each job exactly
the samples it gets alone, whatever joins, leaves or shares the batch."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import msgspec
import pytest
import torch
import torch.nn.functional as F

from plexrl.messages import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    JobSpec,
    LoraSpec,
    LossFn,
    OptimStepInput,
    SampleInput,
    SampleOutput,
    SamplingParams,
    TensorArray,
)
from plexrl.models import ModelRegistry, init_tiny
from plexrl_worker.engine import EngineConfig, NotFoundError, TorchEngine
from plexrl_worker.engine.cobatch import _pass_modules, row_seed, rowwise_linear

BASE = "plexrl/tiny-qwen3"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    root = tmp_path_factory.mktemp("cobatch-models")
    init_tiny(root / "tiny")
    return ModelRegistry(root)


def _train(engine: TorchEngine, job: str, seed: int) -> None:
    """One optimizer step, so the job's weights differ from the base and each other."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(5, 700, (17,), generator=g).tolist()
    datum = Datum(
        tokens=seq[:-1], loss_fn_inputs={"target_tokens": TensorArray.from_list(seq[1:], "int64")}
    )
    engine.forward_backward(job, ForwardBackwardInput(data=[datum], loss_fn=LossFn.CROSS_ENTROPY))
    engine.optim_step(job, OptimStepInput(adam=AdamParams(learning_rate=5e-2)))


@pytest.fixture(scope="module")
def engine(registry: ModelRegistry) -> TorchEngine:
    engine = TorchEngine(registry, EngineConfig())
    for i, job in enumerate(["lora-a", "lora-b", "lora-c"]):
        engine.create(job, JobSpec(base_model=BASE, lora=LoraSpec(rank=4 + 4 * i), seed=i))
        _train(engine, job, seed=10 + i)
    engine.create("full", JobSpec(base_model=BASE, lora=None, seed=7))
    _train(engine, "full", seed=20)
    return engine


def _inp(
    prompt: list[int], num_samples: int, *, prompt_logprobs: bool = False, **params: object
) -> SampleInput:
    return SampleInput(
        prompt=prompt,
        num_samples=num_samples,
        params=msgspec.structs.replace(SamplingParams(max_tokens=12), **params),
        prompt_logprobs=prompt_logprobs,
    )


# Different jobs, prompt lengths, sample counts, lengths and sampling rules: rows of
# these calls finish at different steps, so the batch changes shape as it runs.
CALLS: list[tuple[str, SampleInput]] = [
    ("lora-a", _inp([21, 22, 15, 27, 33], 4, seed=1)),
    ("lora-b", _inp([30, 31], 3, seed=2, temperature=0.7, top_k=20)),
    ("lora-c", _inp([40, 41, 42, 43, 44, 45, 46, 47], 1, seed=3, max_tokens=20, top_p=0.9)),
    ("full", _inp([21, 22, 15], 2, seed=4, max_tokens=8)),
    (f"base:{BASE}", _inp([50, 51, 52], 2, seed=5, temperature=0.0)),
    ("lora-a", _inp([60, 61, 62, 63], 2, seed=6, max_tokens=5, prompt_logprobs=True)),
]


@pytest.fixture(scope="module")
def alone(engine: TorchEngine) -> list[SampleOutput]:
    return [engine.sample(weights_id, inp) for weights_id, inp in CALLS]


def test_each_call_samples_the_same_alone_or_co_batched(
    engine: TorchEngine, alone: list[SampleOutput]
) -> None:
    together = engine.sample_together(CALLS)
    assert together == alone
    # The jobs' samples differ from each other: the batch did not blur them together.
    assert len({tuple(o.sequences[0].tokens) for o in together[:3]}) == 3


def test_calls_joining_a_running_batch_sample_the_same(
    engine: TorchEngine, alone: list[SampleOutput]
) -> None:
    first = engine.begin_sample(*CALLS[0])
    engine.sample_step()
    engine.sample_step()
    second = engine.begin_sample(*CALLS[2])
    engine.sample_step()
    rest = engine.sample_together(CALLS[1:2] + CALLS[3:])
    while not (first.done and second.done):
        engine.sample_step()
    assert first.output() == alone[0]
    assert second.output() == alone[2]
    assert rest == alone[1:2] + alone[3:]


def test_samples_do_not_depend_on_the_batch_token_budget(
    registry: ModelRegistry, engine: TorchEngine, alone: list[SampleOutput]
) -> None:
    """With room for one row at a time the rows queue, yet sample the same."""
    small = TorchEngine(registry, EngineConfig(max_batch_tokens=8))
    small.create("lora-a", JobSpec(base_model=BASE, lora=LoraSpec(rank=4), seed=0))
    _train(small, "lora-a", seed=10)
    assert small.sample(*CALLS[0]) == alone[0]


def test_a_call_whose_weights_leave_answers_not_found(engine: TorchEngine) -> None:
    engine.create("brief", JobSpec(base_model=BASE, lora=LoraSpec(rank=2), seed=3))
    call = engine.begin_sample("brief", _inp([21, 22], 2, seed=1))
    engine.sample_step()
    engine.drop("brief")
    assert call.done and call.abandoned is not None
    assert "dropped while sampling" in call.abandoned
    assert engine.sampling_rows() == (0, 0)
    engine.create("brief", JobSpec(base_model=BASE, lora=LoraSpec(rank=2), seed=3))
    engine.begin_sample("brief", _inp([21, 22], 2, seed=1))
    engine.offload("brief")
    with pytest.raises(NotFoundError, match=r"brief"):
        engine.sample("brief", _inp([21, 22], 1, seed=1))


def test_rowwise_linear_gives_each_row_the_same_bits_in_any_batch() -> None:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    row = torch.randn(64, generator=g)
    ref = rowwise_linear(row[None, None], weight, bias)[0, 0]
    assert torch.allclose(ref, F.linear(row, weight, bias), atol=1e-5)
    for rows in (2, 3, 5, 7, 11, 16, 33):
        batch = torch.randn(rows, 1, 64, generator=g)
        at = rows // 2
        batch[at, 0] = row
        assert torch.equal(rowwise_linear(batch, weight, bias)[at, 0], ref), rows


def test_row_seeds_are_distinct_and_63_bit() -> None:
    seeds = {row_seed(s, i) for s in range(20) for i in range(50)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**63 for s in seeds)


def test_a_pass_walks_no_adapter_but_its_own(registry: ModelRegistry) -> None:
    # A worker holds up to max_samplers adapters on one base: a decode step must not
    # walk or patch them all (it did, and sampling ran 2.7x slower with 64 installed).
    engine = TorchEngine(registry, EngineConfig())
    engine.create("j", JobSpec(base_model=BASE, lora=LoraSpec(rank=4), seed=1))
    model = engine.bases.shared(engine.model_info(BASE)).model  # the shared base
    before = [len(x) for x in _pass_modules(model)]
    out = engine.sample("j", _inp([21, 22], 2, seed=3))
    state = engine.export_state("j", optimizer=False, gradients=False)
    for i in range(12):
        engine.install_sampler(f"s{i}", state)
    assert [len(x) for x in _pass_modules(model)] == before
    # And the samples of a set are what they were, however many others are installed.
    assert engine.sample("j", _inp([21, 22], 2, seed=3)) == out
