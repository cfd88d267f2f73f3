"""The SGLang sampler against a real SGLang 0.5.23 server on this machine's CPU.

Needs the SGLang venv (scripts/sglang.sh). Without it the module is skipped, except under
CI=true, where it fails: CI must install the tier. One server serves the whole module
(starting it takes minutes on a 2-core machine; conftest's session fixture, which
tests/test_sglang_worker.py's worker attaches to). Logprobs are checked against the same
weights run through transformers in the project's own venv.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from plexrl.messages import ErrorCode, SampleInput, SampleOutput, SamplingParams, StopReason
from plexrl_worker.engine.errors import NotFoundError
from plexrl_worker.sglang import (
    SGLangSampler,
    SGLangUnsupportedError,
    write_full_weights,
    write_lora_adapter,
)
from tests.conftest import require_sglang

PROMPT = [5, 17, 42, 99, 7, 300, 12]
LORA_RANK = 8
# SGLang's torch-native kernels and transformers' differ in float32 by up to ~1e-3 in a
# logprob (measured: 1.3e-3 with perturbed weights); a wrong weight moves them by ~1.
LOGPROB_TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def sglang_venv_python() -> Path:
    """Skips (or under CI fails) the module before anything is built."""
    return require_sglang()


@pytest.fixture(scope="module")
def model_dir(tiny_registry: Path) -> Path:
    return tiny_registry / "tiny-qwen3"


@pytest.fixture(scope="module")
def sampler(sglang_sampler: SGLangSampler) -> SGLangSampler:
    return sglang_sampler


def _greedy(n: int = 1, max_tokens: int = 8) -> SampleInput:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_at_eos=False)
    return SampleInput(prompt=PROMPT, num_samples=n, params=params)


def _hf_logprobs(
    weights: dict[str, torch.Tensor], model_dir: Path, tokens: list[int]
) -> list[float]:
    """What the model with `weights` gives each of `tokens` after PROMPT (T=1)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def _seq(out: SampleOutput) -> tuple[list[int], list[float]]:
    return out.sequences[0].tokens, out.sequences[0].logprobs


def test_generates_tokens_with_the_models_logprobs(sampler: SGLangSampler, model_dir: Path) -> None:
    out = sampler.sample(_greedy(n=2))
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == 8
        assert seq.stop_reason is StopReason.LENGTH
    assert out.sequences[0].tokens == out.sequences[1].tokens  # greedy
    tokens, logprobs = _seq(out)
    expected = _hf_logprobs(load_file(str(model_dir / "model.safetensors")), model_dir, tokens)
    assert logprobs == pytest.approx(expected, abs=LOGPROB_TOL)


def test_sampling_params_are_honoured(sampler: SGLangSampler, model_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, stop_at_eos=False)
    out = sampler.sample(SampleInput(prompt=PROMPT, num_samples=4, params=params))
    assert len(out.sequences) == 4
    assert all(len(s.tokens) == len(s.logprobs) == 12 for s in out.sequences)
    assert all(lp <= 0.0 for s in out.sequences for lp in s.logprobs)

    # A stop token ends the sequence, and is kept; with and without the end of sequence.
    greedy, _ = _seq(sampler.sample(_greedy()))
    stop = greedy[2]
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    for stop_at_eos in (False, True):
        ends = {stop, eos} if stop_at_eos else {stop}
        first = next(i for i, t in enumerate(greedy) if t in ends)
        params = SamplingParams(
            max_tokens=8, temperature=0.0, stop_tokens=[stop], stop_at_eos=stop_at_eos
        )
        seq = sampler.sample(SampleInput(prompt=PROMPT, num_samples=1, params=params)).sequences[0]
        assert seq.tokens == greedy[: first + 1]
        assert len(seq.logprobs) == first + 1
        assert seq.stop_reason is StopReason.STOP


def test_prompt_logprobs(sampler: SGLangSampler, model_dir: Path) -> None:
    inp = SampleInput(
        prompt=PROMPT,
        num_samples=1,
        params=SamplingParams(max_tokens=1, temperature=0.0),
        prompt_logprobs=True,
    )
    out = sampler.sample(inp)
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(PROMPT)
    assert out.prompt_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1], dim=-1)
    expected = logp[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])].tolist()
    assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=LOGPROB_TOL)


def test_weight_push_changes_output_and_old_weights_restore_it(
    sampler: SGLangSampler, model_dir: Path, tmp_path: Path
) -> None:
    before = _seq(sampler.sample(_greedy()))
    base = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    sampler.push_weights(write_full_weights(tmp_path / "step1", trained, base_model_dir=model_dir))
    after = _seq(sampler.sample(_greedy()))
    assert after != before
    assert after[1] == pytest.approx(_hf_logprobs(trained, model_dir, after[0]), abs=LOGPROB_TOL)

    sampler.push_weights(model_dir)
    assert _seq(sampler.sample(_greedy())) == before  # bit for bit


