"""TorchEngine on CPU over a tiny local model: losses, optimizer, sampling, lossless swaps."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable

# No hub is reachable: anything that tried one would fail here instead of hanging.
os.environ["HF_HUB_OFFLINE"] = "1"

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plexrl.messages import (
    AdamParams,
    Datum,
    ErrorCode,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    JobSpec,
    LoraSpec,
    LossFn,
    OptimStepInput,
    SampleInput,
    SamplingParams,
    StopReason,
    TensorArray,
)
from plexrl.models import ModelRegistry, init_tiny
from plexrl_worker.engine import (
    EngineConfig,
    EngineInputError,
    JobTensors,
    NotFoundError,
    TorchEngine,
    UnknownJobError,
    state_from_bytes,
    state_to_bytes,
)
from plexrl_worker.engine.arrays import to_tensor

BASE = "plexrl/tiny-qwen3"
LORA = JobSpec(base_model=BASE, lora=LoraSpec(rank=8), seed=1)
FULL = JobSpec(base_model=BASE, lora=None, seed=1)
PROMPT = [21, 22, 15, 27, 33]  # "12+7=" in the tiny tokenizer
VOCAB_LOW, VOCAB_HIGH = 5, 700  # ordinary (non-special) token ids


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    root = tmp_path_factory.mktemp("engine-models")
    init_tiny(root / "tiny")
    return ModelRegistry(root)


@pytest.fixture
def engine(registry: ModelRegistry) -> TorchEngine:
    return TorchEngine(registry, EngineConfig())


def f32(values: list[float]) -> TensorArray:
    return TensorArray.from_list(values, "float32")


def ce_datum(seq: list[int], weights: list[float] | None = None) -> Datum:
    """Next-token prediction over `seq`: position i of seq[:-1] predicts seq[i + 1]."""
    inputs = {"target_tokens": TensorArray.from_list(seq[1:], "int64")}
    if weights is not None:
        inputs["weights"] = f32(weights)
    return Datum(tokens=seq[:-1], loss_fn_inputs=inputs)


def random_batch(seed: int, rows: int = 8, length: int = 64) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    return [
        ce_datum(torch.randint(VOCAB_LOW, VOCAB_HIGH, (length + 1,), generator=g).tolist())
        for _ in range(rows)
    ]


def ce(data: list[Datum], backward: bool = True) -> ForwardBackwardInput:
    return ForwardBackwardInput(data=data, loss_fn=LossFn.CROSS_ENTROPY, backward=backward)


def step(lr: float = 1e-2) -> OptimStepInput:
    return OptimStepInput(adam=AdamParams(learning_rate=lr))


def sample_input(
    num_samples: int = 4, prompt: list[int] | None = None, **params: object
) -> SampleInput:
    return SampleInput(
        prompt=prompt or PROMPT,
        num_samples=num_samples,
        params=msgspec.structs.replace(SamplingParams(max_tokens=16), **params),
    )


def outputs(out: ForwardBackwardOutput, key: str) -> list[torch.Tensor]:
    return [to_tensor(d[key]) for d in out.loss_fn_outputs]


def assert_same_state(a: JobTensors, b: JobTensors, *, metadata: bool = True) -> None:
    assert sorted(a.tensors) == sorted(b.tensors)
    for key in a.tensors:
        assert torch.equal(a.tensors[key], b.tensors[key]), key
    if metadata:
        assert a.metadata == b.metadata


# ---- training ------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "lr"), [(LORA, 1e-2), (FULL, 1e-3)], ids=["lora", "full"])
def test_cross_entropy_decreases_on_a_fixed_batch(
    engine: TorchEngine, spec: JobSpec, lr: float
) -> None:
    engine.create("job", spec)
    data = random_batch(0)
    losses = []
    for _ in range(4):
        out = engine.forward_backward("job", ce(data))
        losses.append(out.metrics["loss:sum"])
        metrics = engine.optim_step("job", step(lr)).metrics
        assert math.isfinite(metrics["grad_norm:mean"]) and metrics["grad_norm:mean"] > 0
    assert metrics["step:max"] == 4
    assert all(later < earlier for earlier, later in itertools.pairwise(losses))

    # A sum, not a mean: the metric is the sum of the per-token terms, which are -logp.
    terms = outputs(out, "elementwise_loss")
    assert out.metrics["loss:sum"] == pytest.approx(float(sum(t.sum() for t in terms)), rel=1e-5)
    for t, lp in zip(terms, outputs(out, "logprobs"), strict=True):
        assert t.shape == (64,)
        assert torch.equal(t, -lp)


def test_create_reports_the_registry_estimate(engine: TorchEngine, registry: ModelRegistry) -> None:
    info = registry.info(BASE)
    lora = engine.create("lora", LORA)
    assert lora.trainable_params == info.lora_params(8)
    assert lora.state_bytes == info.state_bytes(8) == engine.state_bytes("lora")
    full = engine.create("full", FULL)
    assert full.trainable_params == info.num_params
    assert full.state_bytes == info.state_bytes(None)
    assert engine.resident_jobs() == ["full", "lora"]
    assert engine.loaded_bases() == [BASE]


def test_logprobs_match_the_plain_model(engine: TorchEngine, registry: ModelRegistry) -> None:
    # A fresh LoRA has B = 0, so the job computes exactly what the base model does.
    engine.create("job", LORA)
    seq = [1, *PROMPT, 21, 29, 2]
    out = engine.forward_backward("job", ce([ce_datum(seq)], backward=False))
    model = AutoModelForCausalLM.from_pretrained(registry.resolve(BASE))
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]])).logits[0]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    torch.testing.assert_close(outputs(out, "logprobs")[0], expected, rtol=1e-5, atol=1e-5)


def test_weights_scale_cross_entropy_and_padding_is_invisible(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    long, short = random_batch(1, rows=1, length=40)[0], random_batch(2, rows=1, length=9)[0]
    alone = engine.forward_backward("job", ce([short], backward=False))
    # Batched with a longer datum, the short one is padded; its outputs must not move.
    both = engine.forward_backward("job", ce([long, short], backward=False))
    torch.testing.assert_close(
        outputs(both, "logprobs")[1], outputs(alone, "logprobs")[0], rtol=1e-5, atol=1e-5
    )
    weights = [0.0, 2.0] + [1.0] * 7
    seq = [*short.tokens, to_tensor(short.loss_fn_inputs["target_tokens"]).tolist()[-1]]
    weighted = engine.forward_backward("job", ce([ce_datum(seq, weights)], backward=False))
    lp = outputs(weighted, "logprobs")[0]
    torch.testing.assert_close(
        outputs(weighted, "elementwise_loss")[0], -torch.tensor(weights) * lp
    )


def test_importance_sampling_and_ppo_match_a_direct_computation(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    seq = [1, *PROMPT, 21, 29, 2]
    n = len(seq) - 1
    lp = outputs(engine.forward_backward("job", ce([ce_datum(seq)], backward=False)), "logprobs")[0]
    # Sampler logprobs chosen so the ratios straddle PPO's clip range on both sides.
    ratios = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.5, 2.0, 0.7, 1.3])[:n]
    advantages = torch.tensor([1.0, -1.0, 2.0, -0.5, 1.0, -1.0, -2.0, 0.5])[:n]
    sampler_lp = lp - torch.log(ratios)

    def datum() -> Datum:
        return Datum(
            tokens=seq[:-1],
            loss_fn_inputs={
                "target_tokens": TensorArray.from_list(seq[1:], "int64"),
                "logprobs": f32(sampler_lp.tolist()),
                "advantages": f32(advantages.tolist()),
            },
        )

    r = torch.exp(lp - torch.tensor(sampler_lp.tolist()))
    torch.testing.assert_close(r, ratios, rtol=1e-4, atol=1e-4)
    expected = {
        LossFn.IMPORTANCE_SAMPLING: -(r * advantages),
        LossFn.PPO: -torch.minimum(r * advantages, torch.clamp(r, 0.8, 1.2) * advantages),
    }
    for loss_fn, want in expected.items():
        out = engine.forward_backward(
            "job", ForwardBackwardInput(data=[datum()], loss_fn=loss_fn, backward=False)
        )
        got = outputs(out, "elementwise_loss")[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert out.metrics["loss:sum"] == pytest.approx(float(want.sum()), rel=1e-5, abs=1e-6)

    # Hand-checked: at ratio 2 with A = -1, PPO keeps the unclipped (more pessimistic) term.
    assert float(expected[LossFn.PPO][5]) == pytest.approx(2.0, rel=1e-4)
    # A tighter clip changes exactly the clipped tokens.
    out = engine.forward_backward(
        "job",
        ForwardBackwardInput(
            data=[datum()],
            loss_fn=LossFn.PPO,
            loss_fn_config={"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
            backward=False,
        ),
    )
    want = -torch.minimum(r * advantages, torch.clamp(r, 0.95, 1.05) * advantages)
    torch.testing.assert_close(outputs(out, "elementwise_loss")[0], want, rtol=1e-5, atol=1e-6)
    # And the RL losses train: their gradients reach the adapters.
    engine.forward_backward("job", ForwardBackwardInput(data=[datum()], loss_fn=LossFn.PPO))
    assert engine.optim_step("job", step()).metrics["grad_norm:mean"] > 0


def test_gradients_accumulate_until_optim_step(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    data = random_batch(3, rows=2, length=16)
    engine.forward_backward("job", ce(data, backward=False))
    assert not engine.export_state("job", optimizer=False, gradients=True).has("grads.")

    engine.forward_backward("job", ce(data))
    once = engine.export_state("job", optimizer=False, gradients=True).tensors
    engine.forward_backward("job", ce(data))
    twice = engine.export_state("job", optimizer=False, gradients=True).tensors
    grads = [k for k in once if k.startswith("grads.")]
    assert grads
    for k in grads:
        torch.testing.assert_close(twice[k], 2 * once[k])

    engine.optim_step("job", step())
    after = engine.export_state("job", optimizer=True, gradients=True)
    assert not after.has("grads.")
    assert after.has("optim.")
    assert not torch.equal(after.tensors[grads[0].replace("grads.", "weights.")], once[grads[0]])


def test_micro_batches_sum_like_one_batch(registry: ModelRegistry) -> None:
    data = random_batch(4, rows=4, length=32)
    results = []
    for budget in (16384, 40):  # 40 tokens: one datum per forward pass
        engine = TorchEngine(registry, EngineConfig(max_batch_tokens=budget))
        engine.create("job", LORA)
        out = engine.forward_backward("job", ce(data))
        results.append((out, engine.export_state("job", optimizer=False, gradients=True)))
    (whole, whole_state), (split, split_state) = results
    assert split.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(outputs(whole, "logprobs"), outputs(split, "logprobs"), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for k, v in whole_state.tensors.items():
        torch.testing.assert_close(split_state.tensors[k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("spec", [LORA, FULL], ids=["lora", "full"])
def test_a_call_run_a_slice_at_a_time_is_the_whole_call(
    registry: ModelRegistry, spec: JobSpec
) -> None:
    # Two jobs on one base; between the sliced call's micro-batches the other job trains
    # and samples (a shared base's active adapter changes), as on a worker that let a
    # neighbour's calls in while the call was paused. Bit for bit the whole call's.
    data = random_batch(5, rows=4, length=32)
    results = []
    for sliced in (False, True):
        engine = TorchEngine(registry, EngineConfig(max_batch_tokens=40))
        engine.create("job", spec)
        engine.create("other", LORA)
        if not sliced:
            out = engine.forward_backward("job", ce(data))
        else:
            run = engine.begin_forward_backward("job", ce(data))
            assert run.slices == 4 and run.ran == 0
            with pytest.raises(RuntimeError, match="0 of 4 slices"):
                run.output()
            while engine.forward_backward_slice(run):
                engine.forward_backward("other", ce(random_batch(6, rows=1, length=8)))
                engine.sample("other", sample_input(num_samples=1, seed=3))
            out = run.output()
        results.append((out, engine.export_state("job", optimizer=False, gradients=True)))
    (whole, whole_state), (split, split_state) = results
    assert split.metrics == whole.metrics
    for key in ("logprobs", "elementwise_loss"):
        for a, b in zip(outputs(whole, key), outputs(split, key), strict=True):
            assert torch.equal(a, b)
    assert_same_state(whole_state, split_state)


def test_a_sliced_call_whose_job_left_fails_at_its_next_slice(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    run = engine.begin_forward_backward("job", ce(random_batch(7, rows=2, length=16)))
    engine.offload("job")
    with pytest.raises(UnknownJobError):
        engine.forward_backward_slice(run)


# ---- sampling ------------------------------------------------------------------------


def test_sampling_is_seeded(engine: TorchEngine, registry: ModelRegistry) -> None:
    engine.create("job", LORA)
    a = engine.sample("job", sample_input(seed=7))
    assert a == engine.sample("job", sample_input(seed=7))
    assert a != engine.sample("job", sample_input(seed=8))
    assert len(a.sequences) == 4
    assert len({tuple(s.tokens) for s in a.sequences}) > 1, "samples of one call should differ"
    for s in a.sequences:
        assert len(s.tokens) == len(s.logprobs) <= 16
        assert all(lp <= 0 for lp in s.logprobs)
    # Another engine with the same weights draws the same tokens.
    other = TorchEngine(registry, EngineConfig())
    other.create("job", LORA)
    assert other.sample("job", sample_input(seed=7)) == a
    # No seed: fresh draws each time.
    unseeded = [engine.sample("job", sample_input(max_tokens=32)) for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_greedy_and_top_k_one_agree(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    greedy = engine.sample("job", sample_input(temperature=0.0, seed=1))
    assert len({tuple(s.tokens) for s in greedy.sequences}) == 1
    top1 = engine.sample("job", sample_input(top_k=1, seed=2))
    assert [s.tokens for s in top1.sequences] == [s.tokens for s in greedy.sequences]
    narrow = engine.sample("job", sample_input(top_p=1e-6, seed=3))
    assert [s.tokens for s in narrow.sequences] == [s.tokens for s in greedy.sequences]


def test_sampled_logprobs_match_a_forward_pass(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    # Train a little first, so the adapters are in play.
    engine.forward_backward("job", ce(random_batch(5, rows=2, length=16)))
    engine.optim_step("job", step())
    out = engine.sample("job", sample_input(num_samples=3, seed=11, max_tokens=12))
    for s in out.sequences:
        seq = PROMPT + s.tokens
        fwd = engine.forward_backward("job", ce([ce_datum(seq)], backward=False))
        scored = outputs(fwd, "logprobs")[0][len(PROMPT) - 1 :]
        torch.testing.assert_close(scored, torch.tensor(s.logprobs), rtol=1e-4, atol=1e-4)

    with_prompt = engine.sample(
        "job",
        SampleInput(
            prompt=PROMPT, num_samples=1, params=SamplingParams(max_tokens=1), prompt_logprobs=True
        ),
    )
    assert with_prompt.prompt_logprobs is not None
    assert with_prompt.prompt_logprobs[0] is None
    fwd = engine.forward_backward("job", ce([ce_datum(PROMPT)], backward=False))
    torch.testing.assert_close(
        torch.tensor(with_prompt.prompt_logprobs[1:]),
        outputs(fwd, "logprobs")[0],
        rtol=1e-4,
        atol=1e-4,
    )


def test_topk_prompt_logprobs(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    inp = SampleInput(
        prompt=PROMPT,
        num_samples=1,
        params=SamplingParams(max_tokens=1),
        prompt_logprobs=True,
        topk_prompt_logprobs=3,
    )
    out = engine.sample("job", inp)
    assert out.topk_prompt_logprobs is not None and out.prompt_logprobs is not None
    assert out.topk_prompt_logprobs[0] is None
    for pos, top in enumerate(out.topk_prompt_logprobs[1:], start=1):
        assert top is not None and len(top) == 3
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        plain = out.prompt_logprobs[pos]
        assert plain is not None and plain <= values[0] + 1e-6


def test_stop_tokens_and_strings(engine: TorchEngine, registry: ModelRegistry) -> None:
    engine.create("job", LORA)
    free = engine.sample("job", sample_input(num_samples=1, seed=5, max_tokens=24)).sequences[0]
    assert free.stop_reason == StopReason.LENGTH and len(free.tokens) == 24

    stop_token = free.tokens[6]
    first = free.tokens.index(stop_token)
    stopped = engine.sample(
        "job", sample_input(num_samples=1, seed=5, max_tokens=24, stop_tokens=[stop_token])
    ).sequences[0]
    assert stopped.stop_reason == StopReason.STOP
    assert stopped.tokens == free.tokens[: first + 1]  # the stop token is kept

    tok = AutoTokenizer.from_pretrained(registry.resolve(BASE))

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids))

    text = decode(free.tokens)
    stop_string = text[len(text) // 2 : len(text) // 2 + 2]
    by_string = engine.sample(
        "job", sample_input(num_samples=1, seed=5, max_tokens=24, stop_strings=[stop_string])
    ).sequences[0]
    assert by_string.stop_reason == StopReason.STOP
    assert by_string.tokens == free.tokens[: len(by_string.tokens)]
    assert stop_string in decode(by_string.tokens)
    assert stop_string not in decode(by_string.tokens[:-1])


def test_eos_stops_unless_told_not_to(engine: TorchEngine, registry: ModelRegistry) -> None:
    """Tinker's `stop: []` means no stop at all, not even end-of-sequence."""
    engine.create("job", FULL)
    eos = int(AutoTokenizer.from_pretrained(registry.resolve(BASE)).eos_token_id)
    for _ in range(15):  # teach it to end right after the prompt
        engine.forward_backward("job", ce([ce_datum([*PROMPT, eos])]))
        engine.optim_step("job", step(3e-2))
    ended = engine.sample(
        "job", sample_input(num_samples=1, temperature=0.0, max_tokens=6)
    ).sequences[0]
    assert ended.tokens == [eos] and ended.stop_reason == StopReason.STOP
    free = engine.sample(
        "job", sample_input(num_samples=1, temperature=0.0, max_tokens=6, stop_at_eos=False)
    ).sequences[0]
    assert free.tokens[0] == eos and len(free.tokens) == 6
    assert free.stop_reason == StopReason.LENGTH


