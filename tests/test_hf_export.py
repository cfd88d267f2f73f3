"""Trained weights as Hugging Face files (plexrl.hf_export), read back with plain
transformers and peft — no PlexRL code on the loading side — computing the same
logprobs as the engine that trained them; their age encryption; the URL signer.

Tolerance: float32 on CPU, logprobs agree within 1e-5 absolute (measured here: equal to
the bit; the bound leaves room for kernels that sum in another order).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyrage
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load as st_load
from transformers import AutoModelForCausalLM, AutoTokenizer

from plexrl import age_encryption, hf_export
from plexrl.messages import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    JobSpec,
    LoraSpec,
    LossFn,
    OptimStepInput,
    TensorArray,
)
from plexrl.models import ModelRegistry
from plexrl_gateway.signing import BadSignature, Expired, UrlSigner, signing_secret
from plexrl_worker.engine import EngineConfig, TorchEngine
from plexrl_worker.engine.arrays import to_tensor
from plexrl_worker.engine.state import WEIGHTS

BASE = "plexrl/tiny-qwen3"
SEQ = [1, 21, 22, 15, 27, 33, 21, 29, 40, 51, 2]
ATOL = 1e-5


@pytest.fixture(scope="module")
def registry(tiny_registry: Path) -> ModelRegistry:
    return ModelRegistry(tiny_registry)


def datum(seq: list[int]) -> Datum:
    target = TensorArray.from_list(seq[1:], "int64")
    return Datum(tokens=seq[:-1], loss_fn_inputs={"target_tokens": target})


def trained(registry: ModelRegistry, spec: JobSpec, lr: float) -> TorchEngine:
    """An engine holding job "j" after two optimizer steps (so LoRA's B is not zero)."""
    engine = TorchEngine(registry, EngineConfig())
    engine.create("j", spec)
    batch = ForwardBackwardInput(data=[datum(SEQ)], loss_fn=LossFn.CROSS_ENTROPY)
    for _ in range(2):
        engine.forward_backward("j", batch)
        engine.optim_step("j", OptimStepInput(AdamParams(learning_rate=lr)))
    return engine


def engine_logprobs(engine: TorchEngine) -> torch.Tensor:
    inp = ForwardBackwardInput(data=[datum(SEQ)], loss_fn=LossFn.CROSS_ENTROPY, backward=False)
    out = engine.forward_backward("j", inp)
    return to_tensor(out.loss_fn_outputs[0]["logprobs"])


def exported(engine: TorchEngine, registry: ModelRegistry, out: Path) -> dict[str, bytes]:
    state = engine.export_state("j", optimizer=False, gradients=False)
    weights = {k.removeprefix(WEIGHTS): t for k, t in state.tensors.items()}
    info = registry.info(BASE)
    base_files = hf_export.base_model_files(info.path) if state.spec.lora is None else None
    files = hf_export.export_files(weights, state.spec, info, base_files)
    out.mkdir()
    for name, data in files.items():
        (out / name).write_bytes(data)
    return files


def plain_logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([SEQ[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(SEQ[1:])[:, None])[:, 0]


@pytest.mark.parametrize(
    "lora",
    [LoraSpec(rank=4, alpha=8.0), LoraSpec(rank=2, train_mlp=False, train_unembed=True)],
    ids=["attn-mlp-alpha8", "attn-unembed"],
)
def test_a_lora_export_is_a_peft_adapter_with_the_engines_logprobs(
    registry: ModelRegistry, tmp_path: Path, lora: LoraSpec
) -> None:
    engine = trained(registry, JobSpec(base_model=BASE, lora=lora, seed=3), lr=1e-2)
    files = exported(engine, registry, tmp_path / "adapter")
    assert list(files) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads(files["adapter_config.json"])
    assert (config["r"], config["lora_alpha"]) == (lora.rank, lora.alpha or lora.rank)
    expected_targets = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if lora.train_mlp:
        expected_targets |= {"gate_proj", "up_proj", "down_proj"}
    if lora.train_unembed:
        expected_targets.add("lm_head")
    assert set(config["target_modules"]) == expected_targets  # short names, as SGLang reads
    keys = set(st_load(files["adapter_model.safetensors"]))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert all(k.startswith("base_model.model.") for k in keys)

    base = AutoModelForCausalLM.from_pretrained(registry.resolve(BASE), dtype=torch.float32)
    before = plain_logprobs(base)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    loaded = plain_logprobs(model)
    ours = engine_logprobs(engine)
    torch.testing.assert_close(loaded, ours, rtol=0, atol=ATOL)
    assert (loaded - before).abs().max() > 1e-3  # the adapter is there, and trained


def test_a_full_fine_tune_exports_a_standalone_model_directory(
    registry: ModelRegistry, tmp_path: Path
) -> None:
    engine = trained(registry, JobSpec(base_model=BASE, seed=3), lr=1e-3)
    files = exported(engine, registry, tmp_path / "model")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(
        files
    )
    assert "plexrl.json" not in files and not any(n.startswith(".") for n in files)
    assert json.loads(files["config.json"])["dtype"] == "float32"

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    torch.testing.assert_close(plain_logprobs(model), engine_logprobs(engine), rtol=0, atol=ATOL)
    base = AutoModelForCausalLM.from_pretrained(registry.resolve(BASE))
    assert (plain_logprobs(model) - plain_logprobs(base)).abs().max() > 1e-3
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    text = tokenizer.decode(tokenizer.encode("12+7="))
    assert isinstance(text, str) and text.strip().endswith("12+7=")


def test_weights_that_are_not_a_lora_are_refused(registry: ModelRegistry) -> None:
    spec = JobSpec(base_model=BASE, lora=LoraSpec(rank=2))
    with pytest.raises(hf_export.ExportError, match="not a LoRA weight"):
        hf_export.export_files({"model.norm.weight": torch.ones(3)}, spec, registry.info(BASE))
    with pytest.raises(hf_export.ExportError, match="config files"):
        hf_export.export_files({"x": torch.ones(1)}, JobSpec(base_model=BASE), registry.info(BASE))


def test_files_encrypted_to_age_and_ssh_recipients_open_with_either_identity(
    tmp_path: Path,
) -> None:
    native = pyrage.x25519.Identity.generate()
    key = tmp_path / "id_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30
    )
    recipients = age_encryption.parse_recipients(
        [str(native.to_public()), (tmp_path / "id_ed25519.pub").read_text().strip()]
    )
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": os.urandom(4096)}
    sealed = age_encryption.encrypt_files(files, recipients)
    assert list(sealed) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    ssh_identity = pyrage.ssh.Identity.from_buffer(key.read_bytes())
    for name, data in files.items():
        assert sealed[name + ".age"] != data
        assert pyrage.decrypt(sealed[name + ".age"], [native]) == data
        assert pyrage.decrypt(sealed[name + ".age"], [ssh_identity]) == data


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("age1notakey", "not a valid key"),
        ("ssh-ed25519 AAAAnope", "not a valid key"),
        ("hello", "neither a native age key"),
    ],
)
def test_bad_recipients_say_which_and_why(key: str, message: str) -> None:
    with pytest.raises(age_encryption.RecipientError, match=message):
        age_encryption.parse_recipients([key])