def test_lora_adapter_samples_come_from_the_adapter(
    sampler: SGLangSampler, model_dir: Path, tmp_path: Path
) -> None:
    base_out = _seq(sampler.sample(_greedy()))
    base = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(2)
    adapter: dict[str, torch.Tensor] = {}
    merged = dict(base)
    alpha = 16.0
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            prefix = f"model.layers.{layer}.{module}"
            w = base[f"{prefix}.weight"]
            a = 0.3 * torch.randn(LORA_RANK, w.shape[1], generator=gen)
            b = 0.3 * torch.randn(w.shape[0], LORA_RANK, generator=gen)
            adapter[f"{prefix}.lora_A.weight"] = a
            adapter[f"{prefix}.lora_B.weight"] = b
            merged[f"{prefix}.weight"] = w + (alpha / LORA_RANK) * (b @ a)
    path = write_lora_adapter(tmp_path / "job-a", adapter, rank=LORA_RANK, alpha=alpha)

    sampler.load_adapter("job-a", path)
    try:
        tokens, logprobs = _seq(sampler.sample(_greedy(), adapter="job-a"))
        assert (tokens, logprobs) != base_out
        assert logprobs == pytest.approx(_hf_logprobs(merged, model_dir, tokens), abs=LOGPROB_TOL)
        # Without the adapter the same server still samples the base model.
        assert _seq(sampler.sample(_greedy())) == base_out
    finally:
        sampler.unload_adapter("job-a")
    assert "job-a" not in sampler.adapters
    with pytest.raises(NotFoundError, match="load_adapter"):
        sampler.sample(_greedy(), adapter="job-a")
    assert _seq(sampler.sample(_greedy())) == base_out


def test_release_and_resume_leave_outputs_unchanged(sampler: SGLangSampler) -> None:
    before = _seq(sampler.sample(_greedy()))
    sampler.release_memory()
    sampler.resume_memory()
    assert _seq(sampler.sample(_greedy())) == before


def test_pause_holds_a_call_until_continue(sampler: SGLangSampler) -> None:
    expected = _seq(sampler.sample(_greedy()))
    sampler.pause_generation("retract")
    results: list[tuple[list[int], list[float]]] = []
    worker = threading.Thread(target=lambda: results.append(_seq(sampler.sample(_greedy()))))
    try:
        worker.start()
        worker.join(timeout=5)
        assert worker.is_alive() and not results  # held while paused
    finally:
        sampler.continue_generation()
    worker.join(timeout=120)
    assert results == [expected]


def test_per_request_seed_is_a_clear_user_error(sampler: SGLangSampler) -> None:
    params = SamplingParams(max_tokens=4, seed=1234)
    with pytest.raises(SGLangUnsupportedError) as info:
        sampler.sample(SampleInput(prompt=PROMPT, num_samples=1, params=params))
    assert info.value.code is ErrorCode.BAD_REQUEST
    message = str(info.value)
    assert "seed" in message
    assert "PLEXRL_SAMPLER=torch" in message


def test_a_dead_server_restarts_serving_the_same_weights(
    sampler: SGLangSampler, model_dir: Path, tmp_path: Path
) -> None:
    # Last in the module: it costs a second server start.
    base = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    sampler.push_weights(write_full_weights(tmp_path / "step2", trained, base_model_dir=model_dir))
    adapter = {}
    for module in ("q_proj", "v_proj"):
        w = base[f"model.layers.0.self_attn.{module}.weight"]
        adapter[f"model.layers.0.self_attn.{module}.lora_A.weight"] = 0.3 * torch.randn(
            LORA_RANK, w.shape[1], generator=gen
        )
        adapter[f"model.layers.0.self_attn.{module}.lora_B.weight"] = 0.3 * torch.randn(
            w.shape[0], LORA_RANK, generator=gen
        )
    sampler.load_adapter(
        "job-b", write_lora_adapter(tmp_path / "job-b", adapter, rank=LORA_RANK, alpha=8.0)
    )
    pushed = _seq(sampler.sample(_greedy()))
    adapted = _seq(sampler.sample(_greedy(), adapter="job-b"))
    restarts = sampler.restarts

    sampler.server.kill()
    assert not sampler.server.alive()
    assert _seq(sampler.sample(_greedy())) == pushed
    assert sampler.restarts == restarts + 1
    assert _seq(sampler.sample(_greedy(), adapter="job-b")) == adapted

    sampler.unload_adapter("job-b")
    sampler.push_weights(model_dir)


TP_ON_CPU = (
    "SGLang 0.5.23 cannot run --tp-size 2 on this CPU. Started as the worker starts it "
    "(`sglang.launch_server --device cpu --attention-backend torch_native --tp-size 2`), "
    "its scheduler fails in init_parallel_runtime: first `AssertionError: "
    "SGLANG_CPU_OMP_THREADS_BIND is not set, in this case, the total number of ranks "
    "(dp_size * tp_size * pp_size = 2) should be smaller than or equal to number of numa "
    "node on the machine 1`; with SGLANG_CPU_OMP_THREADS_BIND='0|1', `ValueError: Expected "
    "a cuda device, but got: cpu` from device_communicators/pynccl.py:116 (its tensor-"
    "parallel group always builds a PyNccl communicator off NPU/XPU). Needs 2 CUDA devices."
)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=TP_ON_CPU)
def test_a_tensor_parallel_server_over_two_devices_samples_the_models_logprobs(
    model_dir: Path, tmp_path: Path
) -> None:
    from plexrl_worker.sglang import SGLangServerConfig

    config = SGLangServerConfig(
        model_path=str(model_dir), device="cuda", tp_size=2, log_path=tmp_path / "tp.log"
    )
    assert "--tp-size" in config.command(30000)
    server = SGLangSampler(config)
    server.start()
    try:
        tokens, logprobs = _seq(server.sample(_greedy()))
    finally:
        server.stop()
    expected = _hf_logprobs(load_file(str(model_dir / "model.safetensors")), model_dir, tokens)
    assert logprobs == pytest.approx(expected, abs=LOGPROB_TOL)