def test_base_sampling_ignores_adapters(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    inp = sample_input(seed=4)
    base = engine.sample(f"base:{BASE}", inp)
    # B = 0 in a fresh LoRA: the job still samples exactly like its base.
    assert engine.sample("job", inp) == base
    engine.forward_backward("job", ce(random_batch(6, rows=2, length=16)))
    engine.optim_step("job", step(5e-2))
    assert engine.sample("job", inp) != base
    assert engine.sample(f"base:{BASE}", inp) == base
    with pytest.raises(NotFoundError, match="unknown base model"):
        engine.sample("base:no-such-model", inp)


def test_installed_sampler_weights(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    engine.forward_backward("job", ce(random_batch(7, rows=2, length=16)))
    engine.optim_step("job", step(5e-2))
    saved = state_from_bytes(
        state_to_bytes(engine.export_state("job", optimizer=False, gradients=False))
    )
    engine.install_sampler("tinker://run/sampler_weights/0001", saved)
    inp = sample_input(seed=9)
    assert engine.sample("tinker://run/sampler_weights/0001", inp) == engine.sample("job", inp)
    assert engine.installed_samplers() == ["tinker://run/sampler_weights/0001"]
    with pytest.raises(EngineInputError, match="sampler weight set"):
        engine.forward_backward("tinker://run/sampler_weights/0001", ce(random_batch(0)))
    assert engine.drop("tinker://run/sampler_weights/0001")
    with pytest.raises(UnknownJobError):
        engine.sample("tinker://run/sampler_weights/0001", inp)


def test_sampler_sets_beyond_the_bound_are_dropped_least_recently_sampled_first(
    registry: ModelRegistry,
) -> None:
    engine = TorchEngine(registry, EngineConfig(max_samplers=2))
    engine.create("job", LORA)
    saved = state_from_bytes(
        state_to_bytes(engine.export_state("job", optimizer=False, gradients=False))
    )
    inp = sample_input(seed=9, max_tokens=2)
    for name in ("s1", "s2", "s3"):  # an RL loop: new sampler weights every step
        engine.install_sampler(name, saved)
        engine.sample(name, inp)
    assert engine.installed_samplers() == ["s2", "s3"]
    engine.sample("s2", inp)  # s2 is now the most recent; s3 goes next
    engine.install_sampler("s4", saved)
    engine.sample("s4", inp)
    assert engine.installed_samplers() == ["s2", "s4"]
    with pytest.raises(UnknownJobError):  # the worker installs it again from its blob
        engine.sample("s1", inp)
    # A set that a call in the running batch reads is never dropped under it, least
    # recent though it is.
    running = engine.begin_sample("s2", sample_input(seed=1, max_tokens=12))
    engine.sample("s4", inp)
    for name in ("s5", "s6"):
        engine.install_sampler(name, saved)
    engine.sample("s6", sample_input(seed=2, max_tokens=1))
    assert not running.done
    assert engine.installed_samplers() == ["s2", "s6"]
    while not running.done:
        engine.sample_step()
    assert engine.installed_samplers() == ["s2", "s6"]


# ---- state: swaps, checkpoints -------------------------------------------------------


def swap(engine: TorchEngine, job_id: str) -> None:
    """Out to bytes (as the host and disk tiers hold it) and back in."""
    data = state_to_bytes(engine.offload(job_id))
    assert job_id not in engine.resident_jobs()
    engine.onload(job_id, state_from_bytes(data))


@pytest.mark.parametrize("spec", [LORA, FULL], ids=["lora", "full"])
def test_swaps_are_lossless(registry: ModelRegistry, spec: JobSpec) -> None:
    steps = 3

    def train(
        engine: TorchEngine, between: Callable[[], None]
    ) -> tuple[list[ForwardBackwardOutput], JobTensors]:
        outs = []
        for k in range(steps):
            outs.append(engine.forward_backward("a", ce(random_batch(10 + k, rows=4, length=24))))
            between()  # gradients are pending here: they must survive too
            outs.append(engine.forward_backward("a", ce(random_batch(20 + k, rows=2, length=40))))
            between()
            engine.optim_step("a", step(1e-2 if spec.lora else 1e-3))
            between()
        return outs, engine.export_state("a", optimizer=True, gradients=True)

    alone = TorchEngine(registry, EngineConfig())
    alone.create("a", spec)
    created_alone = alone.export_state("a", optimizer=False, gradients=False)
    alone_outs, alone_state = train(alone, lambda: None)

    shared = TorchEngine(registry, EngineConfig())
    # Another job on the same base, created first, trained in between.
    shared.create("b", JobSpec(base_model=BASE, lora=LoraSpec(rank=4), seed=2))
    shared.create("a", spec)
    assert_same_state(shared.export_state("a", optimizer=False, gradients=False), created_alone)
    other = random_batch(99, rows=3, length=20)

    def interleave() -> None:
        swap(shared, "a")
        shared.forward_backward("b", ce(other))
        shared.optim_step("b", step())
        swap(shared, "b")

    shared_outs, shared_state = train(shared, interleave)

    assert [o.metrics for o in shared_outs] == [o.metrics for o in alone_outs]
    assert [o.loss_fn_outputs for o in shared_outs] == [o.loss_fn_outputs for o in alone_outs]
    assert_same_state(shared_state, alone_state)
    assert shared_state.steps == steps
    assert shared_state.has("optim.") and shared_state.has("grads.") is False


def test_offload_frees_and_onload_refuses_duplicates(engine: TorchEngine) -> None:
    engine.create("job", LORA)
    engine.forward_backward("job", ce(random_batch(0, rows=1, length=8)))
    state = engine.offload("job")
    assert state.has("grads.") and state.metadata["kind"] == "lora"
    assert engine.resident_jobs() == []
    with pytest.raises(UnknownJobError, match="onload"):
        engine.forward_backward("job", ce(random_batch(0)))
    engine.onload("job", state)
    with pytest.raises(Exception, match="already has state"):
        engine.onload("job", state)
    assert engine.drop("job") and not engine.drop("job")


def test_import_weights_with_and_without_optimizer(engine: TorchEngine) -> None:
    engine.create("src", LORA)
    for k in range(2):
        engine.forward_backward("src", ce(random_batch(30 + k, rows=2, length=16)))
        engine.optim_step("src", step())
    checkpoint = state_from_bytes(
        state_to_bytes(engine.export_state("src", optimizer=True, gradients=False))
    )

    engine.create("dst", JobSpec(base_model=BASE, lora=LoraSpec(rank=8), seed=42))
    engine.forward_backward("dst", ce(random_batch(40, rows=1, length=8)))  # pending grads
    engine.import_weights("dst", checkpoint, optimizer=True)
    loaded = engine.export_state("dst", optimizer=True, gradients=True)
    source = engine.export_state("src", optimizer=True, gradients=True)
    assert_same_state(loaded, source, metadata=False)  # the jobs' seeds differ
    assert loaded.steps == source.steps == 2

    engine.import_weights("dst", checkpoint, optimizer=False)
    fresh = engine.export_state("dst", optimizer=True, gradients=True)
    assert not fresh.has("optim.") and fresh.steps == 0
    for key, value in fresh.tensors.items():
        assert torch.equal(value, checkpoint.tensors[key])
    # The same weights compute the same outputs (only the moments differ).
    data = ce(random_batch(50, rows=2, length=16))
    assert engine.forward_backward("dst", data) == engine.forward_backward("src", data)

    engine.create("small", JobSpec(base_model=BASE, lora=LoraSpec(rank=4)))
    with pytest.raises(EngineInputError, match="saved for LoRA"):
        engine.import_weights("small", checkpoint, optimizer=False)
    weights_only = engine.export_state("src", optimizer=False, gradients=False)
    with pytest.raises(EngineInputError, match="no optimizer state"):
        engine.import_weights("dst", weights_only, optimizer=True)


def test_state_bytes_round_trip() -> None:
    state = JobTensors(
        tensors={
            "weights.w": torch.randn(3, 4),
            "optim.w.step": torch.tensor(3.0),
            "grads.w": torch.zeros(3, 4),
        },
        metadata={
            "format": "plexrl.job_state/1",
            "spec": {"base_model": BASE, "lora": None, "seed": 0, "state_bytes": 0},
            "steps": 3,
            "kind": "full",
        },
    )
    back = state_from_bytes(state_to_bytes(state))
    assert_same_state(back, state)
    assert back.spec == JobSpec(base_model=BASE)
    with pytest.raises(ValueError, match="not a PlexRL job state"):
        state_from_bytes(b"garbage")


# ---- bad input -----------------------------------------------------------------------


def _datum(tokens: list[int], **inputs: TensorArray) -> Datum:
    return Datum(tokens=tokens, loss_fn_inputs=inputs)


def _ids(values: list[int]) -> TensorArray:
    return TensorArray.from_list(values, "int64")


BAD_CALLS: list[tuple[str, ForwardBackwardInput, str]] = [
    ("empty", ce([]), "data is empty"),
    ("no tokens", ce([_datum([], target_tokens=_ids([]))]), "no tokens"),
    ("token id", ce([_datum([1, 99999], target_tokens=_ids([1, 2]))]), r"tokens\[1\] is 99999"),
    ("target id", ce([_datum([1, 2], target_tokens=_ids([1, -3]))]), "outside the vocabulary"),
    ("length", ce([_datum([1, 2, 3], target_tokens=_ids([1, 2]))]), "one value per token"),
    ("dtype", ce([_datum([1, 2], target_tokens=f32([1.0, 2.0]))]), "send int64"),
    ("missing", ce([_datum([1, 2], weights=f32([1.0, 1.0]))]), "lacks"),
    (
        "unknown key",
        ce([_datum([1, 2], target_tokens=_ids([1, 2]), weight=f32([1.0, 1.0]))]),
        "does not read",
    ),
    (
        "rl inputs",
        ForwardBackwardInput(
            data=[_datum([1, 2], target_tokens=_ids([1, 2]), logprobs=f32([0.0, 0.0]))],
            loss_fn=LossFn.IMPORTANCE_SAMPLING,
        ),
        r"lacks \['advantages'\]",
    ),
    (
        "not finite",
        ForwardBackwardInput(
            data=[
                _datum(
                    [1, 2],
                    target_tokens=_ids([1, 2]),
                    logprobs=f32([0.0, 0.0]),
                    advantages=f32([1.0, float("nan")]),
                )
            ],
            loss_fn=LossFn.PPO,
        ),
        "NaN or infinity",
    ),
    (
        "bytes",
        ce([_datum([1, 2], target_tokens=TensorArray(dtype="int64", shape=[2], data=b"\0" * 9))]),
        "needs 16",
    ),
    ("too long", ce([ce_datum([5] * 600)]), "more than the model's 512 positions"),
    (
        "loss config",
        ForwardBackwardInput(
            data=random_batch(0, rows=1, length=4),
            loss_fn=LossFn.PPO,
            loss_fn_config={"clip_epsilon": 0.2},
        ),
        "clip_low_threshold",
    ),
]


@pytest.mark.parametrize(
    ("inp", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_forward_backward_input(
    engine: TorchEngine, inp: ForwardBackwardInput, message: str
) -> None:
    engine.create("job", LORA)
    with pytest.raises(EngineInputError, match=message) as err:
        engine.forward_backward("job", inp)
    assert err.value.code == ErrorCode.BAD_REQUEST
    # A rejected call leaves no trace.
    assert not engine.export_state("job", optimizer=True, gradients=True).has("grads.")


@pytest.mark.parametrize(
    ("inp", "message"),
    [
        (sample_input(prompt=[1, 5000]), r"prompt\[1\] is 5000"),
        (sample_input(max_tokens=600), "exceeds the model's 512 positions"),
        (sample_input(top_p=0.0), "top_p"),
        (sample_input(top_k=0), "top_k"),
        (sample_input(temperature=-1.0), "temperature"),
        (sample_input(stop_strings=[""]), "empty string"),
        (sample_input(num_samples=0), "num_samples"),
    ],
)
def test_bad_sample_input(engine: TorchEngine, inp: SampleInput, message: str) -> None:
    engine.create("job", LORA)
    with pytest.raises(EngineInputError, match=message):
        engine.sample("job", inp)


def test_engine_config_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EngineConfig(max_batch_tokens=0)
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0)
    with pytest.raises(ValueError, match="not a torch device"):
        EngineConfig(device="tpu-ish")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            EngineConfig(device="cuda")


def test_unknown_jobs_models_and_bad_specs(engine: TorchEngine) -> None:
    with pytest.raises(UnknownJobError) as err:
        engine.forward_backward("nope", ce(random_batch(0)))
    assert err.value.code == ErrorCode.NOT_FOUND
    with pytest.raises(UnknownJobError):
        engine.optim_step("nope", step())
    with pytest.raises(NotFoundError, match="available: plexrl/tiny-qwen3"):
        engine.create("job", JobSpec(base_model="Qwen/Qwen3-8B"))
    with pytest.raises(EngineInputError, match="rank"):
        engine.create("job", JobSpec(base_model=BASE, lora=LoraSpec(rank=0)))
    no_layers = LoraSpec(rank=4, train_attn=False, train_mlp=False)
    with pytest.raises(EngineInputError, match="adapts no layer"):
        engine.create("job", JobSpec(base_model=BASE, lora=no_layers))
    engine.create("job", LORA)
    with pytest.raises(EngineInputError, match="beta2"):
        engine.optim_step("job", OptimStepInput(adam=AdamParams(beta2=1.0)))


# ---- GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_and_swaps(registry: ModelRegistry) -> None:
    cpu = TorchEngine(registry, EngineConfig())
    gpu = TorchEngine(registry, EngineConfig(device="cuda"))
    for engine in (cpu, gpu):
        engine.create("job", LORA)
    # Adapters are initialised on the CPU from the seed: the same bits on any device.
    assert_same_state(
        gpu.export_state("job", optimizer=False, gradients=False),
        cpu.export_state("job", optimizer=False, gradients=False),
    )
    losses: dict[str, list[float]] = {"cpu": [], "gpu": []}
    for k in range(3):
        for name, engine in (("cpu", cpu), ("gpu", gpu)):
            out = engine.forward_backward("job", ce(random_batch(60 + k)))
            losses[name].append(out.metrics["loss:sum"])
            if name == "gpu":
                swap(engine, "job")
            engine.optim_step("job", step())
    assert losses["gpu"] == pytest.approx(losses["cpu"], rel=1e-3)
    assert losses["gpu"][-1] < losses["gpu"][0]
    assert gpu.sample("job", sample_input(seed=3)) == gpu.sample("job", sample_input(seed=3))