def test_too_many_recipients_are_refused() -> None:
    key = str(pyrage.x25519.Identity.generate().to_public())
    with pytest.raises(age_encryption.RecipientError, match="at most 10"):
        age_encryption.parse_recipients([key] * 11)


def test_a_signed_url_is_good_until_it_expires_and_worthless_once_altered() -> None:
    now = [1000.0]
    signer = UrlSigner(b"secret", clock=lambda: now[0])
    path, file = "tinker://run:0/external_weights/final", "adapter_model.safetensors"
    sig = signer.sign(path, file, 1060)
    signer.check(path, file, 1060, sig)
    for altered in [
        (path + "x", file, 1060, sig),
        (path, "config.json", 1060, sig),
        (path, file, 1061, sig),
        (path, file, 1060, "0" * 64),
        (path, file, 1060, "é"),
    ]:
        with pytest.raises(BadSignature):
            signer.check(*altered)
    with pytest.raises(BadSignature):
        UrlSigner(b"other").check(path, file, 1060, sig)
    now[0] = 1060.0
    with pytest.raises(Expired, match="expired 0 s ago"):
        signer.check(path, file, 1060, sig)
    past = signer.sign(path, file, 900)
    with pytest.raises(Expired, match="expired 160 s ago"):
        signer.check(path, file, 900, past)


def test_the_signing_secret_comes_from_the_setting_or_the_service_token() -> None:
    assert signing_secret("set", "token") == b"set"
    derived = signing_secret(None, "token")
    assert derived == signing_secret(None, "token") and b"token" not in derived
    assert signing_secret(None, "other") != derived
    assert signing_secret(None, None) != signing_secret(None, None)  # random per process
